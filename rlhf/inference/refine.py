"""Critique and refine: PRM-guided correction of sampled solutions.

The process reward model is the critic. It scores every step of a sampled solution (the
step verification of Math-Shepherd, Wang et al. 2024: a step's score estimates the chance
that the chain so far still leads to the right answer); the first step it rates below
`threshold` is the first error. The policy then regenerates from the step before it: it
continues `prompt + the steps before the first error`, exactly as written (the prefix MCTS
expands from, `strategies.prefix_text`), `attempts` times, and the PRM scores each whole
candidate (prefix + continuation). The best-scoring candidate (its weakest step: the "min"
aggregation) replaces the solution when every one of its steps is rated good; otherwise the
solution stays unrepaired. A solution with no step below the threshold is kept as it is.

Selection reads the PRM alone, so refinement runs without an answer key (the
self-improvement rounds add the repaired solutions to their training data). Where answers
are known, each result also records whether the original and the refined solution are
right, and `repair_report` reports the share of wrong samples repaired and the repairs
that are still wrong; that is measurement only.

Our own code: TRL has no PRM-guided refinement (nor any PRM-guided generation), and the
regeneration reuses the project's batched sampler (`rlhf.models.generation.sample`: one
generate call per batch over every solution that needs it) and its PRM interface
(`rlhf.rewards.steps.StepScorer.score_steps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlhf.inference.strategies import join_continuation, prefix_text
from rlhf.models.generation import sample
from rlhf.rewards.steps import StepScorer, aggregate
from rlhf.tasks.base import Task

KEPT, REPAIRED, UNREPAIRED = "kept", "repaired", "unrepaired"
STATUSES = (KEPT, REPAIRED, UNREPAIRED)


@dataclass
class Refinement:
    """What refinement did with one sampled solution.

    `status`: `kept` (no step below the threshold: `refined` is None), `repaired` (`refined`
    is the chosen candidate, every step rated good) or `unrepaired` (no candidate passed).
    `bad_step` is the index of the first step below the threshold in the task's steps of
    `original` (0 for a completion with no steps), `prefix` the text of the steps before it
    with their separators (every candidate starts with it). `scores` are the original's
    step scores, `candidate_scores` each candidate's weakest step (0.0 without steps).
    `original_correct` / `refined_correct` are None without an answer to check against."""

    original: str
    status: str
    scores: list[float]
    bad_step: int | None = None
    prefix: str | None = None
    refined: str | None = None
    refined_scores: list[float] | None = None
    candidates: list[str] = field(default_factory=list)
    candidate_scores: list[float] = field(default_factory=list)
    original_correct: bool | None = None
    refined_correct: bool | None = None


def first_bad_step(step_scores: Sequence[float], threshold: float) -> int | None:
    """Index of the first step whose P(good) is below `threshold`; None when none is."""
    return next((i for i, score in enumerate(step_scores) if score < threshold), None)


def refine(
    model,
    tokenizer,
    prm: StepScorer,
    task: Task,
    prompts: Sequence,
    completions: Sequence[str],
    *,
    threshold: float = 0.5,
    attempts: int = 4,
    max_new_tokens: int,
    temperature: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
    answers: Sequence | None = None,
) -> list[Refinement]:
    """One `Refinement` per (prompt, completion), in order (see the module docstring).

    Steps are the task's (`task.split_steps`, as MCTS), scored by `prm.score_steps`; the
    PRM's separator must be the task's. Every flagged solution's `attempts` continuations
    are sampled together at `temperature` (`sample`: `batch_size` counts sequences, up to
    `max_new_tokens` tokens each, after the prefix) and all candidates are scored in one
    call. A completion with no steps has nothing rated good (`score_completions` scores it
    0.0): it is regenerated from the prompt. `answers` (one per prompt, None where unknown)
    only fill in the correctness fields, for tasks that check answers."""
    if len(completions) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if answers is not None and len(answers) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    separator = task.step_separator
    prm_separator = getattr(prm, "separator", separator)
    if prm_separator != separator:
        raise ValueError(
            f"the PRM splits steps on {prm_separator!r} but the task on {separator!r}: "
            "refine with the PRM trained for this task"
        )

    steps = [task.split_steps(c) for c in completions]
    scored = [i for i, s in enumerate(steps) if s]
    step_scores: list[list[float]] = [[] for _ in completions]
    if scored:
        rows = prm.score_steps([prompts[i] for i in scored], [steps[i] for i in scored], batch_size)
        for i, row in zip(scored, rows):
            step_scores[i] = [float(s) for s in row]

    results = []
    for completion, row, own_steps in zip(completions, step_scores, steps):
        bad = first_bad_step(row, threshold) if own_steps else 0
        result = Refinement(original=completion, status=KEPT, scores=row, bad_step=bad)
        if bad is not None:
            result.status = UNREPAIRED
            result.prefix = join_continuation(own_steps[:bad], "", separator)
        results.append(result)

    flagged = [i for i, r in enumerate(results) if r.status != KEPT]
    if flagged:
        texts = [prefix_text(tokenizer, prompts[i], steps[i][: results[i].bad_step], separator) for i in flagged]
        groups = sample(model, tokenizer, texts, attempts, max_new_tokens, temperature, batch_size, seed, True)
        for i, group in zip(flagged, groups):
            results[i].candidates = [results[i].prefix + rest for rest in group]
        # Every candidate of every flagged solution, scored in one call.
        pending = [(i, j, task.split_steps(c)) for i in flagged for j, c in enumerate(results[i].candidates)]
        pending = [(i, j, s) for i, j, s in pending if s]
        candidate_rows = (
            prm.score_steps([prompts[i] for i, _, _ in pending], [s for *_, s in pending], batch_size)
            if pending
            else []
        )
        by_candidate = {(i, j): [float(x) for x in row] for (i, j, _), row in zip(pending, candidate_rows)}
        for i in flagged:
            result = results[i]
            rows = [by_candidate.get((i, j), []) for j in range(len(result.candidates))]
            result.candidate_scores = [aggregate(row, "min") if row else 0.0 for row in rows]
            best = max(range(len(rows)), key=lambda j: result.candidate_scores[j])
            if rows[best] and result.candidate_scores[best] >= threshold:
                result.status, result.refined, result.refined_scores = REPAIRED, result.candidates[best], rows[best]

    for result, (original_ok, refined_ok) in zip(results, _correctness(results, answers, task)):
        result.original_correct, result.refined_correct = original_ok, refined_ok
    return results


def repair_report(results: Sequence[Refinement], answers: Sequence | None = None, task: Task | None = None) -> dict:
    """Counts and shares over `results` (JSON-serialisable; a share with nothing to divide
    by is None).

    Always: samples, kept, flagged (the PRM found a bad step) and flagged_share, repaired,
    unrepaired and repaired_share_of_flagged. With correctness, from `answers` checked by
    `task` (one per result, None where unknown) or else as the results recorded it: checked
    (results with a known answer), wrong_samples (wrong originals), wrong_flagged,
    wrong_repaired (wrong originals whose refined solution is right) and
    share_of_wrong_repaired (of wrong_samples), false_repairs (repaired, yet the refined
    solution is wrong) and false_repair_share (of the checked repairs)."""
    count = len(results)
    statuses = [r.status for r in results]
    flagged = count - statuses.count(KEPT)
    repaired = statuses.count(REPAIRED)
    report: dict = {
        "samples": count,
        "kept": statuses.count(KEPT),
        "flagged": flagged,
        "flagged_share": _share(flagged, count),
        "repaired": repaired,
        "unrepaired": statuses.count(UNREPAIRED),
        "repaired_share_of_flagged": _share(repaired, flagged),
    }
    if answers is None:
        correctness = [(r.original_correct, r.refined_correct) for r in results]
    else:
        if task is None:
            raise ValueError("repair_report with answers needs the task that checks them")
        if len(answers) != count:
            raise ValueError(f"{count} results but {len(answers)} answers")
        correctness = _correctness(results, answers, task)
    checked = [(r, refined_ok) for r, (ok, refined_ok) in zip(results, correctness) if ok is not None]
    if not checked:
        return report
    wrong = [(r, refined_ok) for r, (ok, refined_ok) in zip(results, correctness) if ok is False]
    wrong_repaired = sum(r.status == REPAIRED and bool(refined_ok) for r, refined_ok in wrong)
    checked_repairs = [refined_ok for r, refined_ok in checked if r.status == REPAIRED]
    false_repairs = sum(refined_ok is False for refined_ok in checked_repairs)
    report.update(
        checked=len(checked),
        wrong_samples=len(wrong),
        wrong_flagged=sum(r.status != KEPT for r, _ in wrong),
        wrong_repaired=wrong_repaired,
        share_of_wrong_repaired=_share(wrong_repaired, len(wrong)),
        false_repairs=false_repairs,
        false_repair_share=_share(false_repairs, len(checked_repairs)),
    )
    return report


def _correctness(
    results: Sequence[Refinement], answers: Sequence | None, task: Task | None
) -> list[tuple[bool | None, bool | None]]:
    """(original right, refined right) per result; None where there is no answer to check
    against, the task checks none, or (refined) nothing was refined."""
    if answers is None or task is None or not task.checks_answers:
        return [(None, None)] * len(results)
    pairs = []
    for result, answer in zip(results, answers):
        if answer is None:
            pairs.append((None, None))
            continue
        refined_ok = None if result.refined is None else bool(task.is_correct(result.refined, answer))
        pairs.append((bool(task.is_correct(result.original, answer)), refined_ok))
    return pairs


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None
