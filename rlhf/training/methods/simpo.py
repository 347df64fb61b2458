"""SimPO (Meng et al. 2024): reference-free, the length-normalised log-likelihood margin with
a target gap,

    L = -log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)

through TRL's `CPOTrainer` with `loss_type="simpo"` and `cpo_alpha=0` (CPO's
behaviour-cloning term switched off: SimPO proper).

Data: preference (prompt, chosen, rejected), data/prepared/prefs.parquet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from rlhf.training.params import OfflineParams

NAME = "simpo"
KIND = "offline"
DATA = "prefs"


class Params(OfflineParams):
    """SimPO (Meng et al. 2024): -log sigmoid(beta/|y| (log pi(y_w) - log pi(y_l)) - gamma), no reference."""

    TRL_CONFIG: ClassVar[str | None] = "CPOConfig"
    # loss_type and cpo_alpha make CPO SimPO: fixed (None), not a key of this section.
    TRL_NAMES: ClassVar[dict[str, str | None]] = {
        **OfflineParams.TRL_NAMES, "simpo_gamma": "gamma", "loss_type": None, "cpo_alpha": None,
    }  # fmt: skip

    beta: float = Field(2.0, gt=0, description="scale of the length-normalised log-likelihood margin")
    gamma: float = Field(0.5, ge=0, description="target reward margin (TRL's simpo_gamma)")

    def trl_args(self) -> dict[str, Any]:
        return {**super().trl_args(), "loss_type": "simpo", "cpo_alpha": 0.0, "beta": self.beta,
                "simpo_gamma": self.gamma}  # fmt: skip


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from rlhf.training.trl_training import train_trl

    return train_trl(job, params, (CPOConfig, CPOTrainer), out_dir=out_dir, forced_bos=True)
