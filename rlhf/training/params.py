"""The params blocks every training method shares: optimisation settings and the `trl:`
mapping (`TrainingParams`), LoRA, EWC, and what the offline policy methods share (the
online ones: rlhf/training/online.py). Each method's own block is in
rlhf/training/methods/<name>.py.

Plain pydantic models with no torch, transformers or TRL import, so that params.yaml
validates in a second. Each block maps its keys onto its TRL config (`trl_args`); the keys
of its `trl:` mapping go to that config unchanged, after a check against the config's
fields (rlhf.training.trl_options) that imports no TRL.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rlhf.models.settings import ModelOverride
from rlhf.params import InputError, StageConfig

PRECOMPUTE_REF_FIELD = Field(
    "auto",
    description="reference log-probs of every row before training, cached by content (sweeps: true), or per "
    "batch as training goes (false); auto: before training when the run draws at least half the rows",
)


def precompute_reference(params, rows: int, processes: int) -> bool:
    """Whether the reference log-probs of all `rows` are computed before training (TRL's
    precompute, cached here by content) rather than per batch as training goes: params
    `precompute_ref_log_probs`, or with `auto` when the run draws at least half the rows
    (max_steps x batch x accumulation x processes; every epoch when max_steps is null). A
    run of 10 steps over 169k pairs first scored all of them: about 25 minutes on 2 cores
    for the 320 it trained on."""
    if params.precompute_ref_log_probs != "auto":
        return params.precompute_ref_log_probs
    if params.max_steps is None:
        return True
    drawn = params.max_steps * params.per_device_train_batch_size * params.gradient_accumulation_steps * processes
    return 2 * drawn >= rows


KEYED_SAMPLING = (
    "draw each completion from a generator keyed by (seed, step, row): the same completions with 1 or N "
    "processes and any batch split, at the cost of a generator per row and token (rlhf.models.generation)"
)


# transformers' schedulers that need no further arguments (cosine_with_min_lr, warmup_stable_decay
# and greedy need lr_scheduler_kwargs, which `trl:` passes; reduce_lr_on_plateau needs an eval metric).
Scheduler = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
]

TRL_FIELD = Field(
    default_factory=dict,
    description="any other option of the method's TRL config, passed unchanged (checked against its fields): "
    "e.g. {num_train_epochs: 2, optim: adamw_8bit, save_total_limit: 3}",
)
MODEL_FIELD = Field(None, description="this block's own keys of params `model` (dtype, quantization, ...)")


class PolicyCode(StageConfig):
    """The key of params `policy` that says whether its models may run their own code
    (stage policy's Config extends it; the labelling page reads it alone)."""

    trust_remote_code: bool = Field(False, description="allow custom modelling code")


class TrainingDataError(InputError, ValueError):
    """The training data cannot be trained as params ask (no row fits max_length, a chat
    template TRL cannot mask)."""


class TrainingParams(StageConfig):
    """Optimisation settings shared by the training stages, mapped onto a TRL (or
    transformers) config by `trl_args`; `trl` passes any other option of that config."""

    # The config class a block's `trl:` keys are checked against (rlhf.training.trl_options);
    # None: a trainer of our own, which takes no `trl:` keys.
    TRL_CONFIG: ClassVar[str | None] = "TrainingArguments"
    # Options the pipeline sets by default that `trl:` may change.
    TRL_DEFAULTS: ClassVar[dict[str, Any]] = {"save_total_limit": 1, "save_strategy": "steps"}
    # TRL's name -> our key, where they differ (named in the message that refuses a `trl:` key).
    TRL_NAMES: ClassVar[dict[str, str]] = {"warmup_steps": "warmup_ratio", "data_seed": "seed"}

    max_steps: int | None = Field(
        300, gt=0, description="optimizer steps (null: train for trl.num_train_epochs, TRL's default 3)"
    )
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
    model: ModelOverride | None = MODEL_FIELD
    trl: dict[str, Any] = TRL_FIELD

    def trl_args(self) -> dict[str, Any]:
        """This block's keys as its TRL config's arguments (every key, whatever the values,
        so that the `trl:` check knows which options the block owns)."""
        return {
            "max_steps": self.max_steps if self.max_steps is not None else -1,
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "learning_rate": self.learning_rate,
            "lr_scheduler_type": self.lr_scheduler_type,
            "warmup_steps": self.warmup_ratio,  # transformers 5 reads a value below 1 as a ratio
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
            "logging_steps": self.logging_steps,
            "save_steps": self.save_steps,
            "seed": self.seed,
            "data_seed": self.seed,
        }

    @field_validator("trl")
    @classmethod
    def _check_trl(cls, value: dict[str, Any]) -> dict[str, Any]:
        from rlhf.training.trl_options import trl_problems

        if problems := trl_problems(cls, value):
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _epochs_or_steps(self):
        if "num_train_epochs" in self.trl and self.max_steps is not None:
            raise ValueError(
                f"trl.num_train_epochs: max_steps ({self.max_steps}) overrides it in TRL; set max_steps: null to "
                "train by epochs"
            )
        return self


class LoraParams(StageConfig):
    """A peft LoRA adapter; merged into the base weights when the model is saved (the
    adapter is saved too, in the model folder's `adapter/`)."""

    enabled: bool = Field(False, description="train a LoRA adapter instead of all weights")
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: int = Field(16, gt=0, description="scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: str | list[str] = Field("all-linear", description="modules to adapt")

    def check_targets(self, model, key: str, output_layer: bool = True) -> None:
        """Fail naming `key` (the params key of target_modules) when a listed module name is
        no module of `model` (peft's matching: the name, or a dotted name ending in it), or,
        with `output_layer` False, names the output layer (TRL's DPO and KTO refuse an
        adapter there): raised before training, not from inside peft or TRL. `model` may be
        an empty (meta-device) model: only its module names are read."""
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


class EwcParams(StageConfig):
    """Elastic weight consolidation (rlhf.training.ewc): a pull towards the weights the
    training starts from, weighted by their Fisher information on the previous data."""

    strength: float = Field(0.0, ge=0, description="lambda of the EWC penalty; 0 = off")
    samples: int = Field(256, gt=0, description="rows of the previous data the Fisher information is measured on")


class OfflineParams(TrainingParams):
    """What every offline preference method shares: its optimisation budget and LoRA block."""

    max_steps: int | None = Field(100, gt=0, description="optimizer steps (null: trl.num_train_epochs)")
    per_device_train_batch_size: int = Field(32, gt=0, description="pairs per step")
    learning_rate: float = Field(1e-5, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per prompt+response")
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    ewc: EwcParams = Field(
        default_factory=EwcParams, description="elastic weight consolidation towards SFT, Fisher on the SFT data"
    )

    def trl_args(self) -> dict[str, Any]:
        return {**super().trl_args(), "max_length": self.max_length}
