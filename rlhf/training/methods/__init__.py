"""One module per training method, like TRL's `<name>_config.py` + `<name>_trainer.py`: each
holds its params block (`Params`, pydantic, no torch import at the top), the TRL config and
trainer it maps to (PPO: ours, rlhf/training/ppo.py), the data contract it reads (`DATA`,
a prepared table), whether it is offline or online (`KIND`: stage policy@<name> or
rl@<name>; `supervised` for sft), and its own hooks, in `train(job, params, out_dir)`.

Adding a method is one module here, one entry in `METHODS`, and its section in params.yaml
(`policy.<name>`): stage policy's Config takes its block from `METHODS`.
"""

from __future__ import annotations

from types import ModuleType

import rlhf.training.methods.dpo as dpo
import rlhf.training.methods.grpo as grpo
import rlhf.training.methods.kto as kto
import rlhf.training.methods.orpo as orpo
import rlhf.training.methods.ppo as ppo
import rlhf.training.methods.rloo as rloo
import rlhf.training.methods.sft as sft
import rlhf.training.methods.simpo as simpo

METHODS: dict[str, ModuleType] = {module.NAME: module for module in (sft, dpo, simpo, orpo, kto, grpo, rloo, ppo)}
OFFLINE = tuple(name for name, module in METHODS.items() if module.KIND == "offline")
ONLINE = tuple(name for name, module in METHODS.items() if module.KIND == "online")
POLICY = OFFLINE + ONLINE  # what stage policy trains (sft has its own stage)
