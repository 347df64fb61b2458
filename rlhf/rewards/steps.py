"""What every process reward model shares, whatever its kind: splitting a completion into
steps, aggregating step scores into one, and the held-out metrics of step labels.

Light on purpose (no torch): the rewards, MCTS and the stages import it freely. The kinds
are `rlhf.rewards.prm_classifier` and `rlhf.rewards.prm_likelihood`; `rlhf.rewards.prm`
loads either from its folder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

AGGREGATIONS = ("min", "prod", "last")
# When a caller names no separator (the stage passes its task's): one step per line.
DEFAULT_SEPARATOR = "\n"


def aggregate(step_scores: Sequence[float], how: str = "min") -> float:
    """One score for a solution from its step scores: the weakest step (`min`), the chance
    that every step is good if steps were independent (`prod`), or the last step's (`last`,
    which under Math-Shepherd labels already says whether the whole chain is good)."""
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {how!r}; expected one of {AGGREGATIONS}")
    if not step_scores:
        raise ValueError("no step scores to aggregate")
    if how == "min":
        return float(min(step_scores))
    if how == "prod":
        return float(math.prod(step_scores))
    return float(step_scores[-1])


def locate_steps(tokenizer, prompt_text: str, steps: Sequence[str], separator: str, closed: bool):
    """Token ids of `prompt_text` (tokenized alone, as generation reads it) followed by the
    completion the steps make, tokenized as one text (as the model wrote it and as TRL
    tokenizes a completion), with each step's tokens located by character offsets: per step
    (its first token, one past its last token, the last token that ends by the end of the
    separator after it, so before the next step's text; None where nothing follows).
    `closed`: every step, the last too, is followed by the separator; else the steps are
    joined by it.

    Tokenizing step by step instead would not give the model's own ids: a SentencePiece
    tokenizer starts every piece with a word boundary (`▁`), a BPE merges a step's end with
    the separator (`.\n\n`). None for a tokenizer without offsets (a slow one) or steps
    whose tokens overlap (a token spanning a whole step): the caller then tokenizes piece by
    piece."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    completion = separator.join(steps) + (separator if closed else "")
    encoded = tokenizer(completion, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    located, start = [], 0
    for index, step in enumerate(steps):
        end = start + len(step)
        tokens = [t for t, (a, b) in enumerate(offsets) if b > start and a < end]
        if not tokens:
            return None
        closing = None
        if closed or index < len(steps) - 1:  # the last token that ends by the separator's end
            before_next = [t for t, (_, b) in enumerate(offsets) if b <= end + len(separator)]
            closing = max(before_next + [tokens[-1]])
        located.append(
            (len(ids) + tokens[0], len(ids) + tokens[-1] + 1, None if closing is None else len(ids) + closing)
        )
        start = end + len(separator)
    firsts = [first for first, _, _ in located]
    if any(b <= a for a, b in zip(firsts, firsts[1:])):
        return None
    return ids + list(encoded["input_ids"]), located


def split_completion(completion: str, separator: str) -> list[str]:
    """Steps of a completion, split on the separator the PRM was trained with, each exactly
    as written (as `Task.split_steps`: a leading space stays)."""
    return [step for step in completion.rstrip().split(separator) if step.strip()]


class StepScorer:
    """Scoring whole completions from per-step scores; a PRM kind supplies `score_steps`
    and `separator`."""

    separator: str

    def score_steps(self, prompts: Sequence, steps: Sequence[Sequence[str]], batch_size: int = 64, finished=None):
        """P(good) per step of each row; `finished` (default: all) says per row whether it
        is a whole solution or a partial path (MCTS), where a kind scores the two apart."""
        raise NotImplementedError

    def score_completions(
        self, prompts: Sequence, completions: Sequence[str], how: str = "min", batch_size: int = 64
    ) -> list[float]:
        """One score per completion: its steps' P(good) aggregated by `how`. A completion
        with no steps scores 0.0 (there is nothing to verify as good)."""
        steps = [split_completion(c, self.separator) for c in completions]
        step_scores = self.score_steps(prompts, steps, batch_size)
        return [aggregate(s, how) if s else 0.0 for s in step_scores]


# ----------------------------------------------------------------------------- metrics


def f1(predicted: Sequence[bool], actual: Sequence[bool]) -> float | None:
    """F1 of the positive (True) class; None (undefined, not 0) when it is neither predicted
    nor present: held-out steps with no bad one say nothing of finding bad steps."""
    tp = sum(p and a for p, a in zip(predicted, actual))
    fp = sum(p and not a for p, a in zip(predicted, actual))
    fn = sum(a and not p for p, a in zip(predicted, actual))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None


def prm_metrics(
    step_scores: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], threshold: float = 0.5
) -> dict:
    """Held-out quality of a PRM. A step is predicted good when P(good) > threshold.

    * step_accuracy: predicted == label over every step;
    * f1_bad (the headline F1: finding wrong steps is what a verifier is for, and bad steps
      are the minority) and f1_good; None when the class is neither held out nor predicted;
    * first_error_accuracy: over flawed solutions, the first step predicted bad is exactly
      the first bad step (None without a flawed solution);
    * outcome_accuracy_<how>: aggregated score > threshold agrees with "every step good".
    """
    predicted = [[s > threshold for s in row] for row in step_scores]
    flat_predicted = [p for row in predicted for p in row]
    flat_actual = [bool(a) for row in labels for a in row]
    flawed = [(p, a) for p, a in zip(predicted, labels) if not all(a)]
    first_bad = [p.index(False) if False in p else -1 for p, _ in flawed]
    metrics = {
        "step_accuracy": sum(p == a for p, a in zip(flat_predicted, flat_actual)) / len(flat_actual),
        "f1_bad": f1([not p for p in flat_predicted], [not a for a in flat_actual]),
        "f1_good": f1(flat_predicted, flat_actual),
        "first_error_accuracy": (
            sum(f == list(a).index(False) for f, (_, a) in zip(first_bad, flawed)) / len(flawed) if flawed else None
        ),
        "bad_step_fraction": flat_actual.count(False) / len(flat_actual),
        "eval_solutions": len(labels),
        "eval_steps": len(flat_actual),
    }
    for how in AGGREGATIONS:
        outcome = [(aggregate(s, how) > threshold) == all(a) for s, a in zip(step_scores, labels)]
        metrics[f"outcome_accuracy_{how}"] = sum(outcome) / len(outcome)
    return metrics
