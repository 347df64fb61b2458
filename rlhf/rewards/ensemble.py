"""An ensemble of K outcome reward models, scored together.

Each member is trained by TRL's `RewardTrainer` from a different seed: a
sequence-classification model with one output, or a likelihood reward model
(rlhf.rewards.likelihood_rm). The ensemble's score is the members' mean; their standard
deviation is a cheap uncertainty estimate (reward-model disagreement), which
rewards may penalise as ``mean - k * std``.

Texts are built exactly as `RewardTrainer` builds them: prompt + completion + EOS for
standard data, the chat template over prompt + completion messages for conversational data.

`RewardEnsemble.load(root, resident=False)` holds the members' folders only and loads one
member at a time for each `score` (freeing it before the next): the memory of one member,
not K, beside the models a stage already holds (evaluate: the reference and a candidate),
for K loads a call. A stage that scores once per model and suite (evaluate, rm's held-out
set) takes it; rewards scored at every training step keep the members loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.models.compute import release_memory
from rlhf.models.folders import MEMBER_PREFIX, absent_reason
from rlhf.models.generation import reward_text
from rlhf.models.loading import load_reward_model, load_tokenizer
from rlhf.rewards.likelihood_rm import LikelihoodRewardModel, is_likelihood_rm


def member_dirs(root: str | Path) -> list[Path]:
    root = Path(root)
    reason = absent_reason(root)
    if reason:
        raise FileNotFoundError(f"{root} holds no reward model: {reason}")
    members = [p for p in root.glob(f"{MEMBER_PREFIX}*") if p.is_dir() and p.name[len(MEMBER_PREFIX) :].isdigit()]
    members.sort(key=lambda p: int(p.name[len(MEMBER_PREFIX) :]))  # member_2 before member_10
    if not members:
        raise FileNotFoundError(
            f"no reward models in {root} (expected folders {MEMBER_PREFIX}0, {MEMBER_PREFIX}1, ...: what stage rm "
            "writes under models/rm); run `dvc repro rm`, or point the reward's `path` at such a folder"
        )
    return members


def load_member(path: Path, trust_remote_code: bool = False):
    what = f"reward model {path.name}"
    if is_likelihood_rm(path):
        return LikelihoodRewardModel.load(path, trust_remote_code, what=what)
    return load_reward_model(path, trust_remote_code, what=what)


@torch.inference_mode()
def score_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    model.eval()
    tokenizer.padding_side = "right"
    scores = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            list(texts[start : start + batch_size]), return_tensors="pt", padding=True, add_special_tokens=False
        ).to(model.device)
        scores.append(model(**batch).logits[:, 0].float().cpu())
    return torch.cat(scores) if scores else torch.empty(0)


@dataclass
class EnsembleScores:
    members: torch.Tensor  # (K, N)

    @property
    def mean(self) -> torch.Tensor:
        return self.members.mean(0)

    @property
    def std(self) -> torch.Tensor:
        return self.members.std(0, unbiased=False)

    @classmethod
    def concatenate(cls, parts: Sequence[EnsembleScores]) -> EnsembleScores:
        """The scores of consecutive batches as one (K, N) set."""
        return cls(torch.cat([part.members for part in parts], dim=1))


class RewardEnsemble:
    """K members (loaded models, or with `resident` off their folders, each loaded for a
    `score` and freed after it) and their tokenizer."""

    def __init__(self, models: list, tokenizer, trust_remote_code: bool = False):
        self.models = models
        self.tokenizer = tokenizer
        self.trust_remote_code = trust_remote_code

    @classmethod
    def load(cls, root: str | Path, trust_remote_code: bool = False, resident: bool = True) -> RewardEnsemble:
        dirs = member_dirs(root)
        models = [load_member(d, trust_remote_code) for d in dirs] if resident else dirs
        return cls(models, load_tokenizer(dirs[0], trust_remote_code), trust_remote_code)

    def score(self, prompts: Sequence, completions: Sequence, batch_size: int = 64) -> EnsembleScores:
        texts = [reward_text(self.tokenizer, p, c) for p, c in zip(prompts, completions)]
        scores = []
        for member in self.models:
            model = load_member(member, self.trust_remote_code) if isinstance(member, Path) else member
            if isinstance(model, LikelihoodRewardModel):
                scores.append(model.score(self.tokenizer, prompts, completions, batch_size))
            else:
                scores.append(score_texts(model, self.tokenizer, texts, batch_size))
            if model is not member:  # loaded for this call: freed before the next member loads
                del model
                release_memory()
        return EnsembleScores(torch.stack(scores))


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Fraction of pairs where the chosen response scores strictly higher; ties count half."""
    wins = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    return float(wins.mean())
