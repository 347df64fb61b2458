"""Loading a process reward model of either kind from the folder stage `prm` wrote.

Both kinds (`ClassifierPRM`, a trained token-classification head; `LikelihoodPRM`, a
calibrated LM surprise) score steps through the same interface (`score_steps`,
`score_completions`), so best-of-n, MCTS and the PRM reward never ask which one they hold.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf.models.folders import (
    PRM_FILE,
    ModelNotFoundError,
    UnusableModelError,
    absent_reason,
    resolve_model_dir,
    scorer_problem,
)
from rlhf.rewards.prm_classifier import ClassifierPRM
from rlhf.rewards.prm_likelihood import LikelihoodPRM

KINDS = {"classifier": ClassifierPRM, "likelihood": LikelihoodPRM}


def check_prm(path: str | Path, separator: str | None = None, key: str = "process reward model") -> Path:
    """The folder of the PRM in `path` (a pointer followed), after checking, without loading
    it, that stage prm wrote one there and, with `separator` (the task's), that it splits
    steps on it; else an error naming `key` that says what to give."""
    if not Path(path).exists():
        raise ModelNotFoundError(f"{key} {path} does not exist: give a folder stage prm wrote (models/prm)")
    folder = resolve_model_dir(path)
    reason = absent_reason(folder)
    if reason:
        raise UnusableModelError(f"{key} {path} holds no process reward model: {reason}")
    problem = scorer_problem("prm", path, separator)
    if problem:
        raise UnusableModelError(f"{key} {problem}")
    return folder


def load_prm(
    path: str | Path, trust_remote_code: bool = False, separator: str | None = None, key: str = "process reward model"
) -> ClassifierPRM | LikelihoodPRM:
    """The PRM saved in `path` (its kind is read from prm.json), checked by `check_prm`."""
    folder = check_prm(path, separator, key)
    settings = json.loads((folder / PRM_FILE).read_text())
    return KINDS[settings.get("kind", "classifier")].load(folder, settings, trust_remote_code)
