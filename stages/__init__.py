"""The pipeline's DVC stages, one module each (`python -m stages.<name>`).

`SECTIONS` maps each params.yaml section to the module whose `Config` defines it, so the
whole file can be validated at once (`load_config`) before any stage does work: every stage
validates every section, and a typo anywhere fails the first stage in a second.
"""

from __future__ import annotations

import importlib

from rlhf.params import PARAMS_FILE, read_params, validate_params

SECTIONS = {
    "prepare": "stages.prepare",
    "base": "stages.base",
    "sft": "stages.sft",
    "verifier": "stages.verifier",
    "rm": "stages.reward_model",
    "prm": "stages.process_reward_model",
    "policy": "stages.policy",
    "merge": "stages.merge",
    "evaluate": "stages.evaluate",
    "gate": "stages.capability_gate",
    "infer": "stages.infer",
}


def all_configs() -> dict:
    return {section: importlib.import_module(module).Config for section, module in SECTIONS.items()}


def load_all(path: str = PARAMS_FILE) -> dict:
    """Every section of params.yaml, validated; raises one ParamsError listing all problems."""
    return validate_params(read_params(path), all_configs(), path)


def load_config(section: str, path: str = PARAMS_FILE):
    return load_all(path)[section]
