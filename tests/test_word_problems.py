"""The built-in word problems (rlhf/tasks/word_problems.py): every row checks with the gsm8k
task, flawed solutions are wrong where their labels say, no eval problem is trained on,
the held-out family is in no training table, and prepare writes them as conversations."""

from __future__ import annotations

import random

import pytest

from rlhf.tasks import TaskConfig, get_task
from rlhf.tasks.word_problems import (
    FAMILIES,
    HELDOUT_FAMILIES,
    TRAIN_FAMILIES,
    Step,
    WordProblem,
    WordProblemSizes,
    flawed_solution,
    generate_datasets,
)

GSM8K = get_task(TaskConfig(kind="gsm8k"))
SMALL = WordProblemSizes(sft=300, prefs=120, prefs_eval=30, unpaired=60, prm=80, prm_eval=20, prompts=60,
                         eval_dev=60, eval_test=60, eval_test_unseen=30)  # fmt: skip


def test_the_generator_is_seeded_and_every_row_checks_with_the_gsm8k_task():
    data = generate_datasets(SMALL, seed=0)
    assert data == generate_datasets(SMALL, seed=0)
    assert data["sft"] != generate_datasets(SMALL, seed=1)["sft"]
    assert {name: len(rows) for name, rows in data.items()} == {
        "sft": 300, "prefs": 120, "prefs_eval": 30, "unpaired": 60, "prm": 80, "prm_eval": 20, "prompts": 60,
        "eval_dev": 60, "eval_test": 60, "eval_test_unseen": 30,
    }  # fmt: skip
    for row in data["sft"]:
        assert row["completion"].splitlines()[-1].startswith("#### ")
        assert GSM8K.demonstration_answer(row["completion"]) is not None
    for row in data["prefs"] + data["prefs_eval"]:
        answer = GSM8K.demonstration_answer(row["chosen"])
        assert GSM8K.is_correct(row["chosen"], answer) and not GSM8K.is_correct(row["rejected"], answer)
        # The flaw is at the end: the same number of steps, the same first ones.
        chosen, rejected = row["chosen"].splitlines(), row["rejected"].splitlines()
        assert len(chosen) == len(rejected) and chosen[:-2] == rejected[:-2]
    for row in data["prm"]:
        assert len(row["completions"]) == len(row["labels"]) and row["completions"][-1].startswith("####")
        # Math-Shepherd: once a step is bad, every later one is.
        first_bad = row["labels"].index(False) if False in row["labels"] else len(row["labels"])
        assert row["labels"] == [True] * first_bad + [False] * (len(row["labels"]) - first_bad)
    for row in data["unpaired"]:
        answer = GSM8K.demonstration_answer(row["completion"])
        assert answer is not None
    for row in data["prompts"] + data["eval_dev"] + data["eval_test"] + data["eval_test_unseen"]:
        assert GSM8K.reference_answer(row["answer"]) == row["answer"]


def test_no_eval_problem_is_trained_on_and_the_held_out_family_is_in_no_training_table():
    data = generate_datasets(SMALL, seed=0)
    training = {r["prompt"] for name in ("sft", "prefs", "unpaired", "prm", "prompts") for r in data[name]}
    for suite in ("eval_dev", "eval_test", "eval_test_unseen"):
        assert not training & {r["prompt"] for r in data[suite]}
    assert {r["difficulty"] for r in data["eval_test_unseen"]} == set(HELDOUT_FAMILIES)
    # Dev and test hold every training family in equal shares (the difficulty column: the family).
    for suite in ("eval_dev", "eval_test"):
        families = [r["difficulty"] for r in data[suite]]
        assert {f: families.count(f) for f in TRAIN_FAMILIES} == {f: 10 for f in TRAIN_FAMILIES}
    # The held-out family's situation (paying with a bill, change) is in no training question.
    assert all("change" in r["prompt"] for r in data["eval_test_unseen"])
    assert not any("dollar" in prompt or "change" in prompt for prompt in training)


def test_flawed_solutions_by_hand():
    """A two-step problem: 6 boxes of 11, 27 given away: 6 * 11 = 66; 66 - 27 = 39.

    slip at step 1 (+1): 6 * 11 = 67, carried on: 67 - 27 = 40, answer 40: every step bad.
    operation at step 2: 66 + 27 = 93: step 1 good, step 2 and the answer bad.
    answer (-10): both steps good, `#### 29` bad."""
    problem = WordProblem("two_step", "q", (Step(6, "*", 11), Step(66, "-", 27, (0, None))))
    assert problem.solution() == "6 * 11 = 66\n66 - 27 = 39\n#### 39"

    class Fixed(random.Random):  # the first choice of the offsets list: -10, unless asked for +1
        def __init__(self, offset):
            super().__init__(0)
            self.offset = offset

        def choice(self, seq):
            return self.offset if isinstance(seq, list) else seq[0]

        def randrange(self, n):
            return 0

    assert flawed_solution(problem, Fixed(1), "slip") == ("6 * 11 = 67\n67 - 27 = 40\n#### 40", [False, False, False])
    assert flawed_solution(problem, Fixed(1), "operation", last_step=True) == (
        "6 * 11 = 66\n66 + 27 = 93\n#### 93",
        [True, False, False],
    )
    assert flawed_solution(problem, Fixed(-10), "answer") == ("6 * 11 = 66\n66 - 27 = 39\n#### 29", [True, True, False])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_solves_its_own_question(family):
    """The numbers of the question are the ones the solution computes with, and the
    result of a step that a later step reads is the one it reads."""
    rng = random.Random(7)
    for _ in range(30):
        problem = FAMILIES[family](rng)
        for index, step in enumerate(problem.steps):
            for value, source in zip((step.left, step.right), step.sources):
                if source is None:
                    assert str(value) in problem.question
                else:
                    assert source < index and problem.steps[source].result == value
        assert problem.answer >= 0 and GSM8K.is_correct(problem.solution(), problem.answer)


def test_prepare_writes_the_word_problems_as_conversations_and_checks_the_task(tmp_path):
    from stages.prepare import Config, run
    from tests.conftest import REPO

    config = Config(source="word_problems", word_problems={"sizes": {"sft": 40, "prefs": 20, "eval_dev": 12}})
    tables, origin = run(config, GSM8K)
    assert origin["sft"] == "word_problems"
    assert sorted(n for n in tables if n.startswith("eval_")) == ["eval_dev", "eval_test", "eval_test_unseen"]
    first = tables["sft"].iloc[0]
    assert first["prompt"][0]["role"] == "user" and first["completion"][0]["role"] == "assistant"
    assert tables["prompts"]["answer"].notna().all()  # given, each problem's answer
    plain, _ = run(Config(source="word_problems", word_problems={"chat": False, "sizes": {"sft": 10}}), GSM8K)
    assert isinstance(plain["sft"].iloc[0]["prompt"], str)

    import yaml

    import stages

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["prepare"]["source"] = "word_problems"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(stages.ParamsError, match="task.kind: 'builtin' cannot read the word problems' answers"):
        stages.load_all(str(path))
    params["task"]["kind"] = "gsm8k"
    # A gate test may read one family of the decision suite (its difficulty column).
    params["gate"]["tests"] = [{"metric": "accuracy", "relative_to": "sft", "op": ">", "difficulty": "change"}]
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(stages.ParamsError, match="suite 'dev' has no problem of difficulty change"):
        stages.load_all(str(path))
    params["gate"]["tests"][0]["difficulty"] = "three_step"
    path.write_text(yaml.safe_dump(params))
    assert stages.load_all(str(path))["prepare"].source == "word_problems"
