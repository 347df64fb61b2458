"""DPO (Rafailov et al. 2023) through TRL's `DPOTrainer`, on preference pairs.

    L = -log sigmoid(beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))])

`loss_type` sigmoid is that loss, ipo (Azar et al. 2023) its squared form, hinge SLiC's;
any other TRL loss type (and a list of them, weighted) passes through. `sft_weight` > 0
adds TRL's NLL loss on the chosen response (RPO, Pang et al. 2024), which keeps the
likelihood of good solutions from falling while the margin grows. The reference is the
model trained from (the SFT model; a round's start); with LoRA it is the base with the
adapter disabled, so no second copy is held. Its log-probs are computed once and kept by
content (rlhf.training.ref_logprobs): a sweep over beta or the learning rate reuses them.

Data: preference (prompt, chosen, rejected), data/prepared/prefs.parquet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rlhf.training.params import PRECOMPUTE_REF_FIELD, OfflineParams

NAME = "dpo"
KIND = "offline"
DATA = "prefs"

LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
# The DPO losses of TRL 1.16 that read label_smoothing (trl/trainer/dpo_trainer.py, dpo_loss).
LABEL_SMOOTHING_LOSSES = ("robust", "exo_pair", "aot", "aot_unpaired")


class Params(OfflineParams):
    """Direct preference optimisation: -log sigmoid(beta * (log-ratio chosen - log-ratio rejected))."""

    TRL_CONFIG: ClassVar[str | None] = "DPOConfig"
    TRL_NAMES: ClassVar[dict[str, str]] = {**OfflineParams.TRL_NAMES, "loss_weights": "sft_weight"}

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
    precompute_ref_log_probs: bool | Literal["auto"] = PRECOMPUTE_REF_FIELD

    @field_validator("loss_type")
    @classmethod
    def _check_loss(cls, value):
        names = [value] if isinstance(value, str) else value
        unknown = [n for n in names if n not in LOSS_TYPES]
        if unknown:
            raise ValueError(f"unknown DPO loss type(s) {unknown}; use one of {list(LOSS_TYPES)}")
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

    def trl_args(self) -> dict[str, Any]:
        """Its loss types, and TRL's NLL loss on the chosen response weighted `sft_weight`
        (RPO) when that is > 0."""
        loss_types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        return {
            **super().trl_args(),
            "loss_type": loss_types + (["sft"] if self.sft_weight else []),
            "loss_weights": [1.0] * len(loss_types) + ([self.sft_weight] if self.sft_weight else []),
            "beta": self.beta,
            "label_smoothing": self.label_smoothing,
            "precompute_ref_log_probs": self.precompute_ref_log_probs,
        }


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    from trl import DPOConfig, DPOTrainer

    from rlhf.training.ref_logprobs import reference_trainer
    from rlhf.training.trl_training import train_trl

    return train_trl(job, params, (DPOConfig, reference_trainer(DPOTrainer, params, job)), out_dir=out_dir)
