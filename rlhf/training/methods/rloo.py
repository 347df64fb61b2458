"""RLOO (Ahmadian et al. 2024) through TRL's `RLOOTrainer`: `num_generations` completions
per prompt, each completion's baseline the mean reward of the other completions of its
prompt, the KL to the SFT reference in the reward (`beta`). The rewards are GRPO's.

Data: prompts (prompt, answer), data/prepared/prompts.parquet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from rlhf.training.online import OnlineParams

NAME = "rloo"
KIND = "online"
DATA = "prompts"


class Params(OnlineParams):
    """RLOO (Ahmadian et al. 2024): each completion's baseline is the mean reward of the
    other completions of its prompt."""

    TRL_CONFIG: ClassVar[str | None] = "RLOOConfig"

    beta: float = Field(0.05, ge=0, description="KL coefficient to the SFT reference, in the reward (TRL's default)")
    normalize_advantages: bool = Field(False, description="normalise advantages per generated batch")

    def trl_args(self) -> dict[str, Any]:
        return {**super().trl_args(), "normalize_advantages": self.normalize_advantages}


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    from trl import RLOOConfig, RLOOTrainer

    from rlhf.training.online import train_online

    return train_online(job, params, (RLOOConfig, RLOOTrainer), {}, out_dir)
