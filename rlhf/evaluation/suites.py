"""One model on one eval suite: greedy completions scored per problem (the task's answer
check, format, the judge's reward and win-rate), their means with bootstrap intervals and
accuracy per difficulty, KL to the reference, distinct-n and length. Stage evaluate runs it
for every candidate; the self-improvement rounds for theirs.

`config` is any object with the evaluate section's keys (stages.evaluate.Config):
max_new_tokens, batch_size, kl_prompts, confidence, bootstrap_samples.
"""

from __future__ import annotations

from rlhf.tasks import Task


def suite_digest(prompts: list, answers: list) -> str:
    """Names one version of a suite: paired comparisons need the same problems."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps([prompts, answers], default=str).encode()).hexdigest()[:16]


def summarise(config, outcomes: dict[str, list], difficulty: list | None) -> dict:
    """The means of the per-problem outcomes, with intervals, and accuracy per difficulty."""
    from rlhf.evaluation.statistics import bootstrap_interval, group_by

    summary: dict = {}
    for name, values in outcomes.items():
        if not values:
            summary[name] = None
            continue
        summary[name] = sum(values) / len(values)
        low, high = bootstrap_interval(values, config.confidence, config.bootstrap_samples)
        summary[f"{name}_low"], summary[f"{name}_high"] = low, high
    if difficulty is not None and outcomes.get("accuracy"):
        groups = group_by(outcomes["accuracy"], difficulty)
        summary["accuracy_by_difficulty"] = {k: sum(v) / len(v) for k, v in groups.items()}
        summary["accuracy_by_difficulty_interval"] = {
            k: list(bootstrap_interval(v, config.confidence, config.bootstrap_samples)) for k, v in groups.items()
        }
        summary["problems_by_difficulty"] = {k: len(v) for k, v in groups.items()}
    return summary


# Metrics with one value per problem: their means get intervals (`<name>_low`, `_high`) and
# paired gate tests; the rest are one number per model and suite.
PER_PROBLEM = ("accuracy", "format_rate", "reward", "win_rate")
SUITE_METRICS = (
    *PER_PROBLEM,
    *(f"{name}_{end}" for name in PER_PROBLEM for end in ("low", "high")),
    "kl_to_ref",
    "reward_std",
    "distinct_1",
    "distinct_2",
    "mean_length",
    "seconds",
)

MISSING_DIFFICULTY = "missing"  # the label of a problem whose difficulty cell is empty


def answer_difficulty(suite) -> list[str] | None:
    """The difficulty label (as a string; `missing` for an empty cell, read as None or NaN)
    of each problem of `suite` with an answer, aligned with its accuracy outcomes; None when
    the suite has no `difficulty` column."""
    import pandas as pd

    if "difficulty" not in suite:
        return None
    answers = suite["answer"] if "answer" in suite else [None] * len(suite)
    return [
        str(d) if d is not None and pd.notna(d) else MISSING_DIFFICULTY
        for d, a in zip(suite["difficulty"], answers)
        if a is not None and pd.notna(a)
    ]


SUITE_COLUMNS = ["prompt", "answer", "difficulty"]  # what evaluation reads of a suite


def table_difficulties(table) -> set[str]:
    """The difficulty labels of a suite's answered problems (a frame); empty without the column."""
    return set(answer_difficulty(table) or [])


def suite_identity(suite) -> dict:
    """What pairs per-problem outcomes across models and runs: the suite's `digest` (its
    prompts and answers) and, when it has the column, each answered problem's `difficulty`."""
    answers = suite["answer"].tolist() if "answer" in suite else []
    identity = {"digest": suite_digest(suite["prompt"].tolist(), answers)}
    if (labels := answer_difficulty(suite)) is not None:
        identity["difficulty"] = labels  # aligned with the accuracy outcomes (gate tests by difficulty)
    return identity


def evaluate_model(
    config, task: Task, model, reference, tokenizer, judge, suite, ref_rewards, max_new_tokens: int | None = None
) -> tuple:
    """(metrics, per-problem outcomes, completions) of one model on one suite. No
    `reference` (None): KL is not measured; no `judge`: reward and win-rate are not.
    `max_new_tokens`: the generation budget (default: the config's)."""
    import pandas as pd
    import torch

    from rlhf.evaluation.metrics import completion_kl, distinct_n
    from rlhf.models.generation import generate

    prompts = suite["prompt"].tolist()
    answers = [a if pd.notna(a) else None for a in suite["answer"]] if "answer" in suite else [None] * len(prompts)
    texts = generate(model, tokenizer, prompts, max_new_tokens or config.max_new_tokens, config.batch_size)
    rewards = judge.score(prompts, texts) if judge is not None else None
    kl_n = min(config.kl_prompts, len(prompts))
    if model is reference:
        kl = torch.zeros(1)
    elif kl_n and reference is not None:
        kl = completion_kl(model, reference, tokenizer, prompts[:kl_n], texts[:kl_n])
    else:  # kl_prompts 0: not measured (None), not a KL of 0 that a gate test would pass
        kl = None
    outcomes = {
        "accuracy": [float(task.is_correct(t, a)) for t, a in zip(texts, answers) if a is not None]
        if task.checks_answers
        else [],
        "format_rate": [float(task.is_well_formatted(t)) for t in texts] if task.has_format else [],
    }
    metrics = {
        **summarise(config, outcomes, answer_difficulty(suite)),
        "kl_to_ref": float(kl.mean()) if kl is not None else None,
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
        "mean_length": sum(len(t) for t in texts) / len(texts),
    }
    judge_metrics(config, metrics, outcomes, rewards, ref_rewards)
    return metrics, outcomes, rewards.mean if rewards is not None else None, texts


def judge_metrics(config, metrics: dict, outcomes: dict, rewards, ref_rewards) -> None:
    """Add the judge's per-problem `reward` and `win_rate` (against `ref_rewards`, the
    reference's rewards on the same prompts; None: against itself) to `outcomes`, and their
    means with intervals and the members' spread (`reward_std`) to `metrics`; `rewards`
    None (no judge): the same keys, empty or None."""
    from rlhf.evaluation.metrics import wins

    judged = {
        "reward": rewards.mean.tolist() if rewards is not None else [],
        "win_rate": wins(rewards.mean, rewards.mean if ref_rewards is None else ref_rewards).tolist()
        if rewards is not None
        else [],
    }
    outcomes.update(judged)
    metrics.update(summarise(config, judged, None))
    metrics["reward_std"] = float(rewards.std.mean()) if rewards is not None else None
