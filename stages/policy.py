"""Stages `policy@<method>` and `rl@<method>`: policy optimisation of the SFT model, one
DVC stage per method.

In:  models/sft (policy init and reference); offline methods (`policy.offline`, stages
     `policy@<method>`): data/prepared/prefs.parquet, or data/prepared/unpaired.parquet for
     KTO; online methods (`policy.online`, stages `rl@<method>`): data/prepared/prompts.parquet
     and the reward models their rewards (and PPO's value_init) name.
Out: models/policy/<method> (a plain model: LoRA adapters are merged on save),
     metrics/policy/<method>.json, plots/policy/<method>/ (loss, reward, kl, accuracy curves: PLOTTED).

dvc.yaml expands each list with `foreach`, so each method is its own stage with its own
params section (`policy.<method>`): changing DPO's beta reruns DPO alone. The two lists are
two templates because their inputs differ and a DVC dependency cannot follow a param: an
offline method never reads a reward model, so retraining the RM leaves it up to date.

Methods (a dict from name to function, `METHODS`):

* dpo — TRL's `DPOTrainer`. `loss_type` sigmoid (Rafailov et al. 2023), ipo (Azar et al.
  2023), hinge (SLiC), or any other TRL loss type; the reference is the SFT model.
  `sft_weight` > 0 adds TRL's NLL loss on the chosen response (RPO), which keeps the
  likelihood of good solutions from falling while the margin grows.
* simpo — TRL's `CPOTrainer` with `loss_type="simpo"`, `cpo_alpha=0` (Meng et al. 2024):
  reference-free, length-normalised margin with a target gap gamma.
* orpo — TRL's experimental `ORPOTrainer` (Hong et al. 2024): NLL plus an odds-ratio
  penalty, reference-free.
* kto — TRL's `KTOTrainer` (Ethayarajh et al. 2024) on unpaired desirable/undesirable
  samples; needs a batch of at least 2 for its KL estimate.
* grpo, rloo — TRL's `GRPOTrainer` and `RLOOTrainer` on the prompts, with the weighted
  rewards of rlhf.rewards.functions (the task checks the answers).
* ppo — ours (rlhf.training.ppo): a value model, GAE and clipped losses.

    python -m stages.policy dpo        # any method listed in policy.offline or policy.online
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf.artifacts import atomic_dir, write_csv, write_json
from rlhf.params import StageConfig
from rlhf.rewards.functions import DEFAULT_REWARDS, RewardSpec, model_paths
from rlhf.tasks import Task, get_task
from rlhf.training.params import (
    KEYED_SAMPLING,
    DPOParams,
    EwcParams,
    LoraParams,
    OfflineParams,
    PPOParams,
    TrainingParams,
)
from stages import (
    CHECKPOINTS_DIR,
    DATA_DIR,
    POLICY_DIR,
    REWARD_MODEL_DIRS,
    RM_DIR,
    SFT_DIR,
    load_model_stage,
)
from stages.trl_training import (
    SFT_DATA,
    consolidate_on_sft,
    dpo_trainer,
    fitting_rows,
    reference_trainer,
    sft_ewc_examples,
    train_trl,
)

PREFS = DATA_DIR / "prefs.parquet"
UNPAIRED = DATA_DIR / "unpaired.parquet"
PROMPTS = DATA_DIR / "prompts.parquet"
OUT_ROOT = POLICY_DIR
METRICS_ROOT = Path("metrics/policy")
PLOTS_ROOT = Path("plots/policy")

PPO_LOGGED = ("score", "kl", "kl_coef", "value_loss", "clipfrac", "approx_kl", "entropy", "response_length")
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


class SimPOParams(OfflineParams):
    """SimPO (Meng et al. 2024): -log sigmoid(beta/|y| (log pi(y_w) - log pi(y_l)) - gamma), no reference."""

    beta: float = Field(2.0, gt=0, description="scale of the length-normalised log-likelihood margin")
    gamma: float = Field(0.5, ge=0, description="target reward margin (TRL's simpo_gamma)")


class ORPOParams(OfflineParams):
    """ORPO (Hong et al. 2024): NLL(y_w) + lambda * -log sigmoid(log odds(y_w) - log odds(y_l)), no reference."""

    beta: float = Field(0.1, gt=0, description="lambda, weight of the odds-ratio term")
    learning_rate: float = Field(3e-6, gt=0, lt=1, description="peak learning rate")


class KTOParams(OfflineParams):
    """KTO (Ethayarajh et al. 2024): prospect-theoretic loss on unpaired desirable/undesirable samples."""

    beta: float = Field(0.1, gt=0, description="KL strength")
    desirable_weight: float = Field(1.0, gt=0, description="loss weight of desirable samples")
    undesirable_weight: float = Field(1.0, gt=0, description="loss weight of undesirable samples")
    learning_rate: float = Field(3e-6, gt=0, lt=1, description="peak learning rate")
    precompute_ref_log_probs: bool = Field(True, description="reference log-probs once, cached by content (sweeps)")
    per_device_train_batch_size: int = Field(
        32, gt=1, description="samples per step (KTO's KL estimate needs a real batch: at least 2)"
    )


REWARDS_FIELD = Field(
    default_factory=lambda: list(DEFAULT_REWARDS),
    validate_default=True,
    min_length=1,
    description="weighted rewards (rlhf.rewards.functions)",
)


class OnlineParams(TrainingParams):
    """What the online methods share: sampling, the rewards, the KL strength, LoRA."""

    max_steps: int = Field(100, gt=0, description="optimizer steps")
    per_device_train_batch_size: int = Field(64, gt=0, description="completions per step (prompts x num_generations)")
    learning_rate: float = Field(3e-5, gt=0, lt=1, description="peak learning rate")
    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(64, gt=0, description="new tokens per completion")
    max_length: int = Field(
        128, gt=0, description="EWC only: tokens per SFT row for its Fisher information (TRL feeds prompts whole)"
    )
    temperature: float = Field(0.7, gt=0, description="sampling temperature (below 1: rollouts closer to greedy)")
    keyed_sampling: bool = Field(False, description=KEYED_SAMPLING)
    beta: float = Field(0.0, ge=0, description="KL coefficient to the SFT reference (0 = no reference model)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="PPO-style clipping of the importance ratio")
    num_iterations: int = Field(1, gt=0, description="optimisation passes per generated batch (mu)")
    rewards: list[RewardSpec] = REWARDS_FIELD
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    ewc: EwcParams = Field(
        default_factory=EwcParams, description="elastic weight consolidation towards SFT, Fisher on the SFT data"
    )

    @model_validator(mode="after")
    def _groups_fit(self):
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if batch % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size x gradient_accumulation_steps ({batch}) must be a multiple of "
                f"num_generations ({self.num_generations}): each step holds whole groups"
            )
        return self

    def trl_args(self, reward_weights: list[float]) -> dict:
        return {
            "num_generations": self.num_generations,
            "max_completion_length": self.max_completion_length,
            "temperature": self.temperature,
            "beta": self.beta,
            "epsilon": self.epsilon,
            "num_iterations": self.num_iterations,
            "reward_weights": reward_weights,
            "top_p": 1.0,
            "top_k": 0,
            "disable_dropout": True,
            "log_completions": False,
        }


class GRPOParams(OnlineParams):
    """GRPO (Shao et al. 2024): advantages are rewards normalised within each prompt's group."""

    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo", description="TRL's GRPO loss types"
    )
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="divide advantages by this std")


class RLOOParams(OnlineParams):
    """RLOO (Ahmadian et al. 2024): each completion's baseline is the mean reward of the
    other completions of its prompt."""

    beta: float = Field(0.05, ge=0, description="KL coefficient to the SFT reference, in the reward (TRL's default)")
    normalize_advantages: bool = Field(False, description="normalise advantages per generated batch")


class PPOMethodParams(PPOParams):
    """PPO (ours, rlhf/training/ppo.py) on the prompts, with the same weighted rewards as GRPO/RLOO."""

    rewards: list[RewardSpec] = REWARDS_FIELD
    ewc: EwcParams = Field(
        default_factory=EwcParams, description="elastic weight consolidation towards SFT, Fisher on the SFT data"
    )

    @model_validator(mode="after")
    def _ewc_without_lora(self):
        if self.ewc.strength and self.lora.enabled:
            raise ValueError("ewc.strength with lora.enabled: PPO's EWC pulls the full weights; turn one of them off")
        return self


OFFLINE_METHODS = ("dpo", "simpo", "orpo", "kto")
ONLINE_METHODS = ("grpo", "rloo", "ppo")


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


class Config(StageConfig):
    offline: list[str] = Field(
        ["dpo"], description="offline methods to train (dpo, simpo, orpo, kto): stages policy@<method>"
    )
    online: list[str] = Field([], description="online methods to train (grpo, rloo, ppo): stages rl@<method>")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")
    dpo: DPOParams = Field(default_factory=DPOParams, description="params of method dpo")
    simpo: SimPOParams = Field(default_factory=SimPOParams, description="params of method simpo")
    orpo: ORPOParams = Field(default_factory=ORPOParams, description="params of method orpo")
    kto: KTOParams = Field(default_factory=KTOParams, description="params of method kto")
    grpo: GRPOParams = Field(default_factory=GRPOParams, description="params of method grpo")
    rloo: RLOOParams = Field(default_factory=RLOOParams, description="params of method rloo")
    ppo: PPOMethodParams = Field(default_factory=PPOMethodParams, description="params of method ppo")

    @field_validator("offline")
    @classmethod
    def _check_offline(cls, value):
        return _check_listed(value, OFFLINE_METHODS, ONLINE_METHODS, "online")

    @field_validator("online")
    @classmethod
    def _check_online(cls, value):
        return _check_listed(value, ONLINE_METHODS, OFFLINE_METHODS, "offline")

    @model_validator(mode="after")
    def _some_method(self):
        if not self.methods:
            raise ValueError("no policy method: list at least one in policy.offline or policy.online")
        return self

    @property
    def methods(self) -> list[str]:
        """Every method to train, offline first: the candidates merge and evaluate read."""
        return [*self.offline, *self.online]


def stage_name(method: str) -> str:
    """The DVC stage that trains `method`."""
    return f"policy@{method}" if method in OFFLINE_METHODS else f"rl@{method}"


KEY = "policy.{}.max_length"  # an offline method's length limit, named in its messages


def train_dpo(config: Config, task: Task, params: DPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    classes, trl_args = dpo_trainer(params)
    return train_trl(
        config.trust_remote_code, params, PREFS, classes, trl_args, out_dir, stage, length_key=KEY.format("dpo")
    )


def train_simpo(config: Config, task: Task, params: SimPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    # SimPO is CPO's loss with the behaviour-cloning term switched off (cpo_alpha=0).
    trl_args = {
        "loss_type": "simpo",
        "cpo_alpha": 0.0,
        "beta": params.beta,
        "simpo_gamma": params.gamma,
        "max_length": params.max_length,
    }
    return train_trl(
        config.trust_remote_code, params, PREFS, (CPOConfig, CPOTrainer), trl_args, out_dir, stage,
        length_key=KEY.format("simpo"), forced_bos=True,
    )  # fmt: skip


def train_orpo(config: Config, task: Task, params: ORPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    trl_args = {"beta": params.beta, "max_length": params.max_length}
    return train_trl(
        config.trust_remote_code, params, PREFS, (ORPOConfig, ORPOTrainer), trl_args, out_dir, stage,
        length_key=KEY.format("orpo"), forced_bos=True,
    )  # fmt: skip


def train_kto(config: Config, task: Task, params: KTOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    from trl import KTOConfig, KTOTrainer

    trl_args = {
        "beta": params.beta,
        "desirable_weight": params.desirable_weight,
        "undesirable_weight": params.undesirable_weight,
        "max_length": params.max_length,
    }
    classes = reference_trainer(KTOConfig, KTOTrainer, params, trl_args)
    return train_trl(
        config.trust_remote_code, params, UNPAIRED, classes, trl_args, out_dir, stage, length_key=KEY.format("kto"),
        shuffle_rows=True,  # TRL reads KTO's rows in order (its KL term pairs neighbours)
    )  # fmt: skip


def train_online(
    config: Config, task: Task, params: OnlineParams, trl_classes: tuple, trl_args: dict, out_dir: Path, stage: str
) -> tuple[dict, list[dict]]:
    """GRPO and RLOO: TRL samples `num_generations` completions per prompt of
    data/prepared/prompts.parquet and scores them with the configured rewards; the
    prompt table's other columns (e.g. `answer`) reach the reward functions."""
    from rlhf.rewards.functions import build_rewards

    functions, weights = build_rewards(params.rewards, task, REWARD_MODEL_DIRS, config.trust_remote_code)
    logged = ("loss", "reward", "reward_std", "kl", "completions/mean_length")

    def keyed(trainer) -> None:
        from rlhf.models.compute import rank
        from rlhf.models.generation import keyed_generate

        # TRL hands each process a contiguous slice of the step's rows, in rank order.
        keyed_generate(
            trainer.model, params.seed, lambda: trainer.state.global_step, lambda rows: rank() * rows,
            params.temperature,
        )  # fmt: skip

    return train_trl(
        config.trust_remote_code,
        params,
        PROMPTS,
        trl_classes,
        {**params.trl_args(weights), **trl_args},
        out_dir,
        stage,
        logged=logged + tuple(f"rewards/{f.__name__}/mean" for f in functions),
        inputs=tuple(model_paths(params.rewards, REWARD_MODEL_DIRS)),
        on_trainer=keyed if params.keyed_sampling else None,
        context={"task": task.identity()},
        reward_funcs=functions,
    )


def train_grpo(config: Config, task: Task, params: GRPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    from trl import GRPOConfig, GRPOTrainer

    trl_args = {"loss_type": params.loss_type, "scale_rewards": params.scale_rewards}
    return train_online(config, task, params, (GRPOConfig, GRPOTrainer), trl_args, out_dir, stage)


def train_rloo(config: Config, task: Task, params: RLOOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    from trl import RLOOConfig, RLOOTrainer

    trl_args = {"normalize_advantages": params.normalize_advantages}
    return train_online(config, task, params, (RLOOConfig, RLOOTrainer), trl_args, out_dir, stage)


def train_ppo_method(
    config: Config, task: Task, params: PPOMethodParams, out_dir: Path, stage: str
) -> tuple[dict, list[dict]]:
    """PPO with a value model: ours (rlhf/training/ppo.py), as TRL 1.16 has none. The
    reference is a frozen copy of the SFT model; the value model starts from SFT or from
    the first RM member (`value_init`)."""
    import mlflow

    from rlhf.data.contracts import read_prepared
    from rlhf.models.compute import world_size
    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
    from rlhf.rewards.ensemble import member_dirs
    from rlhf.rewards.functions import build_rewards, weighted_sum
    from rlhf.tracking.runs import log_metrics, numeric_metrics
    from rlhf.training.ppo import latest_checkpoint, load_value_model, train_ppo
    from rlhf.training.trainer_setup import checkpoint_dir, fingerprint

    tokenizer = load_tokenizer(SFT_DIR, config.trust_remote_code)
    # A prompt must leave max_new_tokens of max_length: the rollouts would cut its start.
    table, counts = fitting_rows(read_prepared(PROMPTS, stage), tokenizer, params.max_length, "policy.ppo.max_length",
                                  PROMPTS, room=params.max_new_tokens)  # fmt: skip
    ewc_data = sft_ewc_examples(tokenizer, params, "policy.ppo.max_length")
    policy = load_causal_lm(SFT_DIR, config.trust_remote_code, what="models/sft", training=True)
    reference = load_causal_lm(SFT_DIR, config.trust_remote_code, what="models/sft", training=True)
    value_init = SFT_DIR if params.value_init == "sft" else member_dirs(RM_DIR)[0]
    value_model = load_value_model(value_init, config.trust_remote_code)
    functions, weights = build_rewards(params.rewards, task, REWARD_MODEL_DIRS, config.trust_remote_code)
    ewc = consolidate_on_sft(policy, ewc_data, params)
    inputs = [SFT_DIR, PROMPTS, value_init, *model_paths(params.rewards, REWARD_MODEL_DIRS)]
    context = {"task": task.identity(), "trust": config.trust_remote_code}
    key = fingerprint(params, inputs + ([SFT_DATA] if params.ewc.strength else []), context)

    def log(metrics: dict, step: int) -> None:
        if mlflow.active_run() is not None:
            log_metrics(numeric_metrics(metrics), step=step)

    checkpoints = checkpoint_dir(CHECKPOINTS_DIR, stage, key)
    resumed = latest_checkpoint(checkpoints) is not None  # train_ppo resumes from it
    history = train_ppo(
        policy,
        reference,
        value_model,
        tokenizer,
        table["prompt"].tolist(),
        {column: table[column].tolist() for column in table.columns if column != "prompt"},
        weighted_sum(functions, weights),
        params,
        checkpoints,
        log_fn=log,
    )
    save_model(policy, tokenizer, out_dir)
    first, last = history[0], history[-1]
    window = history[-max(1, len(history) // 10) :]
    metrics = {
        "train_loss": last["policy_loss"],
        "value_loss": last["value_loss"],
        "score_first": first["score"],
        "score_last_10pct": sum(row["score"] for row in window) / len(window),
        "kl": last["kl"],
        "steps": len(history),
        "processes": world_size(),
        "resumed": resumed,
        **counts,
    }
    if ewc is not None:
        metrics["ewc_penalty"] = ewc.penalty()
    curve = [{"step": row["step"], "loss": row["policy_loss"], **{k: row[k] for k in PPO_LOGGED}} for row in history]
    return metrics, curve


METHODS: dict[str, Callable] = {
    "dpo": train_dpo,
    "simpo": train_simpo,
    "orpo": train_orpo,
    "kto": train_kto,
    "grpo": train_grpo,
    "rloo": train_rloo,
    "ppo": train_ppo_method,
}


def training_data(method: str) -> Path:
    """The prepared table a method trains on."""
    return {"kto": UNPAIRED}.get(method, PREFS) if method in OFFLINE_METHODS else PROMPTS


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
    from rlhf.data.contracts import DataValidationError, read_prepared
    from stages import ANSWER_REWARDS

    readers = [i for i, reward in enumerate(getattr(params, "rewards", [])) if reward.name in ANSWER_REWARDS]
    if not readers:
        return
    table = read_prepared(PROMPTS, stage_name(method))
    if "answer" in table and table["answer"].notna().any():
        return
    key = f"policy.{method}.rewards[{readers[0]}]"
    raise DataValidationError(
        PROMPTS,
        [
            f"no prompt has an answer, and {key} ({params.rewards[readers[0]].name}) scores completions against it "
            "(every reward would be 0): map the answer column of your prompts file (prepare.files.prompts.columns: "
            "{answer: <column>}), or use rewards that read no answer (reward_model, prm, format, length)"
        ],
    )


def run(config: Config, task: Task, method: str, out_dir: Path) -> tuple[dict, list[dict]]:
    from rlhf.models.compute import is_main
    from rlhf.training.trainer_setup import discard_checkpoints

    stage = stage_name(method)
    check_answer_rewards(getattr(config, method), method)
    start = time.perf_counter()
    metrics, curve = METHODS[method](config, task, getattr(config, method), out_dir, stage)
    if is_main():
        discard_checkpoints(CHECKPOINTS_DIR, stage)
    return {**metrics, "method": method, "train_seconds": time.perf_counter() - start}, curve


def main(argv: list[str] | None = None) -> None:
    import mlflow

    from rlhf.tracking.runs import log_table, numeric_metrics, stage_run

    argv = sys.argv[1:] if argv is None else argv
    params = load_model_stage()
    config, task = params["policy"], get_task(params["task"])
    if len(argv) != 1 or argv[0] not in config.methods:
        raise SystemExit(
            f"usage: python -m stages.policy METHOD, with METHOD one of policy.offline + policy.online {config.methods}"
        )
    method = argv[0]
    with stage_run(stage_name(method), config.model_dump(include={"trust_remote_code", method})) as active:
        with atomic_dir(OUT_ROOT / method) as tmp:
            metrics, curve = run(config, task, method, tmp)
        if active is None:  # not rank 0 of a multi-process launch: rank 0 publishes
            return
        write_json(METRICS_ROOT / f"{method}.json", metrics)
        with atomic_dir(PLOTS_ROOT / method) as tmp:
            for quantity, rows in plotted_curves(curve).items():
                write_csv(tmp / f"{quantity}.csv", rows)
        mlflow.log_metrics(numeric_metrics(metrics))
        mlflow.log_artifacts(str(PLOTS_ROOT / method), f"plots/{method}")
        log_table(training_data(method), "training")


if __name__ == "__main__":
    main()
