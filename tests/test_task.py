"""The built-in task (rlhf.tasks.arithmetic): problems, checkers, flawed solutions and the
generator; and the Task interface (rlhf.tasks.base) with its plain-text defaults and the
built-in task behind it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from rlhf.tasks import TASKS, TaskConfig, get_task
from rlhf.tasks.arithmetic import (
    FLAW_KINDS,
    ArithmeticTask,
    Problem,
    TaskSizes,
    TaskSpec,
    check_steps,
    extract_answer,
    flawed_solution,
    generate_datasets,
    is_correct,
    is_well_formatted,
    operand_count,
    parse_prompt,
    sample_problem,
    split_steps,
)
from rlhf.tasks.base import Task, normalize_text

SPEC = TaskSpec(min_operands=3, max_operands=4, max_value=39)  # the difficulty in params.yaml
SIZES = TaskSizes(
    sft=200, prefs=60, prefs_eval=30, unpaired=60, prm=60, prm_eval=30, prompts=40, eval_dev=30, eval_test=20
)
EVAL_SUITES = ("eval_dev", "eval_test")
EVAL_SPLITS = (*EVAL_SUITES, "prefs_eval", "prm_eval")
TRAIN_SPLITS = ("sft", "prefs", "unpaired", "prm", "prompts")
EXAMPLE = Problem(operands=(23, 58, 17), ops=("+", "-"))
EXAMPLE_SOLUTION = "23+58=81; 81-17=64; answer 64"


@pytest.fixture(scope="module")
def datasets() -> dict[str, list[dict]]:
    return generate_datasets(SPEC, SIZES, seed=7)


def problems(count: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng, SPEC) for _ in range(count)]


# ----------------------------------------------------------------------------- Problem


def test_problem_prompt_solution_answer():
    """23+58-17: 23+58 = 81, then 81-17 = 64. The prompt is the expression and a newline;
    the solution writes both steps and then `answer 64`."""
    assert EXAMPLE.expression == "23+58-17"
    assert EXAMPLE.prompt == "23+58-17\n"
    assert EXAMPLE.steps() == ["23+58=81", "81-17=64"]
    assert EXAMPLE.answer == 64
    assert EXAMPLE.solution() == EXAMPLE_SOLUTION


def test_problem_with_four_operands():
    """5-5+12-3: 5-5 = 0, 0+12 = 12, 12-3 = 9 (a zero intermediate is written as 0)."""
    problem = Problem((5, 5, 12, 3), ("-", "+", "-"))
    assert problem.prompt == "5-5+12-3\n"
    assert problem.solution() == "5-5=0; 0+12=12; 12-3=9; answer 9"
    assert problem.answer == 9


def test_sample_problem_respects_spec_and_never_goes_negative():
    """Every sampled chain has 3..4 operands in 1..39, and its running value stays >= 0
    (a subtraction is only drawn when the running value is at least the right operand)."""
    for problem in problems(500, seed=3):
        assert 3 <= len(problem.operands) <= 4
        assert len(problem.ops) == len(problem.operands) - 1
        assert all(1 <= value <= 39 for value in problem.operands)
        value = problem.operands[0]
        for op, right in zip(problem.ops, problem.operands[1:]):
            value = value + right if op == "+" else value - right
            assert value >= 0, problem


# ----------------------------------------------------------------------------- checkers


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("23+58=81; 81-17=64; answer 64", 64),
        ("answer -5", -5),  # a negative answer keeps its sign
        ("answer 12; answer 13", 12),  # the first `answer` counts
        ("answer 640", 640),
        ("the answer is 64", None),  # `answer` must be followed directly by the number
        ("23+58=81; 81-17=64", None),  # no answer at all
        ("", None),
    ],
)
def test_extract_answer(completion, expected):
    """The integer right after the first `answer `, else None."""
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        (EXAMPLE_SOLUTION, 64, True),
        (EXAMPLE_SOLUTION, "64", True),
        (EXAMPLE_SOLUTION, " 64 ", True),  # the reference is stripped
        (EXAMPLE_SOLUTION, 65, False),
        ("answer 640", 64, False),  # 640 is a different number, not a prefix match
        ("answer -3", -3, True),
        ("answer -3", 3, False),
        ("23+58=81; 81-17=64", 64, False),  # 64 appears, but no answer is stated
        ("so the answer: Paris", "paris", True),  # user suite: text after `answer`, any case
        ("the ANSWER Paris  ", "Paris", True),
        ("I think it is\nParis", "paris", True),  # no `answer`: the last line is compared
        ("the answer: Lyon", "Paris", False),
        ("the answer: Paris, France", "Paris", False),  # the whole rest of the line must match
        ("", "Paris", False),
    ],
)
def test_is_correct(completion, reference, expected):
    """Integer references compare the number after `answer`; other references compare the
    text after `answer` (or the last line) case-insensitively."""
    assert is_correct(completion, reference) is expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (EXAMPLE_SOLUTION, True),
        ("  " + EXAMPLE_SOLUTION + "\n", True),  # surrounding space is ignored
        ("23+58=81; answer -4", True),  # a negative answer is allowed
        ("23+58=81;81-17=64; answer 64", False),  # separator must be '; '
        ("answer 64", True),  # the answer alone (a shortcut) is a valid shape
        ("answer", False),
        (EXAMPLE_SOLUTION + " extra", False),
        ("23 + 58 = 81; answer 81", False),
        ("23+58=81; 81-17=64; answer: 64", False),
        ("23+58=81\n81-17=64\nanswer 64", False),
        ("23+58=81; 81-17=64", False),  # no answer
        ("", False),
    ],
)
def test_is_well_formatted(completion, expected):
    assert is_well_formatted(completion) is expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        # 23+58=81 and 81-17=64 are right, and 64 is the answer.
        (EXAMPLE_SOLUTION, [True, True, True]),
        # Arithmetic slip in step 1 (23+58 is 81, not 80): it and everything after are bad,
        # even though 80-17=63 is itself right arithmetic.
        ("23+58=80; 80-17=63; answer 63", [False, False, False]),
        # Steps right, stated answer 65 is not the last result 64.
        ("23+58=81; 81-17=64; answer 65", [True, True, False]),
        # Step 2 starts from 80 instead of the previous result 81.
        ("23+58=81; 80-17=63; answer 63", [True, False, False]),
        # Step 2 applies +17 where the problem says -17.
        ("23+58=81; 81+17=98; answer 98", [True, False, False]),
        # The -17 is skipped: the answer comes one step early.
        ("23+58=81; answer 81", [True, False]),
        # An extra operation beyond the problem.
        ("23+58=81; 81-17=64; 64+1=65; answer 65", [True, True, False, False]),
        # Right answer after a wrong step is still bad (Math-Shepherd: the first bad step
        # makes every later one bad).
        ("23+58=80; 81-17=64; answer 64", [False, False, False]),
        # The answer alone: good when it is the answer.
        ("answer 64", [True]),
        ("answer 65", [False]),
        # Malformed text is one bad step; an empty completion has no steps.
        ("hello", [False]),
        ("23+58 is 81; answer 64", [False, False]),
        ("", []),
    ],
)
def test_check_steps(completion, expected):
    assert check_steps(EXAMPLE.prompt, completion) == expected


def test_split_steps():
    assert split_steps(EXAMPLE_SOLUTION) == ["23+58=81", "81-17=64", "answer 64"]
    assert split_steps("  answer 3\n") == ["answer 3"]
    assert split_steps("") == []


def test_parse_prompt_round_trips():
    assert parse_prompt("23+58-17\n") == EXAMPLE
    assert parse_prompt("5-5+12-3") == Problem((5, 5, 12, 3), ("-", "+", "-"))
    assert parse_prompt(" 7 + 8\n") == Problem((7, 8), ("+",))
    for problem in problems(50, seed=11):
        assert parse_prompt(problem.prompt) == problem


@pytest.mark.parametrize(
    "junk",
    ["", "hello", "12", "12+", "+12", "1 2 3", "1+2=3", "1*2+3", "what is 1+2?", "1+-2", "1++2", "a1+b2"],
)
def test_parse_prompt_rejects_junk(junk):
    """Only `N(+|-)N...` is a task prompt; `1 2 3` used to parse as operands (1, 3) with
    the 'operator' '2'."""
    with pytest.raises(ValueError, match="not a built-in task prompt"):
        parse_prompt(junk)


def test_check_steps_rejects_a_junk_prompt():
    with pytest.raises(ValueError, match="not a built-in task prompt"):
        check_steps("tell me a joke\n", "answer 1")


# ----------------------------------------------------------------------------- flaws


@pytest.mark.parametrize("kind", FLAW_KINDS)
def test_flawed_solution_labels_are_math_shepherd_labels(kind):
    """For every flaw kind, on 300 random problems: the labels the generator writes are
    what the independent checker `check_steps` finds, one per step (answer included), at
    least the last is False, and the stated answer is wrong."""
    rng = random.Random(kind)
    for problem in problems(300, seed=len(kind)):
        text, labels = flawed_solution(problem, rng, kind)
        assert labels == check_steps(problem.prompt, text), (problem, kind, text)
        assert len(labels) == len(split_steps(text))
        assert labels[-1] is False
        assert not is_correct(text, problem.answer), (problem, kind, text)
        assert extract_answer(text) is not None


@pytest.mark.parametrize("seed", range(12))
def test_skip_in_a_run_of_identical_operations(seed):
    """5+3+3 has pairs (+3, +3). Dropping either gives the same chain `5+3=8; answer 8`.
    Step 1 (5+3=8) is what the problem asks first, so it is good; the answer 8 comes one
    step early (the right answer is 11), so it is bad: labels [True, False], whichever of
    the two operations the generator picked. (Regression: the generator said [False, False]
    when it dropped the first +3.)"""
    problem = Problem((5, 3, 3), ("+", "+"))
    text, labels = flawed_solution(problem, random.Random(seed), "skip")
    assert text == "5+3=8; answer 8"
    assert labels == [True, False]


def test_answer_flaw_on_the_example():
    """`answer` keeps both right steps (labels True, True) and states 64 + d for d in
    {-10, -1, 1, 10}: 54, 63, 65 or 74, labelled False."""
    text, labels = flawed_solution(EXAMPLE, random.Random(0), "answer")
    assert text.startswith("23+58=81; 81-17=64; answer ")
    assert extract_answer(text) in {54, 63, 65, 74}
    assert labels == [True, True, False]


def test_unknown_flaw_kind():
    with pytest.raises(ValueError, match="unknown flaw kind 'typo'"):
        flawed_solution(EXAMPLE, random.Random(0), "typo")


# ----------------------------------------------------------------------------- datasets


def test_generate_datasets_is_deterministic_per_seed(datasets):
    assert generate_datasets(SPEC, SIZES, seed=7) == datasets
    other = generate_datasets(SPEC, SIZES, seed=8)
    assert other["sft"] != datasets["sft"]
    assert other["eval_dev"] != datasets["eval_dev"] and other["eval_test"] != datasets["eval_test"]


def test_generate_datasets_sizes(datasets):
    assert set(datasets) == set(TRAIN_SPLITS) | set(EVAL_SPLITS)
    for name, rows in datasets.items():
        assert len(rows) == getattr(SIZES, name), name


def test_eval_prompts_never_appear_in_training(datasets):
    """No held-out prompt is in any training split, and no prompt repeats anywhere."""
    eval_prompts = {row["prompt"] for name in EVAL_SPLITS for row in datasets[name]}
    for name in TRAIN_SPLITS:
        train_prompts = {row["prompt"] for row in datasets[name]}
        assert not eval_prompts & train_prompts, name
    every = [row["prompt"] for rows in datasets.values() for row in rows]
    assert len(every) == len(set(every))


def test_problem_shortcut_solution():
    assert EXAMPLE.shortcut_solution() == "answer 64"
    assert is_correct(EXAMPLE.shortcut_solution(), 64) and all(check_steps(EXAMPLE.prompt, "answer 64"))


def test_short_problems_sometimes_skip_the_working_in_sft_only():
    """With shortcut_rate 0.75 and shortcut_max_operands 3, about 3/4 of the 3-operand SFT
    demonstrations are the answer alone (binomial, 400-ish rows: well inside 0.6-0.9); no
    4-operand one is, and no other split has any."""
    spec = TaskSpec(min_operands=3, max_operands=4, max_value=39, shortcut_rate=0.75, shortcut_max_operands=3)
    data = generate_datasets(spec, TaskSizes(sft=800, prefs=40, unpaired=40, prm=40, prompts=0), seed=3)
    short = [r["completion"] for r in data["sft"] if len(parse_prompt(r["prompt"]).operands) == 3]
    long = [r["completion"] for r in data["sft"] if len(parse_prompt(r["prompt"]).operands) == 4]
    rate = sum(c.startswith("answer") for c in short) / len(short)
    assert 0.6 < rate < 0.9 and len(short) > 300
    assert not any(c.startswith("answer") for c in long)
    for row in data["sft"]:
        assert is_correct(row["completion"], parse_prompt(row["prompt"]).answer)
    assert all(len(split_steps(r["chosen"])) > 1 for r in data["prefs"])
    assert all(len(split_steps(r["completion"])) > 1 for r in data["unpaired"])
    assert all(len(r["completions"]) > 1 for r in data["prm"])
    none = generate_datasets(
        TaskSpec(shortcut_rate=0.0), TaskSizes(sft=100, prefs=0, unpaired=0, prm=0, prompts=0), seed=3
    )
    assert not any(r["completion"].startswith("answer") for r in none["sft"])


def test_sft_and_chosen_are_correct_and_rejected_is_not(datasets):
    demonstrations = [
        (r["prompt"], r["completion"]) for r in datasets["sft"] if not r["completion"].startswith("answer")
    ]
    for name in ("prefs", "prefs_eval"):
        demonstrations += [(r["prompt"], r["chosen"]) for r in datasets[name]]
        for row in datasets[name]:
            assert not is_correct(row["rejected"], parse_prompt(row["prompt"]).answer), row
            assert row["rejected"] != row["chosen"]
    for prompt, completion in demonstrations:
        problem = parse_prompt(prompt)
        assert completion == problem.solution()
        assert is_correct(completion, problem.answer)
        assert is_well_formatted(completion)
        assert all(check_steps(prompt, completion))


def test_unpaired_labels_match_correctness(datasets):
    rows = datasets["unpaired"]
    for row in rows:
        assert row["label"] is is_correct(row["completion"], parse_prompt(row["prompt"]).answer)
    # Desirable and undesirable are both present (each drawn with probability 1/2 over 60 rows).
    assert {row["label"] for row in rows} == {True, False}


def test_prm_rows_carry_checked_labels(datasets):
    for name in ("prm", "prm_eval"):
        for row in datasets[name]:
            text = "; ".join(row["completions"])
            assert row["labels"] == check_steps(row["prompt"], text)
    labels = [label for row in datasets["prm"] for label in row["labels"]]
    assert True in labels and False in labels


def test_prompt_rows_carry_the_answer(datasets):
    for name in ("prompts", *EVAL_SUITES):
        for row in datasets[name]:
            assert row["answer"] == str(parse_prompt(row["prompt"]).answer)


def test_eval_suites_carry_their_difficulty(datasets):
    """eval_dev and eval_test rows carry `difficulty`: the operand count as a string (3 or 4
    with SPEC); the training prompts have no such column. The two suites share no prompt."""
    for name in EVAL_SUITES:
        rows = datasets[name]
        assert all(set(row) == {"prompt", "answer", "difficulty"} for row in rows), name
        assert all(row["difficulty"] == str(operand_count(row["prompt"])) for row in rows)
        assert {row["difficulty"] for row in rows} <= {"3", "4"}
    assert operand_count("23+58-17\n") == 3
    assert all(set(row) == {"prompt", "answer"} for row in datasets["prompts"])
    dev, test = ({row["prompt"] for row in datasets[name]} for name in EVAL_SUITES)
    assert not dev & test


def test_generate_datasets_too_few_distinct_problems():
    """With 2 operands in 1..2 there are only 7 distinct prompts (1+1, 1-1, 1+2, 2+1, 2+2,
    2-1, 2-2; a subtraction needs the left value >= the right one), so 10 SFT rows cannot be
    drawn, while 7 can."""
    spec = TaskSpec(min_operands=2, max_operands=2, max_value=2)
    sizes = TaskSizes(sft=10, prefs=0, prefs_eval=0, unpaired=0, prm=0, prm_eval=0, prompts=0, eval_dev=0, eval_test=0)
    with pytest.raises(ValueError, match="too few distinct problems"):
        generate_datasets(spec, sizes, seed=0)
    every = generate_datasets(spec, dataclasses.replace(sizes, sft=7), seed=0)["sft"]
    assert sorted(row["prompt"] for row in every) == sorted(
        f"{e}\n" for e in ("1+1", "1-1", "1+2", "2+1", "2+2", "2-1", "2-2")
    )


def test_classify_flaw_names_the_kind_of_each_generated_mistake():
    """Every flaw kind the generator makes is recognised from the text alone (the RM stage
    reports its accuracy per kind with this), and a correct solution has no flaw."""
    import random

    from rlhf.tasks.arithmetic import FLAW_KINDS, Problem, classify_flaw, flawed_solution

    problem = Problem((23, 58, 17), ("+", "-"))
    assert classify_flaw(problem.prompt, problem.solution()) is None
    # Hand-written: 23+58=81 is right, then the chain restarts from 80 (a copy error).
    assert classify_flaw(problem.prompt, "23+58=81; 80-17=63; answer 63") == "copy"
    assert classify_flaw(problem.prompt, "23+58=82; 82-17=65; answer 65") == "slip"
    assert classify_flaw(problem.prompt, "23+58=81; 81-17=64; answer 65") == "answer"
    assert classify_flaw(problem.prompt, "23+58=81; answer 81") == "skip"
    assert classify_flaw(problem.prompt, "answer 65") == "answer"
    assert classify_flaw(problem.prompt, "hello") == "skip"  # one step, but not an answer
    assert classify_flaw(problem.prompt, "answer 64") is None
    for seed in range(50):
        for kind in FLAW_KINDS:
            text, _ = flawed_solution(problem, random.Random(seed), kind)
            assert classify_flaw(problem.prompt, text) in {kind, "answer"}  # "answer" is the documented fallback


# ----------------------------------------------------------------------------- the Task interface

TASK = ArithmeticTask()


def test_get_task_gives_the_builtin_task():
    assert isinstance(get_task(), ArithmeticTask) and isinstance(get_task(TaskConfig(kind="builtin")), ArithmeticTask)
    assert TASKS["builtin"] is ArithmeticTask and TASK.name == "builtin"
    assert TASK.step_separator == "; " and TASK.has_format


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (EXAMPLE_SOLUTION, "64"),
        ("answer -5", "-5"),
        ("answer 12; answer 13", "12"),
        ("the answer is 64", None),
        ("", None),
    ],
)
def test_arithmetic_task_extract_answer_is_a_string(completion, expected):
    """Through the interface the answer is a string (votes and the generic rewards compare
    strings), the module's integer written out; None when none is stated."""
    answer = TASK.extract_answer(completion)
    assert answer == expected
    assert answer is None or isinstance(answer, str)


def test_arithmetic_task_checks_through_the_interface():
    assert TASK.is_correct(EXAMPLE_SOLUTION, 64) and TASK.is_correct(EXAMPLE_SOLUTION, "64")
    assert not TASK.is_correct(EXAMPLE_SOLUTION, "65")
    assert TASK.is_well_formatted(EXAMPLE_SOLUTION) and not TASK.is_well_formatted("64")
    assert TASK.split_steps(EXAMPLE_SOLUTION) == ["23+58=81", "81-17=64", "answer 64"]
    assert TASK.join_steps(TASK.split_steps(EXAMPLE_SOLUTION)) == EXAMPLE_SOLUTION
    assert TASK.check_steps(EXAMPLE.prompt, "23+58=81; 80-17=63; answer 63") == [True, False, False]
    assert TASK.classify_error(EXAMPLE.prompt, "23+58=81; 80-17=63; answer 63") == "copy"
    assert TASK.normalize_prompt("23+58-17") == TASK.normalize_prompt("23+58-17\n") == "23+58-17\n"


@pytest.mark.parametrize(
    ("step", "expected"),
    [("answer 5", True), (" answer 5 ", True), ("answer -5", True), ("3+2=5", False), ("5", False), ("", False)],
)
def test_arithmetic_task_is_final_step(step, expected):
    """MCTS stops expanding at the `answer N` step."""
    assert TASK.is_final_step(step) is expected


@pytest.mark.parametrize("prompt", ["What is the capital of France?\n", "", "1 2 3", "tell me a joke\n"])
def test_arithmetic_task_cannot_check_a_non_arithmetic_prompt(prompt):
    """A user suite run under the built-in task: check_steps and classify_error return None
    (nothing to check) instead of raising as the module's `check_steps` does."""
    assert TASK.check_steps(prompt, "answer 1") is None
    assert TASK.classify_error(prompt, "answer 1") is None


def test_base_task_extract_answer_is_the_last_line_normalised():
    """With no structure the answer is the last non-blank line, lower-cased, its space
    stripped and runs of space collapsed; None when there is no text at all."""
    task = Task()
    assert task.extract_answer("Let me think.\nThe  Capital is   PARIS \n\n  \n") == "the capital is paris"
    assert task.extract_answer("42") == "42"
    assert task.extract_answer("") is None and task.extract_answer(" \n\t\n") is None
    assert normalize_text("  New\tYork  CITY ") == "new york city"


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("I think it is\nParis", "paris", True),
        ("I think it is\n  PARIS  \n", " Paris ", True),  # case and surrounding space
        ("new   york", "New York", True),  # runs of space on the completion's side
        ("New York", "new \t york", True),  # and on the reference's
        ("new  york", "new  york", True),  # the same text is always correct
        ("Paris\nLyon", "Paris", False),  # only the last line counts
        ("Paris, France", "Paris", False),
        ("answer 42", 42, False),  # no `answer` parsing: the whole last line is compared
        ("42", 42, True),
        ("", "", False),  # no answer stated
    ],
)
def test_base_task_is_correct_normalises_case_and_space(completion, reference, expected):
    assert Task().is_correct(completion, reference) is expected


def test_base_task_defaults():
    """A task with no structure: no format (every completion is well formed), steps are
    lines, no step ends a solution, nothing can be checked or classified, prompts unchanged."""
    task = Task()
    assert task.name == "none" and task.has_format is False and task.step_separator == "\n"
    assert task.is_well_formatted("anything at all") and task.is_well_formatted("")
    # blank lines begin the next step, so that the steps join to the text as written
    assert task.split_steps("first step\n\n  \nsecond step\n") == ["first step", "\n  \nsecond step"]
    assert task.join_steps(task.split_steps("first step\n\n  \nsecond step\n")) == "first step\n\n  \nsecond step"
    assert task.split_steps("23+58=81; answer 81") == ["23+58=81; answer 81"]
    assert task.split_steps("") == []
    assert task.join_steps(["a", "b"]) == "a\nb"
    assert task.is_final_step("answer 5") is False
    assert task.check_steps(EXAMPLE.prompt, EXAMPLE_SOLUTION) is None
    assert task.classify_error(EXAMPLE.prompt, "answer 1") is None
    assert task.normalize_prompt("23+58-17") == "23+58-17"
