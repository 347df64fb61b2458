"""The task kinds for the user's own data (rlhf.tasks: gsm8k, math, last_number, regex,
choice, none): answer extraction and checking on hand-written completions, formats, steps,
and the `task:` params that build them."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest
from pydantic import ValidationError

from rlhf.params import ParamsError, validate_params
from rlhf.tasks import TASKS, TaskConfig, get_task
from rlhf.tasks.answers import ChoiceTask, LastNumberTask, NoAnswerTask, RegexTask, normalize_number
from rlhf.tasks.arithmetic import ArithmeticTask
from rlhf.tasks.gsm8k import GSM8KTask
from rlhf.tasks.math_answers import MathTask

# GSM8K test[0]'s gold solution, calculator annotations included.
GSM8K_SOLUTION = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer’s market.\n"
    "#### 18"
)


def task(**params):
    return get_task(TaskConfig(**params))


def test_every_kind_is_a_config_choice_and_builds():
    assert set(get_args(TaskConfig.model_fields["kind"].annotation)) == set(TASKS)
    settings = {"regex": {"pattern": r"answer: (\S+)"}}
    for kind, cls in TASKS.items():
        built = task(kind=kind, **settings.get(kind, {}))
        assert type(built) is cls and built.name == kind


def test_builtin_kind_is_the_arithmetic_task_unchanged():
    builtin = task()
    assert type(builtin) is ArithmeticTask and type(task(kind="builtin")) is ArithmeticTask
    assert builtin.checks_answers and builtin.has_format and builtin.step_separator == "; "
    assert builtin.is_correct("23+58=81; 81-17=64; answer 64", "64")
    assert not builtin.is_correct("23+58=81; 81-17=64; answer 64", 65)
    assert builtin.extract_answer("answer 12; answer 13") == "12"


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", "18"),
        ("18.0", "18"),
        ("18.", "18"),
        ("$18.00", "18"),
        ("1,000", "1000"),
        ("-$1,000.50", "-1000.5"),
        (" 0.50 ", "0.5"),
        (".5", "0.5"),
        ("-0", "0"),
        ("eighteen", None),
        ("1e3", None),
        ("18 dollars", None),
        ("", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


# ----------------------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    ("completion", "loose", "strict"),
    [
        ("#### 18", True, True),
        ("She makes 18 dollars.\n#### 18", True, True),
        ("#### $18.00", True, True),
        ("#### 17\nWait, I mean\n#### 18", True, True),  # the last #### counts
        ("#### 18\nThat is 3 more than 15.", True, True),  # not the last number
        ("The answer is 18.", True, False),
        ("So the answer is: **18**", True, False),
        ("\\boxed{18}", True, False),
        ("3 + 15 = \\boxed{18}. Check: 18 - 3 = 15", True, False),  # boxed before the last number
        ("She has 9 eggs and makes 18", True, False),  # the last number
        ("The answer is 18, not 20 as 2 + 18 = 20", True, False),  # 'the answer is' before the last number
        ("#### 19", False, False),
        ("The answer is 19. I had 18 before.", False, False),
        ("She makes 18 dollars and 4 cents", False, False),
        ("I do not know", False, False),
        ("", False, False),
    ],
)
def test_gsm8k_correct_with_and_without_strict(completion, loose, strict):
    assert task(kind="gsm8k").is_correct(completion, "18") is loose
    assert task(kind="gsm8k", strict=True).is_correct(completion, "18") is strict


def test_gsm8k_reference_is_a_number_or_a_whole_solution():
    """The gold GSM8K solution reaches its own `#### 18`, in strict mode too; thousands
    commas, `$` and `.0` do not matter on either side."""
    for gsm8k in (GSM8KTask(), GSM8KTask(strict=True)):
        assert gsm8k.is_correct(GSM8K_SOLUTION, GSM8K_SOLUTION)
        assert gsm8k.is_correct(GSM8K_SOLUTION, 18) and gsm8k.is_correct(GSM8K_SOLUTION, "18.0")
        assert gsm8k.is_correct("#### 1,000", 1000) and gsm8k.is_correct("#### 1000", "$1,000")
        assert gsm8k.is_correct("#### -3", "-3") and not gsm8k.is_correct("#### 3", "-3")
        assert gsm8k.is_correct("#### 2.5", "2.50") and not gsm8k.is_correct("#### 2.5", "25")
        assert not gsm8k.is_correct("#### 18", GSM8K_SOLUTION.replace("#### 18", "#### 19"))
    assert GSM8KTask().extract_answer("#### 1,000.0") == GSM8KTask().extract_answer("1000") == "1000"


def test_gsm8k_bad_reference_is_an_error():
    with pytest.raises(ValueError, match="not one"):
        GSM8KTask().is_correct("#### 18", "eighteen")
    with pytest.raises(ValueError, match="no number after"):
        GSM8KTask().is_correct("#### 18", "so she makes it\n#### eighteen")


def test_gsm8k_steps_are_lines_and_the_final_one_is_marked():
    gsm8k = GSM8KTask()
    steps = gsm8k.split_steps(GSM8K_SOLUTION)
    assert len(steps) == 3 and steps[-1] == "#### 18"
    assert [gsm8k.is_final_step(step) for step in steps] == [False, False, True]
    assert gsm8k.join_steps(steps) == GSM8K_SOLUTION
    assert not gsm8k.has_format and gsm8k.is_well_formatted("anything")


# ----------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{\\frac{1}{2}}", "1/3", False),
        ("So $x = \\frac{2}{4}$, which is \\boxed{0.5}.", "\\frac{1}{2}", True),
        ("The final answer is $2\\sqrt{2}$", "\\sqrt{8}", True),
        ("\\boxed{\\frac{\\pi}{4}}", "\\frac{\\pi}{4}", True),
        ("\\boxed{x^2 + 1}", "1 + x^2", True),
        ("\\boxed{1,000}", "1000", True),
        ("Thus the answer is \\boxed{3}.", "The sum is $1 + 2 = \\boxed{3}$.", True),  # a whole gold solution
        ("Thus the answer is \\boxed{4}.", "The sum is $1 + 2 = \\boxed{3}$.", False),
        ("The answer is 0.5", "0.5", False),  # LaTeX required, as in TRL's accuracy reward
        ("I cannot solve this", "0.5", False),
        ("", "0.5", False),
    ],
)
def test_math_is_correct_by_mathematical_equality(completion, gold, expected):
    assert MathTask().is_correct(completion, gold) is expected


def test_math_extract_answer_gives_one_vote_per_value():
    """Decimals become fractions, so `0.5` and `\\frac12` are the same vote."""
    math = MathTask()
    assert math.extract_answer("\\boxed{\\frac{1}{2}}") == math.extract_answer("\\boxed{0.5}") == "1/2"
    assert math.extract_answer("so \\boxed{18}") == "18"
    assert math.extract_answer("\\boxed{\\frac13}") != math.extract_answer("\\boxed{\\frac12}")
    assert math.extract_answer("no answer here") is None
    assert math.reference_answer("0.5") == "1/2"


def test_math_bad_reference_is_an_error_and_steps_end_at_the_box():
    with pytest.raises(ValueError, match="no expression"):
        MathTask().is_correct("\\boxed{1}", "")
    math = MathTask()
    steps = math.split_steps("Add them: $1 + 2 = 3$.\nSo the answer is $\\boxed{3}$.")
    assert [math.is_final_step(step) for step in steps] == [False, True]
    paragraphs = task(kind="math", step_separator="\n\n")
    assert paragraphs.split_steps("a\nb\n\nc") == ["a\nb", "c"]


def test_blank_lines_between_steps_stay_in_the_text_the_steps_join_to():
    """A solution with an empty line between its steps (the usual chat layout) split and
    joined again is the text the model wrote (blank lines were dropped, and rollouts, MCTS
    and the PRM continued a prefix the model never wrote); the blank begins the next step."""
    lines = task(kind="last_number")
    written = "Tom has 3 apples.\n\nHe buys 2 more.\n\n\nSo 5\n"
    steps = lines.split_steps(written)
    assert steps == ["Tom has 3 apples.", "\nHe buys 2 more.", "\n\nSo 5"]
    assert lines.join_steps(steps) == written.rstrip()
    assert lines.join_steps(steps[:2]) + "\n" == "Tom has 3 apples.\n\nHe buys 2 more.\n"
    assert lines.split_steps("\nfirst\nsecond") == ["\nfirst", "second"]


def test_prompts_derived_from_sft_get_references_their_own_demonstrations_meet():
    """Stage prepare gives the prompts it derives from the SFT data the answer each
    demonstration states. Math: the LaTeX of its last box (sympy's vote form, pi/4 or
    x**2 + 1, is no reference math-verify reads back); every demonstration is then right
    against its own reference. GSM8K: a `#### N` line only (a reply that states no answer
    gets none, not its last number)."""
    import pandas as pd

    from rlhf.data.preparation import prompts_from_sft

    math = MathTask()
    demos = [r"so \boxed{\frac{\pi}{4}}.", r"\boxed{x^2+1}", r"\boxed{(1, 2)}", r"\boxed{\infty}", "no box"]
    sft = pd.DataFrame({"prompt": [f"q{i}" for i in range(len(demos))], "completion": demos})
    answers = prompts_from_sft(sft, math)["answer"].tolist()
    assert answers[:4] == [r"\frac{\pi}{4}", "x^2+1", "(1, 2)", r"\infty"] and answers[4] is None
    assert all(math.is_correct(d, a) for d, a in zip(demos[:4], answers[:4]))
    assert math.extract_answer(demos[0]) == "pi/4", "the vote form, which is not a reference"
    gsm = GSM8KTask()
    replies = pd.DataFrame(
        {"prompt": ["capital?", "apples?"], "completion": ["Paris, about 2 million people.", "3 + 4 = 7\n#### 7"]}
    )
    assert prompts_from_sft(replies, gsm)["answer"].tolist() == [None, "7"]


def test_importing_and_building_tasks_leaves_math_verify_unloaded():
    """math-verify (and the sympy it pulls in) loads on the first check, not on import or
    when params are validated."""
    code = (
        "import sys; from rlhf.tasks import TaskConfig, get_task; get_task(TaskConfig(kind='math')); "
        "print(sorted(m for m in ('math_verify', 'sympy') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- last_number


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("3 + 4 = 7", "7"),
        ("It costs $1,250.00.", "1250"),
        ("x = -3", "-3"),
        ("10-3 leaves 7 of 10-3", "3"),  # a minus after a digit is the operator
        ("1,2,3", "3"),  # a list, not a thousands-grouped number
        ("no numbers", None),
    ],
)
def test_last_number_extract(completion, expected):
    assert LastNumberTask().extract_answer(completion) == expected


def test_last_number_compares_numerically():
    last = LastNumberTask()
    assert last.is_correct("I get 18.0", "18") and last.is_correct("about 1,000", 1000)
    assert not last.is_correct("18, or maybe 19", "18") and not last.is_correct("none", "18")
    assert not last.is_final_step("18")
    with pytest.raises(ValueError, match="not one"):
        last.is_correct("18", "eighteen")


# ----------------------------------------------------------------------------- regex


def test_regex_exact_and_numeric():
    exact = task(kind="regex", pattern=r"Final: (.+)")
    numeric = task(kind="regex", pattern=r"Final: (.+)", compare="numeric")
    assert exact.is_correct("work\nFinal:  New   York ", "new york")
    assert exact.is_correct("Final: 18", "18") and not exact.is_correct("Final: 18.0", "18")
    assert numeric.is_correct("Final: 18.0", "18") and numeric.is_correct("Final: $1,000", "1000")
    assert not numeric.is_correct("Final: eighteen", "18")  # not a number: no answer
    assert numeric.extract_answer("Final: eighteen") is None
    assert exact.extract_answer("Final: 1\nFinal: 2") == "2"  # the last match counts
    assert exact.extract_answer("no marker") is None
    assert exact.is_final_step("Final: 2") and not exact.is_final_step("1 + 1 = 2")


def test_regex_inline_flags_and_optional_group():
    regex = task(kind="regex", pattern=r"(?i)answer(?:: (\w+))?")
    assert regex.extract_answer("ANSWER: Paris") == "paris"
    assert regex.extract_answer("answer") is None  # the group did not take part


# ----------------------------------------------------------------------------- choice


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("The answer is (B).", "B"),
        ("the answer is (b)", "B"),
        ("Answer: C", "C"),
        ("So the correct answer is option D because it fits", "D"),
        ("I compare (A) with (C) and pick (C)", "C"),
        ("After weighing A against B, the answer is B. (A) was close.", "B"),  # 'answer is' beats '(A)'
        ("Looking at every option...\nD.", "D"),
        ("Looking at every option...\n**A**", "A"),
        ("The answer is a dog", None),  # a bare lower-case word is not option A
        ("The answer is E", None),  # not one of ABCD
        ("I am not sure", None),
        ("", None),
    ],
)
def test_choice_extract(completion, expected):
    assert ChoiceTask().extract_answer(completion) == expected


def test_choice_compares_letters_case_insensitively():
    choice = ChoiceTask()
    assert choice.is_correct("Answer: B", "b") and choice.is_correct("answer is (b)", "(B)")
    assert not choice.is_correct("Answer: B", "C")
    assert choice.is_final_step("Hence the answer is (A).") and not choice.is_final_step("(A) is red")
    with pytest.raises(ValueError, match="not one of the choices"):
        choice.is_correct("Answer: B", "F")
    five = task(kind="choice", choices="ABCDE")
    assert five.is_correct("Answer: E", "E") and not ChoiceTask().is_correct("Answer: E", "A")


# ----------------------------------------------------------------------------- none


def test_none_kind_checks_no_answers():
    none = task(kind="none")
    assert isinstance(none, NoAnswerTask) and none.checks_answers is False
    assert all(TASKS[kind].checks_answers for kind in TASKS if kind != "none")
    assert none.extract_answer("The answer is 18") is None  # nothing for votes to count
    with pytest.raises(ValueError, match="checks no answers"):
        none.is_correct("18", "18")
    assert none.split_steps("a\nb") == ["a", "b"] and not none.has_format


# ----------------------------------------------------------------------------- format and steps


def test_format_pattern_is_a_fullmatch_of_the_stripped_completion():
    shaped = task(kind="gsm8k", format_pattern=r".*\n#### -?\d+")
    assert shaped.has_format
    assert shaped.is_well_formatted("work\nmore work\n#### 18\n")  # DOTALL: `.` crosses lines
    assert not shaped.is_well_formatted("#### 18")  # no working before it
    assert not shaped.is_well_formatted("work\n#### 18 then chatter")  # a full match, not a search
    plain = task(kind="gsm8k")
    assert not plain.has_format and plain.is_well_formatted("anything")


def test_step_separator_setting():
    semicolons = task(kind="last_number", step_separator="; ")
    assert semicolons.split_steps("a; b; 3") == ["a", "b", "3"] and semicolons.join_steps(["a", "b"]) == "a; b"


# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"kind": "math", "strict": True}, "strict"),  # a key the kind does not read
        ({"kind": "gsm8k", "choices": "ABC"}, "choices"),
        ({"kind": "builtin", "step_separator": "\n"}, "step_separator"),  # builtin takes no settings
        ({"kind": "choice", "pattern": "(x)"}, "pattern"),
        ({"kind": "regex"}, "pattern"),  # required for regex
        ({"kind": "regex", "pattern": r"answer \d+"}, "pattern"),  # no group
        ({"kind": "regex", "pattern": r"(\d+) of (\d+)"}, "pattern"),  # two groups
        ({"kind": "regex", "pattern": "(unclosed"}, "pattern"),
        ({"kind": "regex", "pattern": "(x)", "compare": "fuzzy"}, "compare"),
        ({"kind": "none", "format_pattern": "[a-"}, "format_pattern"),
        ({"kind": "choice", "choices": "AAB"}, "choices"),
        ({"kind": "choice", "choices": "A B"}, "choices"),
        ({"kind": "last_number", "step_separator": ""}, "step_separator"),
        ({"kind": "gsm8k", "stritc": True}, "stritc"),  # unknown anywhere
        ({"kind": "arithmetic"}, "kind"),
    ],
)
def test_bad_task_params_name_the_key(params, key):
    """The error's location or its message names the key (not only the input it echoes)."""
    with pytest.raises(ValidationError) as raised:
        TaskConfig(**params)
    assert any(key in [str(part) for part in e["loc"]] or key in e["msg"] for e in raised.value.errors())
    with pytest.raises(ParamsError) as error:
        validate_params({"task": params}, {"task": TaskConfig})
    assert any(key in problem.split(" (got ")[0] for problem in error.value.problems)


def test_default_and_listed_settings_are_accepted():
    """Defaults are never 'unused': only keys set in params are rejected."""
    assert TaskConfig().kind == "builtin"
    config = TaskConfig(kind="regex", pattern=r"= (\d+)$", compare="numeric", format_pattern=".*", step_separator="\n")
    assert get_task(config).compare == "numeric"
    assert isinstance(get_task(TaskConfig(kind="gsm8k", strict=True, step_separator="\n\n")), GSM8KTask)
    assert isinstance(get_task(TaskConfig(kind="choice", choices="1234")), ChoiceTask)
    assert isinstance(task(kind="regex", pattern="(x)"), RegexTask)
