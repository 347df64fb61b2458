"""The pipeline's DVC stages, one module each (`python -m stages.<name>`).

`SECTIONS` maps each params.yaml section to the class that defines it (a stage module's
`Config`, or the task's), so the whole file can be validated at once (`load_all`) before any
stage does work: every stage validates every section, and a typo anywhere fails the first
stage in a second. For that to take a second, a stage module imports only light modules at
its top (pydantic, the params blocks of `rlhf`); torch, transformers and TRL are imported in
the functions that train or generate.

The pipeline's folders are named here and in the stage modules only: the library (`rlhf`)
takes paths from its callers.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from rlhf.params import PARAMS_FILE, read_params, validate_params

SECTIONS = {
    "task": "rlhf.tasks:TaskConfig",
    "prepare": "stages.prepare:Config",
    "base": "stages.base:Config",
    "sft": "stages.sft:Config",
    "verifier": "stages.verifier:Config",
    "rm": "stages.reward_model:Config",
    "prm": "stages.process_reward_model:Config",
    "policy": "stages.policy:Config",
    "merge": "stages.merge:Config",
    "evaluate": "stages.evaluate:Config",
    "gate": "stages.capability_gate:Config",
    "infer": "stages.infer:Config",
}

DATA_DIR = Path("data/prepared")
EVAL_DIR = DATA_DIR / "eval"  # one <suite>.parquet per eval suite
MODELS_DIR = Path("models")
SFT_DIR = MODELS_DIR / "sft"
RM_DIR = MODELS_DIR / "rm"
PRM_DIR = MODELS_DIR / "prm"
POLICY_DIR = MODELS_DIR / "policy"
MERGED_DIR = MODELS_DIR / "merged"
CHAMPION_DIR = MODELS_DIR / "champion"
# Outside DVC's outputs (DVC deletes those before a stage runs), so a killed stage resumes.
CHECKPOINTS_DIR = Path("checkpoints")
REF_LOGPS_CACHE = Path("cache/ref_logps")
REPORTS_DIR = Path("reports")
# Folders of the model-based rewards and scorers that name no `path` of their own.
REWARD_MODEL_DIRS = {"reward_model": RM_DIR, "prm": PRM_DIR}


def config_class(section: str) -> type:
    module, name = SECTIONS[section].split(":")
    return getattr(importlib.import_module(module), name)


def all_configs() -> dict:
    return {section: config_class(section) for section in SECTIONS}


def load_all(path: str = PARAMS_FILE) -> dict:
    """Every section of params.yaml, validated; raises one ParamsError listing all problems."""
    return validate_params(read_params(path), all_configs(), path)


def load_config(section: str, path: str = PARAMS_FILE):
    return load_all(path)[section]


def eval_suite_path(suite: str) -> Path:
    return EVAL_DIR / f"{suite}.parquet"


def candidate_dir(name: str) -> Path:
    """A candidate's folder: `sft`, `merged`, or a policy method's name."""
    if name in ("sft", "merged"):
        return MODELS_DIR / name
    return POLICY_DIR / name
