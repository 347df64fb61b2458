"""Loading a process reward model of either kind from the folder stage `prm` wrote.

Both kinds (`ClassifierPRM`, a trained token-classification head; `LikelihoodPRM`, a
calibrated LM surprise) score steps through the same interface (`score_steps`,
`score_completions`), so best-of-n, MCTS and the PRM reward never ask which one they hold.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf.models.folders import PRM_FILE, absent_reason, resolve_model_dir
from rlhf.rewards.prm_classifier import ClassifierPRM
from rlhf.rewards.prm_likelihood import LikelihoodPRM

KINDS = {"classifier": ClassifierPRM, "likelihood": LikelihoodPRM}


def load_prm(path: str | Path, trust_remote_code: bool = False) -> ClassifierPRM | LikelihoodPRM:
    """The PRM saved in `path` (its kind is read from prm.json)."""
    path = resolve_model_dir(path)
    reason = absent_reason(path)
    if reason:
        raise FileNotFoundError(f"{path} holds no process reward model: {reason}")
    settings_file = Path(path) / PRM_FILE
    if not settings_file.is_file():
        raise FileNotFoundError(f"{path} has no {PRM_FILE}: it is not a process reward model written by stage prm")
    settings = json.loads(settings_file.read_text())
    return KINDS[settings.get("kind", "classifier")].load(path, settings, trust_remote_code)
