"""KTO (Ethayarajh et al. 2024): a prospect-theoretic loss on unpaired samples, each marked
desirable or not, against a reference point estimated from a KL term over the batch
(TRL's `KTOTrainer`: it pairs each row with its neighbour in the batch, so the rows are
shuffled by `seed` first, and a batch needs at least 2 rows).

Data: unpaired (prompt, completion, label), data/prepared/unpaired.parquet (derived from the
preference pairs when not given).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlhf.training.params import PRECOMPUTE_REF_FIELD, OfflineParams

NAME = "kto"
KIND = "offline"
DATA = "unpaired"


class Params(OfflineParams):
    """KTO (Ethayarajh et al. 2024): prospect-theoretic loss on unpaired desirable/undesirable samples."""

    TRL_CONFIG: ClassVar[str | None] = "KTOConfig"

    beta: float = Field(0.1, gt=0, description="KL strength")
    desirable_weight: float = Field(1.0, gt=0, description="loss weight of desirable samples")
    undesirable_weight: float = Field(1.0, gt=0, description="loss weight of undesirable samples")
    learning_rate: float = Field(3e-6, gt=0, lt=1, description="peak learning rate")
    precompute_ref_log_probs: bool | Literal["auto"] = PRECOMPUTE_REF_FIELD
    per_device_train_batch_size: int = Field(
        32, gt=1, description="samples per step (KTO's KL estimate needs a real batch: at least 2)"
    )

    def trl_args(self) -> dict[str, Any]:
        return {
            **super().trl_args(),
            "beta": self.beta,
            "desirable_weight": self.desirable_weight,
            "undesirable_weight": self.undesirable_weight,
            "precompute_ref_log_probs": self.precompute_ref_log_probs,
        }


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    from trl import KTOConfig, KTOTrainer

    from rlhf.training.ref_logprobs import reference_trainer
    from rlhf.training.trl_training import train_trl

    # TRL reads KTO's rows in order (its KL term pairs neighbours).
    trainer = reference_trainer(KTOTrainer, params, job)
    return train_trl(job, params, (KTOConfig, trainer), out_dir=out_dir, shuffle_rows=True)
