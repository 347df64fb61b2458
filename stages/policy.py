"""Stage `policy@<method>` (and the job of stage `rl@<method>`, stages/rl.py): policy
optimisation of the SFT model, one DVC stage per method.

In:  models/sft (policy init and reference); offline methods (`policy.offline`, stages
     `policy@<method>`): data/prepared/prefs.parquet, or data/prepared/unpaired.parquet for
     KTO; online methods (`policy.online`, stages `rl@<method>`): data/prepared/prompts.parquet
     and the reward models their rewards (and PPO's value_init) name.
Out: models/policy/<method> (a plain model; with LoRA the adapters are merged, and also kept
     in models/policy/<method>/adapter), metrics/policy/<method>.json,
     plots/policy/<method>/ (loss, reward, kl, accuracy curves: PLOTTED).

Each method is one module of rlhf/training/methods/ (its params block, the TRL config and
trainer it maps to, the data it reads): dpo (with TRL's loss types: sigmoid, ipo, hinge...),
simpo, orpo, kto, grpo, rloo, and ppo (ours). This stage picks the method's module and
describes the job to it (`TrainingJob`: the pipeline's folders); the method trains.

dvc.yaml expands each list with `foreach`, so each method is its own stage with its own
params section (`policy.<method>`): changing DPO's beta reruns DPO alone. The two lists are
two templates because their inputs differ and a DVC dependency cannot follow a param: an
offline method never reads a reward model, so retraining the RM leaves it up to date.

    python -m stages.policy dpo        # any method listed in policy.offline
    python -m stages.rl grpo           # any method listed in policy.online
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from pydantic import Field, create_model, field_validator, model_validator

from rlhf.atomic import atomic_dir, write_csv, write_json
from rlhf.rules import ANSWER_REWARDS
from rlhf.tasks import Task, get_task
from rlhf.training.methods import METHODS, OFFLINE, ONLINE, POLICY
from rlhf.training.params import PolicyCode
from stages import CHECKPOINTS_DIR, DATA_DIR, POLICY_DIR, REF_LOGPS_CACHE, REWARD_MODEL_DIRS, SFT_DIR, load_model_stage

OUT_ROOT = POLICY_DIR
METRICS_ROOT = Path("metrics/policy")
PLOTS_ROOT = Path("plots/policy")
OFFLINE_METHODS, ONLINE_METHODS = OFFLINE, ONLINE
SFT_DATA = DATA_DIR / "sft.parquet"  # EWC's previous data (params `ewc`), what SFT learned

# The curves `dvc plots show` draws for a policy, one file each under plots/policy/<method>/:
# quantity -> the logged names that carry it, the first one a method logs wins (its name is
# the file's y column, so a plot says what it shows). Reward: GRPO's and RLOO's weighted
# reward, PPO's score, DPO-style methods' implicit reward margin (chosen minus rejected).
# Accuracy: the answer-match reward's mean on sampled completions (online methods), the
# share of pairs whose implicit reward ranks chosen first (offline methods).
PLOTTED = {
    "loss": ("loss",),
    "reward": ("reward", "score", "rewards/margins"),
    "kl": ("kl",),
    # TRL logs each reward function by its name, which build_rewards numbers: 0_answer_match.
    "accuracy": (r"rewards/(\d+_)?answer_match/mean", "rewards/accuracies"),
}


def _check_listed(value: list[str], allowed: tuple[str, ...], other: tuple[str, ...], other_key: str) -> list[str]:
    misplaced = [m for m in value if m in other]
    unknown = [m for m in value if m not in allowed and m not in other]
    problems = []
    if misplaced:
        problems.append(f"{misplaced} belong in policy.{other_key}")
    if unknown:
        problems.append(f"unknown method(s) {unknown}; available here: {list(allowed)}")
    if len(set(value)) != len(value):
        problems.append(f"methods are listed twice: {value}")
    if problems:
        raise ValueError("; ".join(problems))
    return value


class PolicyLists(PolicyCode):
    offline: list[str] = Field(
        ["dpo"], description=f"offline methods to train ({', '.join(OFFLINE)}): stages policy@<method>"
    )
    online: list[str] = Field([], description=f"online methods to train ({', '.join(ONLINE)}): stages rl@<method>")

    @field_validator("offline")
    @classmethod
    def _check_offline(cls, value):
        return _check_listed(value, OFFLINE, ONLINE, "online")

    @field_validator("online")
    @classmethod
    def _check_online(cls, value):
        return _check_listed(value, ONLINE, OFFLINE, "offline")

    @model_validator(mode="after")
    def _some_method(self):
        if not self.methods:
            raise ValueError("no policy method: list at least one in policy.offline or policy.online")
        return self

    @property
    def methods(self) -> list[str]:
        """Every method to train, offline first: the candidates merge and evaluate read."""
        return [*self.offline, *self.online]

    def model_blocks(self, section: str) -> list[tuple[str, object]]:
        return [(f"{section}.{method}", getattr(self, method)) for method in self.methods]

    def cross_problems(self, run, section: str) -> list[str]:
        """Each method's data, its rewards' models and answers, and how its model loads."""
        problems = []
        for method in self.offline:
            data = METHODS[method].DATA
            if data not in run.available:
                problems.append(
                    f"policy.offline: {method} needs {data} data: add prepare.files.prefs (prompt, chosen, "
                    f"rejected), or remove {method} from policy.offline"
                )
        for method in self.online:
            settings = getattr(self, method)
            for index, reward in enumerate(settings.rewards):
                key = f"policy.{method}.rewards[{index}]"
                if reward.name in ANSWER_REWARDS:
                    problems += run.need_answers(f"reward {reward.name}", key)
                if getattr(reward, "path", None) is None:
                    problems += run.need_model(f"reward {reward.name}", reward.name, key)
                problems += run.scorer_problems(reward, key)
                problems += run.format_problems(reward, key)
            if method == "ppo" and settings.value_init == "rm":
                problems += run.need_model("value_init rm", "reward_model", "policy.ppo.value_init")
            processes = run.params["compute"].processes
            if method == "ppo" and settings.rollout_batch_size % processes:
                problems.append(
                    f"policy.ppo.rollout_batch_size: {settings.rollout_batch_size} is not a multiple of "
                    f"compute.processes ({processes}): each process samples an equal share of the batch"
                )
        for key, block in self.model_blocks(section):
            if key.endswith(".ppo"):
                if run.model_settings(block).gradient_checkpointing:
                    problems.append(
                        f"{key}.model.gradient_checkpointing: PPO (ours) runs its models in eval mode (no dropout), "
                        "where transformers does not checkpoint activations: set it to false"
                    )
                problems += run.full_training_problems(key, block, "PPO trains its value model")
            else:
                problems += run.adapter_problems(key, block)
        return problems


# params `policy`: the lists, and one block per method of rlhf/training/methods (its Params).
Config = create_model(
    "Config",
    __base__=PolicyLists,
    __module__=__name__,
    **{
        name: (
            METHODS[name].Params,
            Field(default_factory=METHODS[name].Params, description=f"params of method {name}"),
        )
        for name in POLICY
    },
)


def stage_name(method: str) -> str:
    """The DVC stage that trains `method`."""
    return f"policy@{method}" if method in OFFLINE else f"rl@{method}"


def training_data(method: str) -> Path:
    """The prepared table a method trains on (its module's data contract)."""
    return DATA_DIR / f"{METHODS[method].DATA}.parquet"


def plotted_curves(curve: list[dict]) -> dict[str, list[dict]]:
    """The per-quantity curves of PLOTTED that `curve` (rows of step and logged values) has:
    {quantity: rows of step and the logged name} (PLOTTED's names are patterns, in order)."""
    import re

    logged = list(dict.fromkeys(key for row in curve for key in row))
    out = {}
    for quantity, patterns in PLOTTED.items():
        name = next((k for p in patterns for k in logged if re.fullmatch(p, k)), None)
        if name is not None:
            out[quantity] = [{"step": row["step"], name: row[name]} for row in curve if name in row]
    return out


def check_answer_rewards(params, method: str) -> None:
    """An online method's reward that reads the prompts' answers, on prompts without any:
    it failed inside TRL's first training step (no `answer` column), or trained to the end
    on a reward of 0 for every completion (an empty column). Checked before any model loads."""
    from rlhf.data.contracts import DataValidationError
    from rlhf.data.prepared import missing_prepared, prepared_batches, prepared_columns

    readers = [i for i, reward in enumerate(getattr(params, "rewards", [])) if reward.name in ANSWER_REWARDS]
    if not readers:
        return
    prompts = training_data(method)
    if not prompts.exists():
        raise missing_prepared(prompts, stage_name(method))
    if "answer" in prepared_columns(prompts) and any(
        batch["answer"].notna().any() for batch in prepared_batches(prompts, ["answer"])
    ):
        return
    key = f"policy.{method}.rewards[{readers[0]}]"
    raise DataValidationError(
        prompts,
        [
            f"no prompt has an answer, and {key} ({params.rewards[readers[0]].name}) scores completions against it "
            "(every reward would be 0): map the answer column of your prompts file (prepare.files.prompts.columns: "
            "{answer: <column>}), or use rewards that read no answer (reward_model, prm, format, length)"
        ],
    )


def run(config: Config, task: Task, method: str, out_dir: Path, model=None) -> tuple[dict, list[dict]]:
    """Train `method` into `out_dir`; its checkpoints stay until the caller has published it.
    `model`: how the model loads (params `model` with the method's own keys), resolved once."""
    from rlhf.training.trl_training import TrainingJob

    stage = stage_name(method)
    params = getattr(config, method)
    check_answer_rewards(params, method)
    if params.trl.get("use_vllm") and importlib.util.find_spec("vllm") is None:
        from rlhf.models.settings import MissingPackageError

        raise MissingPackageError(
            f"policy.{method}.trl.use_vllm: TRL generates with vLLM, which is not installed: pip install vllm (a CUDA "
            "machine; TRL's supported versions), or remove use_vllm"
        )
    job = TrainingJob(
        stage=stage,
        key=f"policy.{method}",
        start=SFT_DIR,
        data=training_data(method),
        checkpoints=CHECKPOINTS_DIR,
        trust_remote_code=config.trust_remote_code,
        sft_data=SFT_DATA,
        ref_cache=REF_LOGPS_CACHE,
        reward_dirs=REWARD_MODEL_DIRS,
        task=task,
        model=model,
    )
    start = time.perf_counter()
    metrics, curve = METHODS[method].train(job, params, out_dir)
    return {**metrics, "method": method, "train_seconds": time.perf_counter() - start}, curve


def main(argv: list[str] | None = None, family: str = "offline") -> None:
    """Train the method `argv` names: one of `policy.<family>` (stage policy@: offline;
    stage rl@, stages/rl.py: online)."""
    import mlflow

    from rlhf.models.compute import is_main
    from rlhf.tracking.runs import log_table, numeric_metrics, stage_run, tracked
    from rlhf.training.trainer_setup import discard_checkpoints

    argv = sys.argv[1:] if argv is None else argv
    method = argv[0] if len(argv) == 1 else None

    def own_model(params: dict):  # the method's own `model:` keys over params `model`
        listed = getattr(params["policy"], family)
        return getattr(params["policy"], method).model if method in listed else None

    params = load_model_stage(override=own_model, key=f"policy.{method}")  # how models load: set once
    config, task = params["policy"], get_task(params["task"])
    listed = getattr(config, family)
    if method not in listed:
        module = "stages.policy" if family == "offline" else "stages.rl"
        raise SystemExit(f"usage: python -m {module} METHOD, with METHOD one of policy.{family} {listed}")
    with stage_run(stage_name(method), config.model_dump(include={"trust_remote_code", method})) as active:
        with atomic_dir(OUT_ROOT / method) as tmp:
            loading = params["model"].merged(getattr(config, method).model)  # resolved once, into the job
            metrics, curve = run(config, task, method, tmp, loading)
        if is_main():  # published: the checkpoints are no longer needed to resume
            discard_checkpoints(CHECKPOINTS_DIR, stage_name(method))
        if active is None:  # not rank 0 of a multi-process launch: rank 0 publishes
            return
        write_json(METRICS_ROOT / f"{method}.json", metrics)
        with atomic_dir(PLOTS_ROOT / method) as tmp:
            for quantity, rows in plotted_curves(curve).items():
                write_csv(tmp / f"{quantity}.csv", rows)
        with tracked("the metrics and the curves"):
            mlflow.log_metrics(numeric_metrics(metrics))
            mlflow.log_artifacts(str(PLOTS_ROOT / method), f"plots/{method}")
        log_table(training_data(method), "training")


if __name__ == "__main__":
    main()
