"""Reward functions: each a plain function of (prompts, completions, row fields) and the
task (keyword `task`) with hand-checked values, the params entries that declare them, the
model folders the model-based ones read, and their weighted sum."""

from __future__ import annotations

from pathlib import Path

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
    model_paths,
    numeric_tolerance,
    repetition_rule,
    weighted_sum,
)
from rlhf.tasks import TaskConfig, get_task
from rlhf.tasks.base import Task

TASK = get_task()  # the built-in arithmetic task

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
    assert answer_match(PROMPTS, COMPLETIONS, answer=ANSWERS, task=TASK) == [1.0, 0.0, 0.0, 0.0]


def test_answer_match_needs_an_answer_column():
    with pytest.raises(ValueError, match="`answer` column"):
        answer_match(PROMPTS, COMPLETIONS, task=TASK)


def test_answer_match_asks_the_task():
    """The base Task reads the last non-blank line, lower-cased, and compares it with the
    reference normalised the same way (case and runs of space): 'Paris' and 'the  CAPITAL
    is paris' match 'paris' / 'The capital is Paris'; 'Lyon' does not."""
    completions = ["I think...\nParis\n", "Lyon", "the  CAPITAL is paris"]
    answers = ["paris", "Paris", " The capital is Paris "]
    assert answer_match(["q"] * 3, completions, answer=answers, task=Task()) == [1.0, 0.0, 1.0]


def test_numeric_tolerance_absolute_and_relative():
    """|6-5| = 1 <= atol 1 passes, |15-5| = 10 does not; with rtol 2: 10 <= 2*|5| passes.
    'five' states no answer (0 either way), and a reference that is not a number matches
    nothing, however wide the tolerance."""
    assert numeric_tolerance(PROMPTS, COMPLETIONS, answer=ANSWERS, atol=1, task=TASK) == [1.0, 1.0, 0.0, 0.0]
    assert numeric_tolerance(PROMPTS, COMPLETIONS, answer=ANSWERS, rtol=2, task=TASK) == [1.0, 1.0, 1.0, 0.0]
    assert numeric_tolerance(PROMPTS[:1], COMPLETIONS[:1], answer=["five"], atol=100, task=TASK) == [0.0]


def test_numeric_tolerance_reads_the_tasks_answer_as_a_number():
    """The base Task's answer is the last line: '1,000' reads as 1000 (|1000 - 999.5| = 0.5
    <= atol 0.5), '3.25' against 3 is 0.25 off (passes atol 0.5), 'about ten' is no number."""
    completions = ["so:\n1,000", "3.25", "about ten"]
    rewards = numeric_tolerance(["q"] * 3, completions, answer=["999.5", "3", "10"], atol=0.5, task=Task())
    assert rewards == [1.0, 1.0, 0.0]


def test_answer_rewards_read_a_whole_reference_solution_and_pay_nothing_without_one():
    """GSM8K's answer column holds the whole solution: both answer rewards read "#### 72"
    from it as the task does ("$72" too); a prompt without an answer (None from TRL, NaN
    from pandas, an empty cell) gets 0 from both, never an error or a match on "none"."""
    gsm8k = get_task(TaskConfig(kind="gsm8k"))
    completions = ["So 72.\n#### 72", "#### 71", "#### 72", "#### 72", "#### none"]
    answers = ["She sold 48 + 24 = 72.\n#### 72", "$72", None, float("nan"), ""]
    assert answer_match(["q"] * 5, completions, answer=answers, task=gsm8k) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert numeric_tolerance(["q"] * 5, completions, answer=answers, atol=1, task=gsm8k) == [1.0, 1.0, 0.0, 0.0, 0.0]
    text = get_task(TaskConfig(kind="regex", pattern=r"Final: (\S+)"))
    assert answer_match(["q"] * 2, ["Final: none", "Final: nan"], answer=[None, float("nan")], task=text) == [0, 0]


def test_format_builtin_and_pattern():
    assert format_match(PROMPTS, COMPLETIONS, task=TASK) == [1.0, 1.0, 1.0, 0.0]
    assert format_match(PROMPTS, COMPLETIONS, pattern=r"[a-z]+", task=TASK) == [0.0, 0.0, 0.0, 1.0]


def test_format_without_a_pattern_needs_a_task_with_a_format():
    """The base Task defines no format (has_format False): the format reward then needs a
    `pattern`, and with one it works as on any task."""
    with pytest.raises(ValueError, match="needs a `pattern`: task 'none' defines no format"):
        format_match(PROMPTS, COMPLETIONS, task=Task())
    assert format_match(PROMPTS, COMPLETIONS, pattern=r"[a-z]+", task=Task()) == [0.0, 0.0, 0.0, 1.0]


def test_constitutional_rules():
    """Length: 22, 22, 24 and 4 characters against max 22. Repetition over characters
    (fewer than 2 words): 'aaa' has 2 bigrams, both 'aa' -> 1 repeat -> 1 - 1/2 = 0.5;
    'abab' has bigrams ab, ba, ab -> 1 - 1/3. Over words: 'one two' x 3 has 5 bigrams, 2
    distinct -> 1 - 3/5. Banned: case-insensitive substring ('five' has FIVE, 'answer 15' has 15)."""
    assert length_rule(PROMPTS, COMPLETIONS, max_chars=22) == [1.0, 1.0, 0.0, 1.0]
    assert repetition_rule(PROMPTS[:2], ["aaa", "abab"], ngram=2) == [0.5, pytest.approx(2 / 3)]
    assert repetition_rule(PROMPTS[:1], ["one two one two one two"], ngram=2) == [pytest.approx(1 - 3 / 5)]
    assert banned_rule(PROMPTS, COMPLETIONS, words=["FIVE", "15"]) == [1.0, 1.0, 0.0, 0.0]


def test_a_banned_word_is_matched_as_a_word_not_inside_others():
    """ "AI" is not in "said" nor "kill" in "skill"; an entry of a script written without
    spaces is still found inside a sentence; an entry that ends in punctuation matches as
    written."""
    texts = ["He said it again.", "That takes skill.", "As an AI, I cannot.", "我不能说这个词。", "Use it!!"]
    assert banned_rule([""] * 5, texts, words=["ai", "KILL"]) == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert banned_rule([""] * 5, texts, words=["说这个"]) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert banned_rule([""] * 5, texts, words=["it!!"]) == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_rule_rewards_pay_nothing_for_an_empty_completion():
    """An empty or blank completion keeps every rule (as measures: length 0, no repeats, no
    banned string), so as rewards they pay it 0: a policy rewarded by rules alone must not
    learn to say nothing. Non-empty completions score as the rules do."""
    specs = SPECS.validate_python(
        [{"name": "length", "max_chars": 22}, {"name": "repetition", "ngram": 2}, {"name": "banned", "words": ["15"]}]
    )
    functions, _ = build_rewards(specs, TASK)
    completions = ["", "   ", "3+4=7", [{"role": "assistant", "content": ""}]]
    for function in functions:
        assert function(PROMPTS, completions) == [0.0, 0.0, 1.0, 0.0], function.__name__
    assert length_rule(PROMPTS, completions) == [1.0] * 4
    assert banned_rule(PROMPTS, completions, words=["15"]) == [1.0] * 4


def test_conversational_completions_are_read_as_text():
    """The text of every message: a tool call without content adds none, text parts of a
    multimodal content list are read."""
    completion = [{"role": "assistant", "content": "3+4=7; 7-2=5; answer 5"}]
    assert answer_match(["x"], [completion], answer=["5"], task=TASK) == [1.0]
    parts = [
        {"role": "assistant", "content": None, "tool_calls": [{"name": "calc"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "3+4=7; 7-2=5; "}, {"type": "text", "text": "answer 5"}],
        },
    ]
    assert answer_match(["x"], [parts], answer=["5"], task=TASK) == [1.0]


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
    functions, weights = build_rewards(specs, TASK)
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


def test_model_based_rewards_read_their_path_or_the_callers_folder():
    """reward_model and prm with no `path` read the caller's folder for their name; an
    explicit `path` wins; rule rewards read no model. With neither, the error names the reward."""
    specs = SPECS.validate_python(
        [{"name": "answer_match"}, {"name": "reward_model"}, {"name": "prm", "path": "elsewhere/prm"}]
    )
    assert specs[1].path is None
    folders = {"reward_model": "models/rm", "prm": "models/prm"}
    assert model_paths(specs, folders) == [Path("models/rm"), Path("elsewhere/prm")]
    assert model_paths(specs[:1]) == []
    with pytest.raises(ValueError, match="reward 'reward_model' has no `path`"):
        model_paths(specs)
    with pytest.raises(ValueError, match="reward 'reward_model' has no `path`"):
        build_rewards(specs[1:2], TASK)


def test_check_params_names_a_reward_path_that_holds_no_such_scorer(tmp_path, monkeypatch):
    """A reward's own `path` to a folder of another kind (an SFT model as the RM), or a typo
    under models/, failed in the policy stage after its models loaded, naming no key; an
    uncertainty penalty on a one-member ensemble changed nothing. check_params names each;
    a folder a stage has yet to write (models/prm) and a Hub id pass."""
    from tests.conftest import params_problems, tiny_params

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models/sft").mkdir(parents=True)
    (tmp_path / "models/sft/config.json").write_text("{}")
    data = tiny_params()
    data["policy"]["online"] = ["grpo"]
    data["rm"]["num_members"] = 1
    data["policy"]["grpo"]["rewards"] = [
        {"name": "answer_match"},
        {"name": "reward_model", "path": "models/sft"},
        {"name": "prm", "path": "models/my_prm_typo"},
        {"name": "prm", "path": "models/prm"},
        {"name": "reward_model", "path": "owner/some-rm"},
        {"name": "reward_model", "uncertainty_penalty": 1.0},
    ]
    found = [p for p in params_problems(tmp_path, data) if p.startswith("policy.grpo.rewards")]
    assert found == [
        "policy.grpo.rewards[1].path: models/sft holds no reward model ensemble (folders member_0, member_1, ...: "
        "what stage rm writes)",
        "policy.grpo.rewards[2].path: models/my_prm_typo does not exist, and no stage writes it (the pipeline's is "
        "models/prm)",
        "policy.grpo.rewards[5].uncertainty_penalty: the ensemble's spread is 0 with rm.num_members 1, so the "
        "penalty does nothing; train several members (rm.num_members), or remove it",
    ]


def test_an_answer_reward_on_prompts_without_answers_fails_before_any_model(tmp_path, monkeypatch):
    """GRPO with answer_match on the user's prompts without an answer column failed inside
    TRL's first training step; with a column of empty answers it trained to the end on a
    reward of 0. Both fail in the policy stage before a model loads, naming the reward."""
    import pandas as pd

    from rlhf.data.contracts import DataValidationError
    from stages.policy import Config, check_answer_rewards

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/prepared").mkdir(parents=True)
    grpo = Config().grpo  # rewards: answer_match (and format)
    for table in ({"prompt": ["a?", "b?"]}, {"prompt": ["a?", "b?"], "answer": [None, None]}):
        pd.DataFrame(table).to_parquet("data/prepared/prompts.parquet")
        with pytest.raises(DataValidationError, match=r"no prompt has an answer, and policy.grpo.rewards\[0\]"):
            check_answer_rewards(grpo, "grpo")
    pd.DataFrame({"prompt": ["a?", "b?"], "answer": [None, "3"]}).to_parquet("data/prepared/prompts.parquet")
    check_answer_rewards(grpo, "grpo")
    pd.DataFrame({"prompt": ["a?"]}).to_parquet("data/prepared/prompts.parquet")
    check_answer_rewards(grpo.model_copy(update={"rewards": SPECS.validate_python([{"name": "length"}])}), "grpo")


def test_check_params_names_a_prm_of_another_separator_and_an_infer_prm_typo(tmp_path, monkeypatch):
    """A PRM folder a param names that splits steps on another separator than the task's
    scores other steps than the model writes (a reward's `path`, `infer.prm`); `infer.prm`
    under models/ that no stage writes is a typo. Each is named before any stage runs."""
    import json

    from tests.conftest import params_problems, tiny_params

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models/lines_prm").mkdir(parents=True)
    (tmp_path / "models/lines_prm/prm.json").write_text(json.dumps({"kind": "classifier", "step_separator": "\n"}))
    data = tiny_params()
    data["policy"]["online"] = ["grpo"]
    data["policy"]["grpo"]["rewards"] = [{"name": "answer_match"}, {"name": "prm", "path": "models/lines_prm"}]
    data["infer"]["prm"] = "models/prm_typo"
    other = "models/lines_prm: the PRM splits steps on '\\n' but the task on '; ' (task.step_separator)"
    found = [p for p in params_problems(tmp_path, data) if p.startswith(("policy.grpo.rewards", "infer"))]
    assert [p.split(": it would")[0] for p in found] == [
        f"policy.grpo.rewards[1].path: {other}",
        "infer.prm: models/prm_typo does not exist, and no stage writes it (the pipeline's is models/prm)",
    ]
    data["infer"]["prm"] = "models/lines_prm"
    found = [p for p in params_problems(tmp_path, data) if p.startswith("infer")]
    assert [p.split(": it would")[0] for p in found] == [f"infer.prm: {other}"]
