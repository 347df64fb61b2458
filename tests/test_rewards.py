"""Reward functions: each a plain function of (prompts, completions, row fields) with
hand-checked values, the params entries that declare them, and their weighted sum."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from rlhf.params import format_validation_error
from rlhf.rewards.functions import (
    RewardSpec,
    answer_match,
    banned_rule,
    build_rewards,
    format_match,
    length_rule,
    numeric_tolerance,
    repetition_rule,
    weighted_sum,
)

PROMPTS = ["3+4-2\n"] * 4
COMPLETIONS = [
    "3+4=7; 7-2=5; answer 5",  # right
    "3+4=7; 7-2=6; answer 6",  # off by one
    "3+4=7; 7-2=15; answer 15",  # off by ten
    "five",  # no answer at all
]
ANSWERS = ["5"] * 4
SPECS = TypeAdapter(list[RewardSpec])


def test_answer_match_is_exact():
    assert answer_match(PROMPTS, COMPLETIONS, answer=ANSWERS) == [1.0, 0.0, 0.0, 0.0]


def test_answer_match_needs_an_answer_column():
    with pytest.raises(ValueError, match="`answer` column"):
        answer_match(PROMPTS, COMPLETIONS)


def test_numeric_tolerance_absolute_and_relative():
    """|6-5| = 1 <= atol 1 passes, |15-5| = 10 does not; with rtol 2: 10 <= 2*|5| passes."""
    assert numeric_tolerance(PROMPTS, COMPLETIONS, answer=ANSWERS, atol=1) == [1.0, 1.0, 0.0, 0.0]
    assert numeric_tolerance(PROMPTS, COMPLETIONS, answer=ANSWERS, rtol=2) == [1.0, 1.0, 1.0, 0.0]
    assert numeric_tolerance(PROMPTS[:1], COMPLETIONS[:1], answer=["five"], atol=100) == [0.0]


def test_format_builtin_and_pattern():
    assert format_match(PROMPTS, COMPLETIONS) == [1.0, 1.0, 1.0, 0.0]
    assert format_match(PROMPTS, COMPLETIONS, pattern=r"[a-z]+") == [0.0, 0.0, 0.0, 1.0]


def test_constitutional_rules():
    """Length: 22, 22, 24 and 4 characters against max 22. Repetition over characters
    (fewer than 3 words): 'aaaa' has 2 bigrams, both 'aa' -> 1 - 1/2 = 0.5; 'abab' has
    bigrams ab, ba, ab -> 1 - 1/3. Banned: case-insensitive substring."""
    assert length_rule(PROMPTS, COMPLETIONS, max_chars=22) == [1.0, 1.0, 0.0, 1.0]
    assert repetition_rule(PROMPTS[:2], ["aaa", "abab"], ngram=2) == [0.5, pytest.approx(2 / 3)]
    assert repetition_rule(PROMPTS[:1], ["one two one two one two"], ngram=2) == [pytest.approx(1 - 3 / 5)]
    assert banned_rule(PROMPTS, COMPLETIONS, words=["FIVE", "15"]) == [1.0, 1.0, 0.0, 0.0]


def test_conversational_completions_are_read_as_text():
    completion = [{"role": "assistant", "content": "3+4=7; 7-2=5; answer 5"}]
    assert answer_match(["x"], [completion], answer=["5"]) == [1.0]


def test_weighted_sum_of_declared_rewards():
    """answer (w 1) + format (w 0.5) + banned '15' (w 2):
    right: 1 + 0.5 + 2 = 3.5; off by one: 0 + 0.5 + 2 = 2.5; off by ten: 0 + 0.5 + 0 = 0.5;
    no answer: 0 + 0 + 2 = 2."""
    specs = SPECS.validate_python(
        [
            {"name": "answer_match"},
            {"name": "format", "weight": 0.5},
            {"name": "banned", "weight": 2, "words": ["15"]},
        ]
    )
    functions, weights = build_rewards(specs)
    assert [f.__name__ for f in functions] == ["0_answer_match", "1_format", "2_banned"]
    assert weights == [1.0, 0.5, 2.0]
    total = weighted_sum(functions, weights)
    assert total(PROMPTS, COMPLETIONS, answer=ANSWERS) == [3.5, 2.5, 0.5, 2.0]


def test_bad_reward_entries_name_the_entry_and_key():
    with pytest.raises(ValidationError) as error:
        SPECS.validate_python(
            [
                {"name": "answer_match"},
                {"name": "banned"},
                {"name": "format", "pattern": "("},
                {"name": "numeric_tolerance", "atol": -1},
                {"name": "rouge"},
                {"name": "length", "max_char": 10},
            ]
        )
    problems = "\n".join(format_validation_error("policy.grpo.rewards", error.value))
    assert "policy.grpo.rewards.1.banned.words: required key is missing" in problems
    assert "policy.grpo.rewards.2.format.pattern" in problems and "regular expression" in problems
    assert "policy.grpo.rewards.3.numeric_tolerance.atol" in problems
    assert "policy.grpo.rewards.4" in problems and "'rouge'" in problems
    assert "policy.grpo.rewards.5.length.max_char: unknown key" in problems
