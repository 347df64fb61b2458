"""GRPO (Shao et al. 2024) through TRL's `GRPOTrainer`: `num_generations` completions per
prompt, scored by the weighted rewards of params (rlhf.rewards.functions: the task checks
the answers); each completion's advantage is its reward normalised within its prompt's
group, and the policy is updated with a clipped ratio, with a KL term to the SFT reference
when `beta` > 0. `loss_type` picks TRL's normalisation (grpo, dr_grpo, dapo, ...).
Generation with vLLM, as TRL does it, is `trl: {use_vllm: true, vllm_mode: colocate}`
(or `server`, with `trl vllm-serve` running).

Data: prompts (prompt, answer), data/prepared/prompts.parquet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlhf.training.online import OnlineParams

NAME = "grpo"
KIND = "online"
DATA = "prompts"


class Params(OnlineParams):
    """GRPO (Shao et al. 2024): advantages are rewards normalised within each prompt's group."""

    TRL_CONFIG: ClassVar[str | None] = "GRPOConfig"

    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo", description="TRL's GRPO loss types"
    )
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="divide advantages by this std")

    def trl_args(self) -> dict[str, Any]:
        return {**super().trl_args(), "loss_type": self.loss_type, "scale_rewards": self.scale_rewards}


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.training.online import train_online

    return train_online(job, params, (GRPOConfig, GRPOTrainer), {}, out_dir)
