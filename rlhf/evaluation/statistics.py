"""Confidence intervals and paired comparisons over per-problem outcomes.

One number per model is one sample of a noisy process: a different draw of test problems
would give another. Here every reported mean gets a percentile bootstrap interval over
problems (Efron & Tibshirani 1993), and two models evaluated on the same problems are
compared by a paired bootstrap of the mean difference: problems are resampled together, so
the interval reflects how much the two models disagree, not how hard the problems are
(Koehn 2004 for MT; Dror et al. 2018). With numpy only: no statistics package is needed for
a mean and its percentile interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_SAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95


def _resampled_means(values: np.ndarray, samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(values), size=(samples, len(values)))
    return values[index].mean(axis=1)


def bootstrap_interval(
    values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE, samples: int = DEFAULT_SAMPLES, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (one per problem)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("no values to bootstrap")
    means = _resampled_means(data, samples, seed)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def paired_difference(
    candidate: Sequence[float],
    baseline: Sequence[float],
    confidence: float = DEFAULT_CONFIDENCE,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
) -> dict:
    """mean(candidate - baseline) over the same problems, its paired bootstrap interval,
    and the share of resamples in which the candidate does not beat the baseline
    (`p_not_better`, a one-sided bootstrap p-value for "candidate > baseline")."""
    a, b = np.asarray(candidate, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired outcomes must have the same non-zero length, got {a.size} and {b.size}")
    differences = a - b
    means = _resampled_means(differences, samples, seed)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return {
        "difference": float(differences.mean()),
        "low": float(low),
        "high": float(high),
        "p_not_better": float((means <= 0).mean()),
        "problems": int(a.size),
    }


def group_by(values: Sequence[float], labels: Sequence) -> dict[str, list[float]]:
    """The values of each label (e.g. accuracy outcomes per difficulty), labels as strings, sorted."""
    groups: dict[str, list[float]] = {}
    for label, value in zip(labels, values):
        groups.setdefault(str(label), []).append(value)
    return dict(sorted(groups.items()))
