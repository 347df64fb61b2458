"""ORPO (Hong et al. 2024): NLL on the chosen response plus an odds-ratio penalty, no
reference model,

    L = -log pi(y_w|x) - lambda * log sigmoid(log odds(y_w|x) - log odds(y_l|x))

through TRL's experimental `ORPOTrainer` (`beta` is lambda).

Data: preference (prompt, chosen, rejected), data/prepared/prefs.parquet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from rlhf.training.params import OfflineParams

NAME = "orpo"
KIND = "offline"
DATA = "prefs"


class Params(OfflineParams):
    """ORPO (Hong et al. 2024): NLL(y_w) + lambda * -log sigmoid(log odds(y_w) - log odds(y_l)), no reference."""

    TRL_CONFIG: ClassVar[str | None] = "ORPOConfig"

    beta: float = Field(0.1, gt=0, description="lambda, weight of the odds-ratio term")
    learning_rate: float = Field(3e-6, gt=0, lt=1, description="peak learning rate")

    def trl_args(self) -> dict[str, Any]:
        return {**super().trl_args(), "beta": self.beta}


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from rlhf.training.trl_training import train_trl

    return train_trl(job, params, (ORPOConfig, ORPOTrainer), out_dir=out_dir, forced_bos=True)
