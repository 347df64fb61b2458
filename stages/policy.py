"""Stage `policy@<method>`: policy optimisation of the SFT model, one DVC stage per method.

In:  models/sft (policy init and reference), data/prepared/prefs.parquet (preference
     methods) or data/prepared/unpaired.parquet (KTO).
Out: models/policy/<method> (a plain model: LoRA adapters are merged on save),
     metrics/policy/<method>.json, plots/policy/<method>.csv.

dvc.yaml expands `policy.methods` with `foreach`, so each method is its own stage with its
own params section (`policy.<method>`): changing DPO's beta reruns DPO alone, and
`evaluate` compares every candidate on the same held-out suite.

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

    python -m stages.policy dpo        # or simpo, orpo, kto (listed in policy.methods)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import mlflow
from datasets import Dataset
from pydantic import Field, field_validator, model_validator
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RLOOConfig, RLOOTrainer

from rlhf.artifacts import atomic_dir, write_csv, write_json
from rlhf.data import read_prepared
from rlhf.modeling import load_causal_lm, load_tokenizer, save_model
from rlhf.params import StageConfig
from rlhf.ppo import PPOParams, load_value_model, train_ppo
from rlhf.ref_logprobs import with_reference_cache
from rlhf.reward_ensemble import member_dirs
from rlhf.rewards import DEFAULT_REWARDS, RewardSpec, build_rewards, model_paths, weighted_sum
from rlhf.tracking import numeric_metrics, stage_run
from rlhf.training import (
    LoraParams,
    TrainingParams,
    checkpoint_dir,
    discard_checkpoints,
    fingerprint,
    last_logged,
    log_history_rows,
    merged_model,
    train_resumable,
    trl_config,
)
from stages import load_config

SFT_DIR = Path("models/sft")
PREFS = Path("data/prepared/prefs.parquet")
UNPAIRED = Path("data/prepared/unpaired.parquet")
PROMPTS = Path("data/prepared/prompts.parquet")
RM_DIR = Path("models/rm")
OUT_ROOT = Path("models/policy")
METRICS_ROOT = Path("metrics/policy")
PLOTS_ROOT = Path("plots/policy")

OFFLINE_LOGGED = ("loss", "rewards/margins", "rewards/accuracies")
PPO_LOGGED = ("score", "kl", "kl_coef", "value_loss", "clipfrac", "approx_kl", "entropy", "response_length")

DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip


class OfflineParams(TrainingParams):
    """What every offline preference method shares: its optimisation budget and LoRA block."""

    max_steps: int = Field(100, gt=0, description="optimizer steps")
    per_device_train_batch_size: int = Field(32, gt=0, description="pairs per step")
    learning_rate: float = Field(1e-5, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per prompt+response")
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")


class DPOParams(OfflineParams):
    """Direct preference optimisation: -log sigmoid(beta * (log-ratio chosen - log-ratio rejected))."""

    loss_type: str | list[str] = Field("sigmoid", description="sigmoid | ipo | hinge | any TRL DPO loss type")
    beta: float = Field(0.1, gt=0, description="KL strength (IPO: the regulariser tau)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="conservative DPO: assumed label noise")
    sft_weight: float = Field(0.0, ge=0, description="weight of an NLL term on chosen (RPO, Pang et al. 2024); 0 = off")
    precompute_ref_log_probs: bool = Field(True, description="reference log-probs once, cached by content (sweeps)")

    @field_validator("loss_type")
    @classmethod
    def _check_loss(cls, value):
        names = [value] if isinstance(value, str) else value
        unknown = [n for n in names if n not in DPO_LOSS_TYPES]
        if unknown:
            raise ValueError(f"unknown DPO loss type(s) {unknown}; use one of {list(DPO_LOSS_TYPES)}")
        return value


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
    description="weighted rewards (rlhf.rewards)",
)


class OnlineParams(TrainingParams):
    """What the online methods share: sampling, the rewards, the KL strength, LoRA."""

    max_steps: int = Field(100, gt=0, description="optimizer steps")
    per_device_train_batch_size: int = Field(64, gt=0, description="completions per step (prompts x num_generations)")
    learning_rate: float = Field(3e-5, gt=0, lt=1, description="peak learning rate")
    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(64, gt=0, description="new tokens per completion")
    temperature: float = Field(0.7, gt=0, description="sampling temperature (below 1: rollouts closer to greedy)")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the SFT reference (0 = no reference model)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="PPO-style clipping of the importance ratio")
    num_iterations: int = Field(1, gt=0, description="optimisation passes per generated batch (mu)")
    rewards: list[RewardSpec] = REWARDS_FIELD
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")

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

    loss_type: str = Field("dapo", description="grpo | dr_grpo | dapo | bnpo | cispo | sapo | ... (TRL's loss types)")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="divide advantages by this std")


class RLOOParams(OnlineParams):
    """RLOO (Ahmadian et al. 2024): each completion's baseline is the mean reward of the
    other completions of its prompt."""

    beta: float = Field(0.05, ge=0, description="KL coefficient to the SFT reference, in the reward (TRL's default)")
    normalize_advantages: bool = Field(False, description="normalise advantages per generated batch")


class PPOMethodParams(PPOParams):
    """PPO (ours, rlhf/ppo.py) on the prompts, with the same weighted rewards as GRPO/RLOO."""

    rewards: list[RewardSpec] = REWARDS_FIELD


class Config(StageConfig):
    methods: list[str] = Field(["dpo"], min_length=1, description="methods to train, one DVC stage each")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")
    dpo: DPOParams = Field(default_factory=DPOParams, description="params of method dpo")
    simpo: SimPOParams = Field(default_factory=SimPOParams, description="params of method simpo")
    orpo: ORPOParams = Field(default_factory=ORPOParams, description="params of method orpo")
    kto: KTOParams = Field(default_factory=KTOParams, description="params of method kto")
    grpo: GRPOParams = Field(default_factory=GRPOParams, description="params of method grpo")
    rloo: RLOOParams = Field(default_factory=RLOOParams, description="params of method rloo")
    ppo: PPOMethodParams = Field(default_factory=PPOMethodParams, description="params of method ppo")

    @field_validator("methods")
    @classmethod
    def _check_methods(cls, value):
        unknown = [m for m in value if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; available: {sorted(METHODS)}")
        if len(set(value)) != len(value):
            raise ValueError(f"methods are listed twice: {value}")
        return value


def train_trl(
    config: Config,
    params: TrainingParams,
    data: Path,
    trl_classes: tuple,
    trl_args: dict,
    out_dir: Path,
    stage: str,
    logged: tuple[str, ...] = OFFLINE_LOGGED,
    inputs: tuple[Path, ...] = (),
    **trainer_kwargs,
) -> tuple[dict, list[dict]]:
    """Train the SFT model with one of TRL's trainers, `trl_classes` = (its config class,
    its trainer class), on `data`; save the (merged) result into `out_dir`. Returns metrics
    (the last logged value of each of `logged`) and the curve of those values. `inputs` are
    further files the result depends on (reward models), for the checkpoint fingerprint."""
    tokenizer = load_tokenizer(SFT_DIR, config.trust_remote_code)
    model = load_causal_lm(SFT_DIR, config.trust_remote_code, what="models/sft")
    dataset = Dataset.from_pandas(read_prepared(data, stage), preserve_index=False)
    key = fingerprint(params, [SFT_DIR, data, *inputs])
    config_cls, trainer_cls = trl_classes
    args = trl_config(config_cls, params, checkpoint_dir(stage, key), **trl_args)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=params.lora.peft_config(),
        **trainer_kwargs,
    )
    resumed = train_resumable(trainer, stage, key)
    history = trainer.state.log_history
    save_model(merged_model(trainer.model), tokenizer, out_dir)
    metrics = {
        "train_loss": last_logged(history, "loss"),
        **{name.replace("/", "_"): last_logged(history, name) for name in logged if name != "loss"},
        "steps": trainer.state.global_step,
        "resumed": bool(resumed),
    }
    if hasattr(trainer, "ref_cache_hit"):
        metrics["ref_logps_cache_hit"] = trainer.ref_cache_hit
    return metrics, log_history_rows(history, logged)


def reference_trainer(config_cls, trainer_cls, params, trl_args: dict) -> tuple:
    """(config class, trainer class) for a method with a reference model (DPO, KTO): with
    `precompute_ref_log_probs` the trainer keeps its reference log-probs in the
    content-keyed cache (rlhf.ref_logprobs). Sets the flag in `trl_args`."""
    trl_args["precompute_ref_log_probs"] = params.precompute_ref_log_probs
    return config_cls, with_reference_cache(trainer_cls) if params.precompute_ref_log_probs else trainer_cls


def train_dpo(config: Config, params: DPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    loss_types = [params.loss_type] if isinstance(params.loss_type, str) else list(params.loss_type)
    trl_args = {
        "loss_type": loss_types + (["sft"] if params.sft_weight else []),
        "loss_weights": [1.0] * len(loss_types) + ([params.sft_weight] if params.sft_weight else []),
        "beta": params.beta,
        "label_smoothing": params.label_smoothing,
        "max_length": params.max_length,
    }
    classes = reference_trainer(DPOConfig, DPOTrainer, params, trl_args)
    return train_trl(config, params, PREFS, classes, trl_args, out_dir, stage)


def train_simpo(config: Config, params: SimPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    # SimPO is CPO's loss with the behaviour-cloning term switched off (cpo_alpha=0).
    trl_args = {
        "loss_type": "simpo",
        "cpo_alpha": 0.0,
        "beta": params.beta,
        "simpo_gamma": params.gamma,
        "max_length": params.max_length,
    }
    return train_trl(config, params, PREFS, (CPOConfig, CPOTrainer), trl_args, out_dir, stage)


def train_orpo(config: Config, params: ORPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    trl_args = {"beta": params.beta, "max_length": params.max_length}
    return train_trl(config, params, PREFS, (ORPOConfig, ORPOTrainer), trl_args, out_dir, stage)


def train_kto(config: Config, params: KTOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    trl_args = {
        "beta": params.beta,
        "desirable_weight": params.desirable_weight,
        "undesirable_weight": params.undesirable_weight,
        "max_length": params.max_length,
    }
    classes = reference_trainer(KTOConfig, KTOTrainer, params, trl_args)
    return train_trl(config, params, UNPAIRED, classes, trl_args, out_dir, stage)


def train_online(
    config: Config, params: OnlineParams, trl_classes: tuple, trl_args: dict, out_dir: Path, stage: str
) -> tuple[dict, list[dict]]:
    """GRPO and RLOO: TRL samples `num_generations` completions per prompt of
    data/prepared/prompts.parquet and scores them with the configured rewards; the
    prompt table's other columns (e.g. `answer`) reach the reward functions."""
    functions, weights = build_rewards(params.rewards, config.trust_remote_code)
    logged = ("loss", "reward", "reward_std", "kl", "completions/mean_length")
    return train_trl(
        config,
        params,
        PROMPTS,
        trl_classes,
        {**params.trl_args(weights), **trl_args},
        out_dir,
        stage,
        logged=logged + tuple(f"rewards/{f.__name__}/mean" for f in functions),
        inputs=tuple(model_paths(params.rewards)),
        reward_funcs=functions,
    )


def train_grpo(config: Config, params: GRPOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    trl_args = {"loss_type": params.loss_type, "scale_rewards": params.scale_rewards}
    return train_online(config, params, (GRPOConfig, GRPOTrainer), trl_args, out_dir, stage)


def train_rloo(config: Config, params: RLOOParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    trl_args = {"normalize_advantages": params.normalize_advantages}
    return train_online(config, params, (RLOOConfig, RLOOTrainer), trl_args, out_dir, stage)


def train_ppo_method(config: Config, params: PPOMethodParams, out_dir: Path, stage: str) -> tuple[dict, list[dict]]:
    """PPO with a value model: ours (rlhf/ppo.py), as TRL 1.16 has none. The reference is a
    frozen copy of the SFT model; the value model starts from SFT or from the first RM
    member (`value_init`)."""
    tokenizer = load_tokenizer(SFT_DIR, config.trust_remote_code)
    policy = load_causal_lm(SFT_DIR, config.trust_remote_code, what="models/sft")
    reference = load_causal_lm(SFT_DIR, config.trust_remote_code, what="models/sft")
    value_init = SFT_DIR if params.value_init == "sft" else member_dirs(RM_DIR)[0]
    value_model = load_value_model(value_init, config.trust_remote_code)
    table = read_prepared(PROMPTS, stage)
    functions, weights = build_rewards(params.rewards, config.trust_remote_code)
    key = fingerprint(params, [SFT_DIR, PROMPTS, value_init, *model_paths(params.rewards)])

    def log(metrics: dict, step: int) -> None:
        mlflow.log_metrics(numeric_metrics(metrics), step=step)

    history = train_ppo(
        policy,
        reference,
        value_model,
        tokenizer,
        table["prompt"].tolist(),
        {column: table[column].tolist() for column in table.columns if column != "prompt"},
        weighted_sum(functions, weights),
        params,
        checkpoint_dir(stage, key),
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
    }
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


def run(config: Config, method: str, out_dir: Path) -> tuple[dict, list[dict]]:
    stage = f"policy@{method}"
    start = time.perf_counter()
    metrics, curve = METHODS[method](config, getattr(config, method), out_dir, stage)
    discard_checkpoints(stage)
    return {**metrics, "method": method, "train_seconds": time.perf_counter() - start}, curve


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config = load_config("policy")
    if len(argv) != 1 or argv[0] not in config.methods:
        raise SystemExit(f"usage: python -m stages.policy METHOD, with METHOD one of policy.methods {config.methods}")
    method = argv[0]
    with stage_run(f"policy@{method}", config.model_dump(include={"methods", method})):
        with atomic_dir(OUT_ROOT / method) as tmp:
            metrics, curve = run(config, method, tmp)
        write_json(METRICS_ROOT / f"{method}.json", metrics)
        write_csv(PLOTS_ROOT / f"{method}.csv", curve)
        mlflow.log_metrics(numeric_metrics(metrics))
        mlflow.log_artifact(str(PLOTS_ROOT / f"{method}.csv"))


if __name__ == "__main__":
    main()
