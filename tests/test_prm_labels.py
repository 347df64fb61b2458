"""Math-Shepherd step labels by rollouts (rlhf.rewards.prm_labels).

The labelling logic runs against `oracle`, a rollout policy written out in plain Python
for the built-in task: from a prefix whose steps are all right it writes the right rest of
the solution, from any other prefix a wrong answer. Under that policy the derived labels
must be exactly the task's own step labels (`check_steps`). The model-backed path runs on
the untrained tiny built-in model: it checks the plumbing (contract, one label per step,
rollout prefixes, determinism), not label quality.
"""

from __future__ import annotations

import random

import pandas as pd
import pytest

from rlhf.data.contracts import validate_contract
from rlhf.rewards.prm_labels import derive_labels, derive_step_labels, label_steps, model_completer
from rlhf.tasks.arithmetic import (
    STEP_SEPARATOR,
    ArithmeticTask,
    TaskSpec,
    check_steps,
    flawed_solution,
    format_solution,
    parse_prompt,
    sample_problem,
    split_steps,
)
from rlhf.tasks.base import Task

TASK = ArithmeticTask()
PROMPT = "23+58-17\n"  # answer 64
ANSWER = "64"
SECOND_STEP_WRONG = "23+58=81; 81-17=65; answer 65"


def right_rest(prefix: str) -> tuple[str, bool]:
    """The right rest of the solution after `prefix` (a prompt line, then steps each
    followed by the separator), and whether every step of the prefix is right."""
    prompt, partial = prefix.split("\n", 1)
    prompt += "\n"
    steps = split_steps(partial.removesuffix(STEP_SEPARATOR))
    problem = parse_prompt(prompt)
    rest = format_solution(problem.steps()[len(steps) :], problem.answer)
    return rest, all(check_steps(prompt, partial.removesuffix(STEP_SEPARATOR)))


def oracle(solutions: dict[str, list[str]], recovers: bool = False, hits: int | None = None):
    """A rollout policy: for a bare prompt, its given `solutions`; from a prefix with only
    right steps, the right rest (in the first `hits` of the n rollouts; in all by default);
    otherwise a wrong answer, or with `recovers` the right one anyway. Records its calls."""

    def complete(prefixes: list[str], n: int) -> list[list[str]]:
        complete.calls.append((list(prefixes), n))
        out = []
        for prefix in prefixes:
            if prefix in solutions:
                out.append(list(solutions[prefix]))
                continue
            rest, on_track = right_rest(prefix)
            good = n if hits is None else hits
            out.append([rest if (on_track or recovers) and j < good else "answer -1" for j in range(n)])
        return out

    complete.calls = []
    return complete


def test_a_wrong_second_step_and_what_follows_are_bad():
    complete = oracle({PROMPT: [SECOND_STEP_WRONG]})
    result = derive_labels(TASK, [PROMPT], [ANSWER], complete, samples_per_prompt=1, rollouts=4)
    assert result.rows == [
        {"prompt": PROMPT, "completions": ["23+58=81", "81-17=65", "answer 65"], "labels": [True, False, False]}
    ]
    # One sampling call, then one call with both non-final prefixes; the final step is never rolled out.
    assert complete.calls == [([PROMPT], 1), ([PROMPT + "23+58=81; ", PROMPT + "23+58=81; 81-17=65; "], 4)]
    assert result.stats["generations"] == 1 + 2 * 4
    assert result.stats["correct_solutions"] == 0 and result.stats["good_step_share"] == pytest.approx(1 / 3)


def test_labels_under_the_oracle_policy_are_the_exact_labels():
    rng = random.Random(0)
    prompts, answers, solutions = [], [], []
    for _ in range(12):
        problem = sample_problem(rng, TaskSpec())
        prompts.append(problem.prompt)
        answers.append(problem.answer)
        solutions.append(
            [
                problem.solution(),
                *(flawed_solution(problem, rng, kind)[0] for kind in ("slip", "copy", "skip", "answer")),
            ]
        )
    result = label_steps(TASK, prompts, answers, solutions, oracle({}), rollouts=2)
    assert len(result.rows) == 12 * 5
    for row in result.rows:
        assert row["labels"] == check_steps(row["prompt"], STEP_SEPARATOR.join(row["completions"]))
    assert result.stats["correct_solutions"] == 12
    assert 0.0 < result.stats["good_step_share"] < 1.0


def test_steps_after_a_mistake_are_estimated_not_forced():
    """A policy that reaches the right answer from any prefix makes every non-final step look
    good, the mistake too: labels are estimated per step, with hard estimation's blind spot."""
    result = label_steps(TASK, [PROMPT], [ANSWER], [[SECOND_STEP_WRONG]], oracle({}, recovers=True), rollouts=2)
    assert result.rows[0]["labels"] == [True, True, False]


def test_the_final_step_is_judged_by_the_answer_not_by_rollouts():
    """Every step right but the stated answer: rollouts from any prefix would succeed, the
    final step is bad because the solution is wrong, and it is never rolled out."""
    complete = oracle({}, recovers=True)
    result = label_steps(TASK, [PROMPT], [ANSWER], [["23+58=81; 81-17=64; answer 65"]], complete, rollouts=2)
    assert result.rows[0]["labels"] == [True, True, False]
    assert all("answer" not in prefix for prefixes, _ in complete.calls for prefix in prefixes)
    right = label_steps(TASK, [PROMPT], [ANSWER], [["23+58=81; 81-17=64; answer 64"]], oracle({}), rollouts=2)
    assert right.rows[0]["labels"] == [True, True, True] and right.stats["correct_solutions"] == 1


def test_hard_and_soft_estimation():
    """One of four rollouts from a right prefix reaches the answer: value 1/4 per step.
    Hard (value > 0): good. Soft at threshold 0.5: bad; at 0.25: good."""
    solution = [["23+58=81; 81-17=64; answer 64"]]

    def labels(**kwargs):
        result = label_steps(TASK, [PROMPT], [ANSWER], solution, oracle({}, hits=1), rollouts=4, **kwargs)
        return result.rows[0]["labels"]

    assert labels(estimate="hard") == [True, True, True]
    assert labels(estimate="soft", threshold=0.5) == [False, False, True]
    assert labels(estimate="soft", threshold=0.25) == [True, True, True]
    complete = oracle({})
    with pytest.raises(ValueError, match="unknown estimate"):
        derive_labels(TASK, [PROMPT], [ANSWER], complete, estimate="medium")
    assert complete.calls == []  # refused before any generation


def test_prompts_without_answers_and_solutions_without_steps_are_skipped():
    other = "1+2+3\n"
    complete = oracle({PROMPT: ["23+58=81; 81-17=64; answer 64", "  "]})  # knows no solution of `other`
    result = derive_labels(
        TASK,
        [other, PROMPT, other, other],
        [None, ANSWER, float("nan"), " "],
        complete,
        samples_per_prompt=2,
        rollouts=1,
    )
    assert [row["prompt"] for row in result.rows] == [PROMPT]
    stats = result.stats
    assert (stats["prompts"], stats["prompts_without_answer"]) == (4, 3)
    assert (stats["solutions"], stats["solutions_without_steps"], stats["rows"], stats["steps"]) == (2, 1, 1, 3)
    assert complete.calls[0] == ([PROMPT], 2)


def test_tasks_and_answers_that_cannot_be_checked_are_refused_before_generation():
    class Unchecked(Task):
        checks_answers = False

    class Numeric(Task):
        def reference_answer(self, answer) -> str:
            if not str(answer).strip().lstrip("-").isdigit():
                raise ValueError("not a number")
            return str(answer).strip()

    complete = oracle({})
    with pytest.raises(ValueError, match="cannot check answers"):
        derive_labels(Unchecked(), [PROMPT], [ANSWER], complete)
    with pytest.raises(ValueError, match=r"row 2: answer 'sixty-four': not a number"):
        derive_labels(Numeric(), [PROMPT, PROMPT], [ANSWER, "sixty-four"], complete)
    assert complete.calls == []


def test_identical_prefixes_are_rolled_out_once():
    complete = oracle({PROMPT: [SECOND_STEP_WRONG, SECOND_STEP_WRONG]})
    result = derive_labels(TASK, [PROMPT], [ANSWER], complete, samples_per_prompt=2, rollouts=3)
    assert len(result.rows) == 2 and result.rows[0] == result.rows[1]
    assert len(complete.calls[1][0]) == 2 and result.stats["generations"] == 2 + 2 * 3


def test_a_conversational_prompt_is_rolled_out_from_its_rendered_text():
    messages = [{"role": "user", "content": "23+58-17"}]
    render = lambda prompt: prompt[0]["content"] + "\n"  # noqa: E731 (a stand-in chat template)
    complete = oracle({PROMPT: [SECOND_STEP_WRONG]})
    result = derive_labels(TASK, [messages], [ANSWER], complete, samples_per_prompt=1, rollouts=2, render=render)
    assert result.rows[0]["prompt"] == messages and result.rows[0]["labels"] == [True, False, False]
    with pytest.raises(TypeError, match="render"):
        derive_labels(TASK, [messages], [ANSWER], complete, samples_per_prompt=1)


# ----------------------------------------------------------------------------- a real model


@pytest.fixture(scope="module")
def tiny():
    from rlhf.models.loading import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    return build_tiny_model("tiny", tokenizer, seed=0), tokenizer


def test_derive_step_labels_with_a_tiny_model_gives_prm_rows(tiny):
    model, tokenizer = tiny
    rng = random.Random(1)
    problems = [sample_problem(rng, TaskSpec()) for _ in range(4)]
    prompts, answers = [p.prompt for p in problems], [str(p.answer) for p in problems]
    settings = dict(samples_per_prompt=2, rollouts=2, max_new_tokens=32, seed=3)
    result = derive_step_labels(model, tokenizer, TASK, prompts, answers, **settings)
    assert result.rows and result.stats["solutions"] == 8
    assert result.stats["rows"] + result.stats["solutions_without_steps"] == 8
    frame = validate_contract(pd.DataFrame(result.rows), "prm", "derived")
    assert all(len(steps) == len(labels) for steps, labels in zip(frame["completions"], frame["labels"]))


class Chunks(Task):
    """Steps of 8 characters, joined with nothing: the untrained model's text has several."""

    step_separator = ""

    def split_steps(self, completion: str) -> list[str]:
        text = completion.strip()
        return [text[i : i + 8] for i in range(0, len(text), 8)]


def test_derive_step_labels_rolls_out_with_the_model_and_is_deterministic(tiny):
    model, tokenizer = tiny
    prompts, answers = ["12+7\n", "3+4-1\n"], ["19", "6"]
    settings = dict(samples_per_prompt=2, rollouts=2, max_new_tokens=24, seed=5)
    result = derive_step_labels(model, tokenizer, Chunks(), prompts, answers, **settings)
    stats = result.stats
    assert stats["rows"] == 4 and stats["steps"] > 4 and stats["rollout_prefixes"] == stats["steps"] - 4
    assert stats["generations"] == 4 + 2 * stats["rollout_prefixes"]
    assert derive_step_labels(model, tokenizer, Chunks(), prompts, answers, **settings) == result
    other = derive_step_labels(model, tokenizer, Chunks(), prompts, answers, **{**settings, "seed": 6})
    assert other.rows != result.rows


def test_the_model_completer_rolls_out_every_non_final_prefix(tiny):
    """Given solutions (right and flawed), every non-final step's prefix is completed twice
    by the model; final steps get the exact label of the answer."""
    model, tokenizer = tiny
    rng = random.Random(2)
    problems = [sample_problem(rng, TaskSpec()) for _ in range(2)]
    solutions = [[p.solution(), flawed_solution(p, rng, "slip")[0]] for p in problems]
    model_complete = model_completer(model, tokenizer, max_new_tokens=16, temperature=1.0, seed=0)
    seen = []

    def complete(prefixes, n):
        texts = model_complete(prefixes, n)
        seen.extend(zip(prefixes, texts))
        return texts

    prompts, answers = [p.prompt for p in problems], [p.answer for p in problems]
    result = label_steps(TASK, prompts, answers, solutions, complete, rollouts=2)
    expected = {
        p.prompt + "".join(step + STEP_SEPARATOR for step in split_steps(s)[: k + 1])
        for p, pair in zip(problems, solutions)
        for s in pair
        for k in range(len(split_steps(s)) - 1)
    }
    assert {prefix for prefix, _ in seen} == expected and all(len(texts) == 2 for _, texts in seen)
    for row in result.rows:
        assert row["labels"][-1] == check_steps(row["prompt"], STEP_SEPARATOR.join(row["completions"]))[-1]
