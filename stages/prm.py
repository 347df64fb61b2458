"""Stage `prm`: a process reward model that scores every step of a solution.

In:  models/<prm.init> (the verifier by default; sft or base), data/prepared/prm.parquet and
     prm_eval.parquet (prompt, completions = the steps, labels = one bool per step; the final
     answer line is a step) when the user gives step labels, else data/prepared/prompts.parquet
     (labels derived by rollouts, `derive`).
Out: models/prm (with prm.json naming its kind and the task's step separator; a classifier's
     LoRA adapter is merged on save), metrics/prm.json, plots/prm/loss.csv.

Labels follow Math-Shepherd (Wang et al., 2024): a step is good while the chain is still on
the way to the right answer; the first wrong step and everything after it are bad. Given
labels are used as they are; without a prm file they are estimated as the paper does, by
Monte-Carlo rollouts from each step (`derive`, rlhf.rewards.prm_labels: hard, any rollout
reaches the answer; or soft, a share of them).

Two kinds (`kind`):
* `likelihood` (the default): the LM of `init` scores each step by how surprised it is,
  with a calibration fitted on the labelled rows (rlhf.rewards.prm_likelihood); it trains
  no weights, so the training keys are errors under it.
* `classifier`: a token-classification head trained on the labels. The label of a step
  sits on the last token of the separator that follows it (rlhf.rewards.prm_classifier),
  so one forward pass scores every prefix; the loss is a two-class cross-entropy at the
  step positions through transformers' `Trainer` (TRL has no PRM trainer). Checkpoints go
  to checkpoints/prm/<fingerprint>/; a killed run resumes from the last.

Metrics on the held-out rows: step accuracy, F1 of the bad and of the good steps (f1_bad is
the headline), first-error accuracy, and outcome accuracy of each aggregation (min, prod,
last).

    python -m stages.prm
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf.atomic import atomic_dir, write_csv, write_json
from rlhf.models.folders import check_model_dir, resolve_model_dir
from rlhf.params import StageConfig, reject_unused
from rlhf.tasks import get_task
from rlhf.training.params import LoraParams, TrainingParams
from stages import CHECKPOINTS_DIR, DATA_DIR, MODELS_DIR, PRM_DIR, PROMPTS_FILE, SFT_DIR, drop_out, load_model_stage

DATA = DATA_DIR / "prm.parquet"
EVAL_DATA = DATA_DIR / "prm_eval.parquet"
PROMPTS = PROMPTS_FILE
DERIVED_FILE = "derived_labels.parquet"
OUT_DIR = PRM_DIR
METRICS = Path("metrics/prm.json")
PLOT = Path("plots/prm/loss.csv")
CURVE_KEYS = ("loss", "learning_rate")


class DeriveLabels(StageConfig):
    """Math-Shepherd step labels by rollouts of the SFT model (rlhf.rewards.prm_labels),
    used when no prm file is given and the task's answers can be checked."""

    prompts: int = Field(200, gt=0, description="prompts (with answers) of data/prepared/prompts.parquet used")
    samples_per_prompt: int = Field(4, gt=0, description="solutions sampled per prompt")
    rollouts: int = Field(4, gt=0, description="continuations from each step")
    max_new_tokens: int = Field(64, gt=0, description="tokens per solution and per rollout")
    temperature: float = Field(0.7, gt=0, description="sampling temperature of solutions and rollouts")
    estimate: Literal["hard", "soft"] = Field("hard", description="hard: any rollout reaches the answer; soft: a share")
    threshold: float = Field(0.5, gt=0, le=1, description="soft: the share of rollouts that makes a step good")
    eval_share: float = Field(0.2, gt=0, lt=1, description="share of the derived rows held out (prm_eval)")
    seed: int = Field(0, description="sampling seed")
    batch_size: int = Field(64, gt=0, description="sequences per generation batch (solutions, then rollouts)")


class Config(TrainingParams):
    kind: Literal["likelihood", "classifier"] = Field(
        "likelihood",
        description="likelihood: calibrated LM surprise (rlhf.rewards.prm_likelihood); classifier: trained head",
    )
    init: Literal["verifier", "sft", "base"] = Field(
        "verifier", description="model the PRM starts from (likelihood: the LM it reads)"
    )
    max_steps: int = Field(400, gt=0, description="optimizer steps")
    per_device_train_batch_size: int = Field(32, gt=0, description="solutions per step")
    learning_rate: float = Field(1e-3, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per row (longer rows keep the whole steps that fit)")
    score_batch_size: int = Field(64, gt=0, description="rows per forward pass when scoring the held-out set")
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")
    derive: DeriveLabels = Field(
        default_factory=DeriveLabels, description="step labels by rollouts, when no prm file is given"
    )

    def cross_problems(self, run, section: str) -> list[str]:
        if self.kind == "likelihood":  # reads the LM, trains nothing: quantized is fine
            return []
        return run.full_training_problems(section, self, "prm.kind classifier trains its new head")

    @model_validator(mode="after")
    def _training_keys_need_training(self):
        if self.kind == "likelihood":
            training = (set(TrainingParams.model_fields) | {"lora"}) - {"model"}  # `model` says how it loads
            reject_unused(self, training, "by kind likelihood, which fits a calibration and trains no weights")
        return self


def init_dir(config: Config) -> Path:
    return MODELS_DIR / config.init


def check_separator(config: Config, separator: str) -> None:
    """The task's step separator must be a token of the init model's tokenizer: each step's
    label or score sits on its separator's tokens. Checked before labels are derived by
    rollouts or a model loads (a tokenizer that drops newlines refused the default)."""
    from rlhf.models.loading import load_tokenizer
    from rlhf.params import PARAMS_FILE, ParamsError

    init = init_dir(config)
    check_model_dir(resolve_model_dir(init), f"prm.init {config.init!r} (models/{config.init})")
    if not load_tokenizer(init, config.trust_remote_code)(separator, add_special_tokens=False)["input_ids"]:
        raise ParamsError(PARAMS_FILE, [
            f"task.step_separator: {separator!r} tokenizes to nothing with the tokenizer of {init.as_posix()}, and "
            "the PRM marks each step on its separator's tokens; choose one it keeps (for example ';')"
        ])  # fmt: skip


def load_labels(config: Config, task, data: Path, eval_data: Path, out_dir: Path) -> tuple:
    """The training step labels (a `datasets.Dataset`), the held-out ones (a frame) and the
    derivation's counts: the prepared files, or, when they have no rows, labels derived by
    rollouts of models/sft (saved as `derived_labels.parquet` in `out_dir`). (None, None,
    reason) when there are neither."""
    import numpy as np
    import pandas as pd
    from datasets import Dataset

    from rlhf.data.contracts import contract_batches, validate_contract
    from rlhf.data.prepared import prepared_dataset, prepared_rows, read_prepared

    if prepared_rows(data, "prm"):
        # Both tables are checked before any model is loaded: a bad row fails in a second.
        # The training table a batch at a time, then memory-mapped (its tokens are cached
        # with it); the held-out rows are scored as one table.
        held_out = read_prepared(eval_data, "prm")
        if not len(held_out):
            raise ValueError(f"{eval_data} has no rows: give prepare.files.prm_eval with prepare.files.prm")
        held = validate_contract(held_out, "prm", eval_data)
        for _ in contract_batches(data, "prm"):
            pass
        return prepared_dataset(data, "prm"), held, None
    if not task.checks_answers:
        return None, None, f"no step labels: give prepare.files.prm (task.kind {task.name!r} cannot derive them)"
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.prm_labels import derive_step_labels

    prompts = read_prepared(PROMPTS, "prm", ["prompt", "answer"])
    if "answer" not in prompts:
        prompts["answer"] = None
    prompts = prompts[prompts["answer"].notna()].head(config.derive.prompts)
    if not len(prompts):
        return None, None, f"no step labels: {PROMPTS} has no prompt with an answer to derive them from"
    d = config.derive
    model = load_causal_lm(SFT_DIR, config.trust_remote_code, what="models/sft (the rollout policy)")
    tokenizer = load_tokenizer(SFT_DIR, config.trust_remote_code)
    start = time.perf_counter()
    derived, stats = derive_step_labels(
        model, tokenizer, task, prompts["prompt"].tolist(), prompts["answer"].tolist(),
        samples_per_prompt=d.samples_per_prompt, rollouts=d.rollouts, max_new_tokens=d.max_new_tokens,
        temperature=d.temperature, estimate=d.estimate, threshold=d.threshold, seed=d.seed, batch_size=d.batch_size,
    )  # fmt: skip
    stats["seconds"] = time.perf_counter() - start
    if len(derived) < 2:
        return None, None, f"no step labels: rollouts gave {len(derived)} labelled solution(s) ({stats})"
    frame = pd.DataFrame({k: pd.Series([r[k] for r in derived], dtype=object) for k in derived[0]})
    frame.to_parquet(out_dir / DERIVED_FILE, index=False)
    # Held out by prompt, so that no held-out solution shares its problem with a training one.
    keys = sorted({repr(p) for p in frame["prompt"]})
    order = np.random.default_rng(d.seed).permutation(len(keys))
    held_keys = {keys[i] for i in order[: max(1, round(d.eval_share * len(keys)))]}
    is_held = frame["prompt"].map(repr).isin(held_keys)
    if is_held.all():
        is_held.iloc[len(frame) // 2 :] = False
    train, held = frame[~is_held].reset_index(drop=True), frame[is_held].reset_index(drop=True)
    print(f"prm: derived step labels by rollouts of models/sft: {stats}")
    return Dataset.from_pandas(train, preserve_index=False), held, {f"derived_{k}": v for k, v in stats.items()}


def run(config: Config, separator: str, init: Path, rows, held_out, out_dir: Path) -> tuple[dict, list[dict]]:
    """Train a PRM from `init` on `rows`, save it into `out_dir`, score `held_out`.
    `separator` joins the steps (the task's)."""
    import transformers

    from rlhf.models.compute import is_main, release_memory
    from rlhf.models.loading import load_tokenizer
    from rlhf.rewards.prm import load_prm
    from rlhf.rewards.prm_classifier import build_dataset, load_prm_model, save_prm
    from rlhf.rewards.steps import prm_metrics
    from rlhf.training.prm_trainer import prm_trainer, prm_training_args
    from rlhf.training.trainer_setup import (
        checkpoint_dir,
        final_weights,
        fingerprint,
        last_logged,
        log_history_rows,
        train_resumable,
    )

    stage = "prm"
    check_model_dir(resolve_model_dir(init), f"prm.init {config.init!r} (models/{config.init})")
    tokenizer = load_tokenizer(init, config.trust_remote_code)
    if config.kind == "likelihood":  # no training to share: rank 0 fits alone
        return run_likelihood(config, separator, init, tokenizer, rows, held_out, out_dir) if is_main() else ({}, [])
    train = build_dataset(tokenizer, rows, separator, config.max_length)
    key = fingerprint(config, [init, DATA, *([PROMPTS] if PROMPTS.exists() else [])])
    args = prm_training_args(config, checkpoint_dir(CHECKPOINTS_DIR, stage, key))  # before the model loads
    transformers.set_seed(config.seed)  # the new head's initialisation
    model = load_prm_model(
        init, config.trust_remote_code, what=f"models/{config.init}", training=True, adapters=config.lora.enabled
    )
    trainer = prm_trainer(args, model, tokenizer, train, config.lora)
    start = time.perf_counter()
    resumed = train_resumable(trainer, stage, key)
    train_seconds = time.perf_counter() - start
    history = trainer.state.log_history
    model, state_dict = final_weights(trainer)
    if not is_main():  # another process of a multi-process launch: rank 0 scores and publishes
        return {}, []
    save_prm(model, tokenizer, out_dir, separator, state_dict)
    steps, processes = trainer.state.global_step, trainer.args.world_size
    del trainer, model, state_dict  # the trained model and its optimizer state go before the scorer loads
    release_memory()

    prm = load_prm(out_dir, config.trust_remote_code)
    scores = prm.score_steps(held_out["prompt"].tolist(), held_out["completions"].tolist(), config.score_batch_size)
    metrics = {
        **prm_metrics(scores, held_out["labels"].tolist()),
        "train_loss": last_logged(history, "loss"),
        "train_rows": len(train),
        "steps_trained": steps,
        "train_seconds": train_seconds,
        "resumed": bool(resumed),
        "processes": processes,
    }
    return metrics, log_history_rows(history, CURVE_KEYS)  # checkpoints stay until main has published


def run_likelihood(
    config: Config, separator: str, init: Path, tokenizer, rows, held_out, out_dir: Path
) -> tuple[dict, list[dict]]:
    """Fit the likelihood PRM's calibration on the training rows (no gradient steps on the
    LM: seconds, not minutes) and score the held-out rows."""
    from rlhf.models.folders import PRM_FILE
    from rlhf.models.loading import load_causal_lm
    from rlhf.rewards.prm_likelihood import FEATURES, LikelihoodPRM
    from rlhf.rewards.steps import prm_metrics

    lm = load_causal_lm(init, config.trust_remote_code, what=f"models/{config.init}")
    start = time.perf_counter()
    batches = rows.iter(batch_size=max(config.score_batch_size, 1024))
    prm = LikelihoodPRM.fit(lm, tokenizer, batches, separator, config.score_batch_size)
    fit_seconds = time.perf_counter() - start
    prm.save(out_dir, PRM_FILE)
    scores = prm.score_steps(held_out["prompt"].tolist(), held_out["completions"].tolist(), config.score_batch_size)
    metrics = {
        **prm_metrics(scores, held_out["labels"].tolist()),
        "kind": config.kind,
        **{f"weight_{name}": float(w) for name, w in zip(FEATURES, prm.weights)},
        "bias": prm.bias,
        "train_rows": len(rows),
        "train_seconds": fit_seconds,
    }
    return metrics, prm.curve


def main() -> None:
    import mlflow

    from rlhf.models.compute import is_main
    from rlhf.tracking.runs import numeric_metrics, stage_run, tracked
    from rlhf.training.trainer_setup import discard_checkpoints

    params = load_model_stage(override=lambda p: p["prm"].model, key="prm")
    config, task = params["prm"], get_task(params["task"])
    with stage_run("prm", config) as active:
        with atomic_dir(OUT_DIR) as tmp:
            check_separator(config, task.step_separator)
            rows, held_out, derived = load_labels(config, task, DATA, EVAL_DATA, tmp)
            if rows is None:
                drop_out("prm", tmp, derived, METRICS, PLOT)
                return
            metrics, curve = run(config, task.step_separator, init_dir(config), rows, held_out, tmp)
            metrics.update(derived or {})
        if is_main():  # published: the checkpoints are no longer needed to resume
            discard_checkpoints(CHECKPOINTS_DIR, "prm")
        if active is None:  # not rank 0 of a multi-process launch: rank 0 publishes
            return
        write_json(METRICS, metrics)
        write_csv(PLOT, curve)
        with tracked("the metrics and the loss curve"):
            mlflow.log_metrics(numeric_metrics(metrics))
            mlflow.log_artifact(str(PLOT))
        shown = {k: "n/a" if metrics[k] is None else f"{metrics[k]:.3f}" for k in ("f1_bad", "first_error_accuracy")}
        untested = (
            " (warning: no held-out step is bad; the PRM's finding of bad steps is untested: give "
            "prepare.files.prm_eval with flawed solutions)"
        )
        print(
            f"prm: held-out step accuracy {metrics['step_accuracy']:.3f}, bad-step F1 {shown['f1_bad']}, "
            f"first-error accuracy {shown['first_error_accuracy']}" + ("" if metrics["bad_step_fraction"] else untested)
        )


if __name__ == "__main__":
    main()
