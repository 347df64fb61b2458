"""Stage `rm`: an ensemble of K outcome reward models.

In:  models/<rm.init> (sft, verifier or base), data/prepared/prefs.parquet,
     data/prepared/prefs_eval.parquet.
Out: models/rm/member_<i>, metrics/rm.json (held-out pairwise accuracy per member and for
     the ensemble mean, and per kind of flaw), plots/rm/member_<i>.csv (loss and accuracy
     on the training batches, per step).

Each member is trained by TRL's `RewardTrainer` (Bradley-Terry loss,
-log sigmoid(r_chosen - r_rejected)) from the same initial model with a different seed, which
changes the data order (and a classifier's new score head): what makes the members disagree
where the data is thin. The ensemble mean is the reward; the spread is an uncertainty
estimate (rlhf.rewards.ensemble). Two kinds of member:

* `likelihood` (default): the LM's log-probs of the response, min and mean, through a
  two-weight head (rlhf.rewards.likelihood_rm). The head starts from a Bradley-Terry fit on the
  frozen LM, fitted once for all members; RewardTrainer then trains LM and head together.
* `classifier`: TRL's default, a sequence classifier scoring the last token. On the built-in
  task it stays near chance: a slip in the middle of a solution is not visible to it.

Members are trained one after another to bound memory. A finished member is kept under
checkpoints/rm/<fingerprint>/ until the stage completes, so a killed run resumes at the
member (and the checkpoint) it had reached.

    python -m stages.rm
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rlhf.atomic import atomic_dir, write_csv, write_json
from rlhf.models.folders import MEMBER_PREFIX, check_model_dir, resolve_model_dir
from rlhf.tasks import Task, get_task
from rlhf.training.params import LoraParams, TrainingParams
from stages import CHECKPOINTS_DIR, DATA_DIR, MODELS_DIR, RM_DIR, drop_out, has_rows, load_model_stage

DATA = DATA_DIR / "prefs.parquet"
EVAL_DATA = DATA_DIR / "prefs_eval.parquet"
OUT_DIR = RM_DIR
METRICS = Path("metrics/rm.json")
PLOTS = Path("plots/rm")  # member_<i>.csv: step, loss, accuracy (train batches)


class Config(TrainingParams):
    TRL_CONFIG: ClassVar[str | None] = "RewardConfig"

    kind: Literal["likelihood", "classifier"] = Field(
        "likelihood", description="likelihood (LM log-probs + head) | classifier (sequence-classification head)"
    )
    init: Literal["sft", "verifier", "base"] = Field("sft", description="model the members start from")
    num_members: int = Field(3, ge=1, le=16, description="K, reward models in the ensemble")
    max_steps: int = Field(60, gt=0, description="optimizer steps per member")
    per_device_train_batch_size: int = Field(32, gt=0, description="pairs per step")
    learning_rate: float = Field(1e-4, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per prompt+response (longer pairs are dropped)")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="pull rewards towards 0 (TRL); unset: 0.01 for classifier, none for likelihood"
    )
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")

    def cross_problems(self, run, section: str) -> list[str]:
        return run.adapter_problems(section, self)

    def trl_args(self) -> dict[str, Any]:
        return {
            **super().trl_args(),
            "max_length": self.max_length,
            "center_rewards_coefficient": self.center_rewards_coefficient,
        }

    @model_validator(mode="before")
    @classmethod
    def _centring_default(cls, data):
        # A classifier's rewards drift without it; the likelihood head starts centred (fit_head).
        if isinstance(data, dict) and data.get("kind") == "classifier":
            data = {"center_rewards_coefficient": 0.01, **data}
        return data


def init_dir(config: Config) -> Path:
    return MODELS_DIR / config.init


def train_member(config: Config, index: int, init: Path, train, tokenizer, root: Path) -> list[dict]:
    """Train member `index` into root/member_<index>/final (skipped when already there).
    `train`: the preference rows (classifier) or the fitted head and tokenized pairs
    (likelihood, see `likelihood_start`)."""
    from transformers import set_seed
    from trl import RewardConfig, RewardTrainer

    from rlhf.models.compute import is_main
    from rlhf.models.loading import save_model
    from rlhf.rewards.likelihood_rm import LikelihoodRewardModel
    from rlhf.rewards.likelihood_rm_training import LikelihoodRewardTrainer, ResponseMaskCollator
    from rlhf.tracking.runs import nested_run
    from rlhf.training.trainer_setup import (
        final_weights,
        log_history_rows,
        plain_model,
        tracking_callbacks,
        train_resumable,
        trainable_in_compute_dtype,
        trainer_loading,
        trl_config,
    )

    member_root = root / f"{MEMBER_PREFIX}{index}"
    final = member_root / "final"
    if (final / "config.json").exists():
        print(f"rm: member {index} already trained in {final}, reusing it")
        return []
    seed = config.seed + index
    # The classifier kind: TRL loads it from its path, as params `model` says.
    loading, loader_kwargs = trainer_loading(config, config.trust_remote_code, RewardTrainer)
    args = trl_config(
        RewardConfig,
        config.model_copy(update={"seed": seed}),
        member_root,
        key="rm",
        run_name=f"rm-member-{index}",
        # The likelihood kind's rows carry where each response starts, for its collator.
        remove_unused_columns=config.kind == "classifier",
        trust_remote_code=config.trust_remote_code,
        **({"model_init_kwargs": loading} if config.kind == "classifier" else {}),
    )
    if config.kind == "classifier":
        trainer = RewardTrainer(
            model=str(resolve_model_dir(init)),
            args=args,
            train_dataset=train,
            processing_class=tokenizer,
            peft_config=config.lora.peft_config("SEQ_CLS"),
            callbacks=tracking_callbacks(),
            **loader_kwargs,
        )
        trainable_in_compute_dtype(trainer)
    else:
        head, dataset = train
        set_seed(seed)
        model = LikelihoodRewardModel(load_lm(config, init), *head)
        trainer = LikelihoodRewardTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            data_collator=ResponseMaskCollator(pad_token_id=tokenizer.pad_token_id),
            callbacks=tracking_callbacks(),
        )
    # Each member logs its curves to a run nested in the stage's run (the members' training
    # arguments differ, and MLflow params of one run cannot change).
    with nested_run(f"rm-member-{index}"):
        train_resumable(trainer, f"rm member {index}", str(member_root))
    # Atomically: `final` existing is what marks the member done for a resumed run.
    with atomic_dir(final) as tmp:  # rank 0's is renamed into place, another rank's discarded
        # A QLoRA member is merged into its base loaded again unquantized (plain_model).
        if config.kind == "classifier":
            from transformers import AutoModelForSequenceClassification

            model, state_dict = final_weights(  # every process takes part in a sharded gather
                trainer, init, trust_remote_code=config.trust_remote_code,
                auto_class=AutoModelForSequenceClassification, num_labels=1,
            )  # fmt: skip
            save_model(model, tokenizer, tmp, state_dict)
        elif is_main():  # data-parallel only (rlhf check refuses to shard this kind): rank 0 merges and writes
            trainer.model.save(tokenizer, tmp, lm=plain_model(trainer.model.lm, init, config.trust_remote_code))
    return [{**row, "member": index} for row in log_history_rows(trainer.state.log_history, ("loss", "accuracy"))]


def load_lm(config: Config, init: Path):
    """The likelihood kind's LM, with a LoRA adapter when configured."""
    from rlhf.models.loading import load_causal_lm

    lm = load_causal_lm(init, config.trust_remote_code, what=f"rm.init model ({init})", training=True,
                        adapters=config.lora.enabled)  # fmt: skip
    if config.lora.enabled:
        from peft import get_peft_model

        lm = get_peft_model(lm, config.lora.peft_config("CAUSAL_LM"))
    return lm


def likelihood_start(config: Config, init: Path, pairs, tokenizer) -> tuple[tuple, object, dict]:
    """The likelihood kind's shared start: the tokenized pairs (a Dataset) and the head
    fitted on the frozen initial LM (once for all members), with what the fit found."""
    from rlhf.models.loading import load_causal_lm
    from rlhf.rewards.likelihood_rm import LikelihoodRewardModel
    from rlhf.rewards.likelihood_rm_training import fit_head, pairs_dataset

    dataset, dropped = pairs_dataset(tokenizer, pairs, config.max_length)
    lm = load_causal_lm(init, config.trust_remote_code, what=f"rm.init model ({init})", training=True)
    model = LikelihoodRewardModel(lm)
    curve = fit_head(model, dataset, tokenizer.pad_token_id)
    settings = model.settings()
    head = (settings["weights"], settings["bias"])
    fit = {"head_weights": dict(zip(settings["features"], settings["weights"])), "head_fit_loss": curve[-1]["loss"]}
    print(f"rm: head fitted on the frozen {init.name} model: {fit}; {dropped} pairs over max_length dropped")
    return head, dataset, {**fit, "dropped_pairs": dropped}


def held_out_scores(ensemble, task: Task, eval_data: Path):
    """The ensemble's scores of the held-out pairs' chosen and rejected responses (each an
    `EnsembleScores` over all pairs), and each pair's kind of mistake (`accuracy_by_flaw`),
    read a batch at a time: only the scores are held."""
    from rlhf.data.prepared import prepared_batches
    from rlhf.rewards.ensemble import EnsembleScores

    chosen, rejected, kinds = [], [], []
    for pairs in prepared_batches(eval_data, ["prompt", "chosen", "rejected"]):
        prompts = pairs["prompt"].tolist()
        chosen.append(ensemble.score(prompts, pairs["chosen"].tolist()))
        rejected.append(ensemble.score(prompts, pairs["rejected"].tolist()))
        kinds += [task.classify_error(p, r) for p, r in zip(prompts, pairs["rejected"])]
    return EnsembleScores.concatenate(chosen), EnsembleScores.concatenate(rejected), kinds


def accuracy_by_flaw(kinds: list, chosen, rejected) -> dict[str, float]:
    """Ensemble accuracy per kind of mistake in the rejected response (`kinds`: each pair's,
    where the task can name it, else None): which mistakes the reward model can and cannot
    see; empty when the task names none."""
    from rlhf.rewards.ensemble import pairwise_accuracy

    result = {}
    for kind in sorted({k for k in kinds if k}):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        result[kind] = pairwise_accuracy(chosen[rows], rejected[rows])
    return result


def run(config: Config, task: Task, init: Path, data: Path, eval_data: Path, out_dir: Path) -> tuple[dict, list[dict]]:
    from rlhf.data.prepared import prepared_dataset
    from rlhf.models.compute import is_main, release_memory, world_size
    from rlhf.models.loading import load_tokenizer
    from rlhf.rewards.ensemble import RewardEnsemble, pairwise_accuracy
    from rlhf.rewards.likelihood_rm_training import pairs_dataset
    from rlhf.training.trainer_setup import checkpoint_dir, fingerprint, last_logged

    stage = "rm"
    check_model_dir(resolve_model_dir(init), f"rm.init {config.init!r} ({init})")
    tokenizer = load_tokenizer(init, config.trust_remote_code)
    pairs = prepared_dataset(data, "rm")  # memory-mapped: its tokenisation is cached with it
    start = time.perf_counter()
    if config.kind == "classifier":
        from rlhf.models.folders import UnusableModelError
        from rlhf.models.loading import missing_classifier_type

        if unsupported := missing_classifier_type(resolve_model_dir(init), config.trust_remote_code, "Sequence"):
            raise UnusableModelError(
                f"rm.init {config.init!r} ({init}): rm.kind classifier puts a sequence-classification head on the "
                f"model, and transformers has none for model type {unsupported!r}; set rm.kind: likelihood (it "
                "scores with the LM itself)"
            )
        # TRL's RewardTrainer leaves out pairs longer than max_length without a word: count
        # them the way it tokenizes (and fail here when that is every pair).
        _, dropped = pairs_dataset(tokenizer, pairs, config.max_length)
        if dropped:
            print(f"rm: {dropped} of {len(pairs)} pairs are longer than rm.max_length {config.max_length} tokens and "
                  "are left out of training; raise rm.max_length to keep them")  # fmt: skip
        train, fit = pairs, {"dropped_pairs": dropped}
    else:
        head, dataset, fit = likelihood_start(config, init, pairs, tokenizer)
        train = (head, dataset)
        release_memory()  # the frozen LM of the head's fit
    root = checkpoint_dir(CHECKPOINTS_DIR, stage, fingerprint(config, [init, data]))
    curve: list[dict] = []
    for index in range(config.num_members):
        curve += train_member(config, index, init, train, tokenizer, root)
        release_memory()  # the member's trainer and optimizer, before the next one loads
    if not is_main():  # another process of a multi-process launch: rank 0 evaluates and publishes
        return {}, curve
    for index in range(config.num_members):
        shutil.copytree(root / f"{MEMBER_PREFIX}{index}" / "final", out_dir / f"{MEMBER_PREFIX}{index}")
    train_seconds = time.perf_counter() - start

    ensemble = RewardEnsemble.load(out_dir, config.trust_remote_code, resident=False)  # a member at a time
    chosen, rejected, flaws = held_out_scores(ensemble, task, eval_data)
    metrics = {
        "ensemble_accuracy": pairwise_accuracy(chosen.mean, rejected.mean),
        "members": {
            f"{MEMBER_PREFIX}{i}": {
                "accuracy": pairwise_accuracy(chosen.members[i], rejected.members[i]),
                "train_loss": last_logged([r for r in curve if r["member"] == i], "loss"),
            }
            for i in range(config.num_members)
        },
        "accuracy_by_flaw": accuracy_by_flaw(flaws, chosen.mean, rejected.mean),
        "mean_margin": float((chosen.mean - rejected.mean).mean()),
        "mean_std": float(((chosen.std + rejected.std) / 2).mean()),
        "eval_pairs": len(flaws),
        "processes": world_size(),
        **fit,
        "train_seconds": train_seconds,
    }
    return metrics, curve  # the checkpoints stay until main has published the ensemble


def main() -> None:
    import mlflow

    from rlhf.models.compute import is_main
    from rlhf.tracking.runs import log_table, numeric_metrics, stage_run, tracked
    from rlhf.training.trainer_setup import discard_checkpoints

    params = load_model_stage(override=lambda p: p["rm"].model, key="rm")
    config, task = params["rm"], get_task(params["task"])
    with stage_run("rm", config) as active:
        with atomic_dir(OUT_DIR) as tmp:
            if not has_rows(DATA):
                # No preference data: the RM drops out (check_params refuses params that need it).
                reason = "no preference data: give prepare.files.prefs (prompt, chosen, rejected)"
                drop_out("rm", tmp, reason, METRICS, PLOTS / f"{MEMBER_PREFIX}0.csv")
                return
            metrics, curve = run(config, task, init_dir(config), DATA, EVAL_DATA, tmp)
        if is_main():  # published: the checkpoints are no longer needed to resume
            discard_checkpoints(CHECKPOINTS_DIR, "rm")
        if active is None:  # not rank 0 of a multi-process launch: rank 0 publishes
            return
        write_json(METRICS, metrics)
        with atomic_dir(PLOTS) as plots:
            for index in range(config.num_members):
                write_csv(
                    plots / f"{MEMBER_PREFIX}{index}.csv",
                    [{k: v for k, v in r.items() if k != "member"} for r in curve if r["member"] == index],
                )
        with tracked("the metrics and the members' curves"):
            mlflow.log_metrics(numeric_metrics(metrics))
            mlflow.log_artifacts(str(PLOTS), "plots")
        log_table(DATA, "training")
        log_table(EVAL_DATA, "evaluation")
        print(f"rm: ensemble held-out pairwise accuracy {metrics['ensemble_accuracy']:.3f}")


if __name__ == "__main__":
    main()
