"""The params blocks of the training stages: optimisation settings, LoRA, DPO, PPO.

Plain pydantic models with no torch, transformers or TRL import, so that params.yaml
validates in a second; the code that turns them into trainers is in
`rlhf.training.trainer_setup` and `rlhf.training.ppo`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf.params import StageConfig, reject_unused

KEYED_SAMPLING = (
    "draw each completion from a generator keyed by (seed, step, row): the same completions with 1 or N "
    "processes and any batch split, at the cost of a generator per row and token (rlhf.models.generation)"
)


# transformers' schedulers that need no further arguments (cosine_with_min_lr, warmup_stable_decay
# and greedy need lr_scheduler_kwargs; reduce_lr_on_plateau needs an eval metric).
Scheduler = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
]


class TrainingParams(StageConfig):
    """Optimisation settings shared by the training stages (a TRL config subset)."""

    max_steps: int = Field(300, gt=0, description="optimizer steps")
    per_device_train_batch_size: int = Field(32, gt=0, description="examples per step per device")
    gradient_accumulation_steps: int = Field(1, gt=0, description="micro-batches per optimizer step")
    learning_rate: float = Field(1e-4, gt=0, lt=1, description="peak learning rate")
    lr_scheduler_type: Scheduler = Field("cosine", description="transformers scheduler name")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="fraction of steps spent warming up")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    max_length: int = Field(128, gt=0, description="tokens per sequence (longer ones are truncated)")
    logging_steps: int = Field(10, gt=0, description="log loss every N steps")
    save_steps: int = Field(100, gt=0, description="checkpoint every N steps (a killed run resumes from the last)")
    seed: int = Field(0, description="data order and initialisation seed")
    gradient_checkpointing: bool = Field(False, description="trade compute for memory (large models)")


class LoraParams(StageConfig):
    """A peft LoRA adapter; merged into the base weights when the model is saved."""

    enabled: bool = Field(False, description="train a LoRA adapter instead of all weights")
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: int = Field(16, gt=0, description="scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: str | list[str] = Field("all-linear", description="modules to adapt")

    def check_targets(self, model, key: str, output_layer: bool = True) -> None:
        """Fail naming `key` (the params key of target_modules) when a listed module name is
        no module of `model` (peft's matching: the name, or a dotted name ending in it), or,
        with `output_layer` False, names the output layer (TRL's DPO and KTO refuse an
        adapter there): raised before training, not from inside peft or TRL."""
        if not self.enabled or isinstance(self.target_modules, str):
            return
        from rlhf.params import ParamsError

        names = [name for name, _ in model.named_modules() if name]
        problems = []
        unknown = [t for t in self.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if unknown:
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if not list(m.children())})
            problems.append(f"{key}: {unknown} match no module of the model (its layers: {', '.join(leaves)})")
        if not output_layer:
            head = model.get_output_embeddings()
            name = next((n for n, m in model.named_modules() if m is head), None)
            if name is not None and name.rsplit(".", 1)[-1] in self.target_modules:
                problems.append(f"{key}: {name} is the output layer, which this trainer cannot adapt; remove it")
        if problems:
            raise ParamsError("params.yaml", problems)

    def peft_config(self, task_type: str = "CAUSAL_LM"):
        if not self.enabled:
            return None
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            task_type=task_type,
        )


class SFTParams(TrainingParams):
    """Supervised fine-tuning (rlhf.training.sft): stage sft, the verifier and the
    self-improvement rounds."""

    max_steps: int = Field(1000, gt=0, description="optimizer steps")
    per_device_train_batch_size: int = Field(64, gt=0, description="examples per step per device")
    learning_rate: float = Field(3e-3, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per example (longer ones are truncated)")
    loss_on: str = Field("completion", pattern="^(completion|all)$", description="completion only, or every token")
    length_buckets: int = Field(
        4, ge=1, description="run each batch as this many length-sorted sub-batches: same loss, less padding (1 = off)"
    )
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")


class EwcParams(StageConfig):
    """Elastic weight consolidation (rlhf.training.ewc): a pull towards the weights the
    training starts from, weighted by their Fisher information on the previous data."""

    strength: float = Field(0.0, ge=0, description="lambda of the EWC penalty; 0 = off")
    samples: int = Field(256, gt=0, description="rows of the previous data the Fisher information is measured on")


class PPOParams(TrainingParams):
    """PPO with a KL penalty to the reference (Ouyang et al. 2022). `max_steps` counts PPO
    iterations and `max_length` bounds prompt + response (the stage leaves out a prompt longer
    than max_length - max_new_tokens, and counts it).
    Inherited keys not used: per_device_train_batch_size and gradient_accumulation_steps
    (rollout_batch_size and mini_batch_size set the batches) and gradient_checkpointing.
    PPO runs in float32 on `compute.device`."""

    max_steps: int = Field(60, gt=0, description="PPO iterations (one rollout batch and its updates each)")
    learning_rate: float = Field(1e-5, gt=0, lt=1, description="policy learning rate")
    lr_scheduler_type: Scheduler = Field("constant", description="transformers scheduler name, over all updates")
    rollout_batch_size: int = Field(64, gt=0, description="prompts sampled per PPO iteration")
    mini_batch_size: int = Field(16, gt=0, description="responses per optimizer step")
    ppo_epochs: int = Field(2, gt=0, description="passes over each rollout batch")
    max_new_tokens: int = Field(64, gt=0, description="longest sampled response")
    temperature: float = Field(0.7, gt=0, description="sampling temperature (log-probs use the same)")
    keyed_sampling: bool = Field(False, description=KEYED_SAMPLING)
    kl_coef: float = Field(0.05, ge=0, description="beta: KL penalty per token (initial value if adaptive)")
    adaptive_kl: bool = Field(False, description="adapt beta towards target_kl (Ziegler et al. 2019)")
    target_kl: float = Field(6.0, gt=0, description="adaptive: target KL per response, in nats")
    kl_horizon: int = Field(10000, gt=0, description="adaptive: responses over which beta adapts")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (1 = Monte Carlo returns)")
    cliprange: float = Field(0.2, gt=0, lt=1, description="policy ratio clip epsilon")
    cliprange_value: float = Field(0.2, gt=0, description="value clip around the rollout's values")
    value_learning_rate: float | None = Field(None, gt=0, lt=1, description="value model lr; null = learning_rate")
    whiten_advantages: bool = Field(True, description="normalise advantages to mean 0, variance 1 per batch")
    value_init: Literal["sft", "rm"] = Field(
        "sft", description="value model init (the caller loads it): SFT model or reward model"
    )
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA on the policy, merged at the end")

    @model_validator(mode="after")
    def _check_batches(self):
        reject_unused(
            self,
            ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing"),
            "by PPO (rollout_batch_size and mini_batch_size set its batches; it runs in float32)",
        )
        problems = []
        if self.rollout_batch_size % self.mini_batch_size:
            problems.append(
                f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of mini_batch_size "
                f"({self.mini_batch_size})"
            )
        if self.max_new_tokens >= self.max_length:
            problems.append(
                f"max_new_tokens ({self.max_new_tokens}) must be less than max_length ({self.max_length}), "
                "which bounds prompt + response"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


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
    ewc: EwcParams = Field(
        default_factory=EwcParams, description="elastic weight consolidation towards SFT, Fisher on the SFT data"
    )


# The DPO losses of TRL 1.16 that read label_smoothing (trl/trainer/dpo_trainer.py, dpo_loss).
LABEL_SMOOTHING_LOSSES = ("robust", "exo_pair", "aot", "aot_unpaired")


class DPOParams(OfflineParams):
    """Direct preference optimisation: -log sigmoid(beta * (log-ratio chosen - log-ratio rejected))."""

    loss_type: str | list[str] = Field("sigmoid", description="sigmoid | ipo | hinge | any TRL DPO loss type")
    beta: float = Field(0.1, gt=0, description="KL strength (IPO: the regulariser tau)")
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="assumed label noise: read by loss types robust, exo_pair, aot, aot_unpaired only",
    )
    sft_weight: float = Field(
        5.0,
        ge=0,
        description="weight of an NLL term on chosen (RPO, Pang et al. 2024); 0 = off. Plain DPO loses accuracy here",
    )
    save_steps: int = Field(50, gt=0, description="checkpoint every N steps (a killed run resumes from the last)")
    precompute_ref_log_probs: bool = Field(True, description="reference log-probs once, cached by content (sweeps)")

    @field_validator("loss_type")
    @classmethod
    def _check_loss(cls, value):
        names = [value] if isinstance(value, str) else value
        unknown = [n for n in names if n not in DPO_LOSS_TYPES]
        if unknown:
            raise ValueError(f"unknown DPO loss type(s) {unknown}; use one of {list(DPO_LOSS_TYPES)}")
        return value

    @model_validator(mode="after")
    def _losses_trl_accepts_once(self):
        names = [self.loss_type] if isinstance(self.loss_type, str) else self.loss_type
        if self.label_smoothing and not set(names) & set(LABEL_SMOOTHING_LOSSES):
            raise ValueError(
                f"label_smoothing {self.label_smoothing}: not read by loss_type {self.loss_type} (TRL reads it for "
                f"{', '.join(LABEL_SMOOTHING_LOSSES)} only); use one of those (robust: conservative DPO), or remove it"
            )
        if "exo_pair" in names and self.label_smoothing == 0:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0 (the EXO paper's value: 1e-3)")
        if "sft" in names and self.sft_weight:
            raise ValueError(
                f"loss_type lists sft and sft_weight is {self.sft_weight}: the NLL term would count twice; "
                "weight it with sft_weight alone (drop sft from loss_type), or set sft_weight: 0"
            )
        return self
