"""Step labels for a process reward model, derived by Monte-Carlo rollouts (Math-Shepherd).

Exact step labels exist only where a task can check steps (the built-in task's
`check_steps`). Any task whose final answers can be checked gets them this way instead,
following Math-Shepherd (Wang et al., 2024, "Math-Shepherd: Verify and Reinforce LLMs
Step-by-step without Human Annotations"): sample solutions, and for every step of a
solution complete the prefix ending at that step N times with the policy. The quality of
step i is how often its prefix still reaches the right answer:

    value(s_i) = (1/N) * #{ j : rollout j from (prompt, s_1..s_i) reaches the answer }
    hard:  good(s_i) = value(s_i) > 0          (at least one rollout reaches it)
    soft:  good(s_i) = value(s_i) >= threshold  (the paper keeps the fraction itself)

Rows come out in the PRM data contract (`rlhf.data.contracts.CONTRACTS["prm"]`): prompt,
completions (the steps), labels (one bool per step).

Departures from the paper:

* The last step of a solution, and any step the task calls final (`is_final_step`), is
  labelled by checking the solution up to it: nothing is left to roll out.
* Soft estimation is thresholded, because the contract's labels are bools.
* Steps after a step estimated bad are still estimated, each from its own rollouts (as the
  paper does), not forced to bad as the built-in task's exact labels are. A step after a
  mistake is labelled good when the policy recovers from the mistake in a rollout, which is
  also how hard estimation errs: a rollout that ignores a wrong prefix and states the right
  answer anyway makes the step look good. Where a wrong step makes the answer wrong, later
  rollouts fail and the labels stay bad on their own.
* Identical prefixes (solutions of one prompt often share their first steps) are rolled out
  once and share their rollouts; duplicate solutions are kept as rows.
* A rollout may write up to `max_new_tokens` tokens whatever the prefix's length.

Cost: generation dominates. One round samples prompts x samples_per_prompt solutions, a
second rolls out every distinct non-final prefix, at most prompts x samples_per_prompt x
(steps - 1) x rollouts sequences of up to max_new_tokens tokens: 4,000 prompts, 4 samples,
4 steps and 4 rollouts is up to 192,000 sequences (`stats["generations"]` counts them).

The labelling is kept apart from the model: `derive_labels` and `label_steps` take a
`complete(prefixes, n)` callable, the rollout policy, and `model_completer` builds that
callable from a causal LM with `rlhf.models.generation.generate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

from rlhf.tasks.base import Task

# complete(prefixes, n): n continuations of each prefix text, one list per prefix, in order.
Completer = Callable[[list[str], int], list[list[str]]]
ESTIMATES = ("hard", "soft")


class DerivedLabels(NamedTuple):
    rows: list[dict]  # prompt, completions (steps), labels (one bool per step)
    stats: dict


def derive_step_labels(
    model,
    tokenizer,
    task: Task,
    prompts: Sequence,
    answers: Sequence,
    *,
    samples_per_prompt: int = 4,
    rollouts: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 0.7,
    batch_size: int = 64,
    seed: int = 0,
    estimate: str = "hard",
    threshold: float = 0.5,
) -> DerivedLabels:
    """PRM rows for `prompts` (text or chat messages) whose reference `answers` are given,
    from the model's own sampled solutions labelled by its rollouts. Prompts without an
    answer are left out (counted in the stats). Deterministic given `seed`."""
    from rlhf.models.generation import format_prompt

    complete = model_completer(model, tokenizer, max_new_tokens, temperature, batch_size, seed)
    return derive_labels(
        task,
        prompts,
        answers,
        complete,
        samples_per_prompt=samples_per_prompt,
        rollouts=rollouts,
        estimate=estimate,
        threshold=threshold,
        render=partial(format_prompt, tokenizer),
    )


def model_completer(
    model, tokenizer, max_new_tokens: int, temperature: float, batch_size: int = 64, seed: int = 0
) -> Completer:
    """The rollout policy of a causal LM: sampled continuations of prefix texts. Each call
    reseeds from `seed` and how many calls came before it, so a fixed sequence of calls
    gives the same texts. `batch_size` counts sequences, not prefixes."""
    from rlhf.models.generation import sample

    calls = 0

    def complete(prefixes: list[str], n: int) -> list[list[str]]:
        nonlocal calls
        calls += 1
        if not prefixes:
            return []
        # Prefixes arrive rendered (`derive_labels`' render, plus steps): continued as they are.
        return sample(model, tokenizer, prefixes, n, max_new_tokens, temperature, batch_size, seed + calls - 1, True)

    return complete


def derive_labels(
    task: Task,
    prompts: Sequence,
    answers: Sequence,
    complete: Completer,
    *,
    samples_per_prompt: int = 4,
    rollouts: int = 4,
    estimate: str = "hard",
    threshold: float = 0.5,
    render: Callable | None = None,
) -> DerivedLabels:
    """Sample `samples_per_prompt` solutions of each answered prompt with `complete`, then
    label their steps (`label_steps`). `render` turns a prompt into the text the policy
    continues (the chat template for conversational prompts); by default text prompts are
    used as they are."""
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be at least 1, got {samples_per_prompt}")
    # Checked before the sampling round, not after it.
    _check_settings(task, prompts, answers, rollouts, estimate, threshold)
    render = render or _render_text
    answered = [i for i, answer in enumerate(answers) if _has_answer(answer)]
    texts = [render(_normalize(task, prompts[i])) for i in answered]
    sampled = _complete_checked(complete, texts, samples_per_prompt)
    solutions: list[list[str]] = [[] for _ in prompts]
    for i, samples in zip(answered, sampled):
        solutions[i] = samples
    result = label_steps(
        task,
        prompts,
        answers,
        solutions,
        complete,
        rollouts=rollouts,
        estimate=estimate,
        threshold=threshold,
        render=render,
    )
    result.stats["generations"] += len(texts) * samples_per_prompt
    return result


def label_steps(
    task: Task,
    prompts: Sequence,
    answers: Sequence,
    solutions: Sequence[Sequence[str]],
    complete: Completer,
    *,
    rollouts: int = 4,
    estimate: str = "hard",
    threshold: float = 0.5,
    render: Callable | None = None,
) -> DerivedLabels:
    """Math-Shepherd labels for given solutions (`solutions[i]`: the completions of
    `prompts[i]`), every non-final prefix rolled out `rollouts` times in one `complete`
    call. Prompts without an answer and solutions without steps give no rows."""
    _check_settings(task, prompts, answers, rollouts, estimate, threshold)
    if len(solutions) != len(prompts):
        raise ValueError(f"got {len(solutions)} lists of solutions for {len(prompts)} prompts; give one per prompt")
    render = render or _render_text
    separator = task.step_separator

    # (prompt, answer, steps, prefix text of each step or None where the step is judged directly)
    pending: list[tuple] = []
    stats = {"prompts": len(prompts), "prompts_without_answer": 0, "solutions": 0, "solutions_without_steps": 0}
    for prompt, answer, samples in zip(prompts, answers, solutions):
        if not _has_answer(answer):
            stats["prompts_without_answer"] += 1
            continue
        prompt = _normalize(task, prompt)
        text = render(prompt)
        for solution in samples:
            stats["solutions"] += 1
            steps = task.split_steps(solution)
            if not steps:
                stats["solutions_without_steps"] += 1
                continue
            prefixes = [
                None
                if k == len(steps) - 1 or task.is_final_step(step)
                else text + task.join_steps(steps[: k + 1]) + separator
                for k, step in enumerate(steps)
            ]
            pending.append((prompt, answer, steps, prefixes))

    distinct = list(dict.fromkeys(p for *_, prefixes in pending for p in prefixes if p is not None))
    continuations = dict(zip(distinct, _complete_checked(complete, distinct, rollouts)))

    rows = []
    for prompt, answer, steps, prefixes in pending:
        labels = []
        for k, prefix in enumerate(prefixes):
            so_far = task.join_steps(steps[: k + 1])
            if prefix is None:
                labels.append(bool(task.is_correct(so_far, answer)))
                continue
            value = sum(task.is_correct(so_far + separator + c, answer) for c in continuations[prefix]) / rollouts
            labels.append(value > 0 if estimate == "hard" else value >= threshold)
        rows.append({"prompt": prompt, "completions": list(steps), "labels": labels})

    steps_total = sum(len(row["labels"]) for row in rows)
    # The last step is judged by checking the whole solution: its label says if it is right.
    correct = sum(row["labels"][-1] for row in rows)
    stats.update(
        rows=len(rows),
        steps=steps_total,
        good_step_share=sum(sum(row["labels"]) for row in rows) / steps_total if steps_total else 0.0,
        correct_solutions=correct,
        correct_solution_share=correct / len(rows) if rows else 0.0,
        rollout_prefixes=len(distinct),
        generations=len(distinct) * rollouts,
    )
    return DerivedLabels(rows, stats)


# ----------------------------------------------------------------------------- helpers


def _check_settings(
    task: Task, prompts: Sequence, answers: Sequence, rollouts: int, estimate: str, threshold: float
) -> None:
    if not getattr(task, "checks_answers", True):
        raise ValueError(
            f"task {task.name!r} cannot check answers, so rollouts cannot label steps; choose a task that can"
        )
    if rollouts < 1:
        raise ValueError(f"rollouts must be at least 1, got {rollouts}")
    if estimate not in ESTIMATES:
        raise ValueError(f"unknown estimate {estimate!r}; expected one of {ESTIMATES}")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if len(prompts) != len(answers):
        raise ValueError(f"got {len(prompts)} prompts and {len(answers)} answers; give one answer per prompt")
    # A reference the task cannot read would fail only after the generation is spent.
    reference = getattr(task, "reference_answer", None)
    problems = []
    for row, answer in enumerate(answers, start=1):
        if reference is not None and _has_answer(answer):
            try:
                reference(answer)
            except ValueError as error:
                problems.append(f"row {row}: answer {answer!r}: {error}")
    if problems:
        raise ValueError(f"{len(problems)} answer(s) the task {task.name!r} cannot check:\n  " + "\n  ".join(problems))


def _has_answer(answer) -> bool:
    if answer is None or (isinstance(answer, float) and math.isnan(answer)):
        return False
    return bool(str(answer).strip())


def _normalize(task: Task, prompt):
    return task.normalize_prompt(prompt) if isinstance(prompt, str) else prompt


def _render_text(prompt) -> str:
    if not isinstance(prompt, str):
        raise TypeError("a conversational prompt needs `render` (e.g. the chat template: format_prompt)")
    return prompt


def _complete_checked(complete: Completer, prefixes: list[str], n: int) -> list[list[str]]:
    if not prefixes:
        return []
    out = complete(prefixes, n)
    if len(out) != len(prefixes) or any(len(texts) != n for texts in out):
        raise ValueError(f"the completer must return {n} continuations for each of {len(prefixes)} prefixes")
    return out
