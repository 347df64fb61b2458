"""PRM-guided critique and refine (rlhf.inference.refine) with a real micro model.

The model is the built-in micro Llama trained for about two seconds on one
problem, 12+7-3, with two solutions written one step a line, each step after a leading
space: the right one and one with a slip in its first step carried forward. It then samples
either solution from the prompt alone, and after a right first step always the right rest:
a solution whose first bad step comes late is repaired from its prefix, one whose first
step is bad is repaired by sampling afresh, and a solution of a problem it never saw is not
repaired. The critic is a stand-in PRM with the built-in task's exact step checker
(Math-Shepherd labels: a step is bad from the first mistake on), so which step is bad,
and which candidate passes, follows a rule the tests can count by hand."""

from __future__ import annotations

import json

import pytest

from rlhf.inference import refine as refine_module
from rlhf.inference.refine import KEPT, REPAIRED, UNREPAIRED, Refinement, first_bad_step, refine, repair_report
from rlhf.models.loading import build_tiny_model, build_tokenizer
from rlhf.rewards.steps import StepScorer
from rlhf.tasks import arithmetic
from rlhf.tasks.base import Task
from tests.conftest import fit_texts

PROBLEM = "12+7-3\n"
GOOD = " 12+7=19\n 19-3=16\n answer 16"
BAD = " 12+7=18\n 18-3=15\n answer 15"  # first step wrong (empty prefix)
LATE_SLIP = " 12+7=19\n 19-3=15\n answer 15"  # second step wrong: prefix " 12+7=19\n"
WRONG_ANSWER = " 12+7=19\n 19-3=16\n answer 15"  # only the stated answer wrong
UNSEEN = "4+4+4+4\n"
UNSEEN_WRONG = " 4+4=9\n 9+4=13\n 13+4=17\n answer 17"
BUDGET = 40  # tokens: the longest continuation (28 characters) and its end token
ATTEMPTS = 8  # a fresh sample is the right solution about half the time


class LineArithmetic(Task):
    """The built-in problems with one step a line (the base task's separator: a leading
    space stays part of its step), answers checked as the built-in task checks them."""

    name = "line_arithmetic"

    def is_correct(self, completion: str, answer) -> bool:
        return arithmetic.is_correct(completion, answer)


class CheckedSteps(StepScorer):
    """A stand-in PRM: P(good) 1.0 for each step the built-in task's exact checker labels
    good, else 0.0. Records each call's step lists."""

    separator = "\n"

    def __init__(self):
        self.calls: list[list[list[str]]] = []

    def score_steps(self, prompts, steps, batch_size=64):
        self.calls.append([list(s) for s in steps])
        return [
            [float(label) for label in arithmetic.check_steps(p, "; ".join(step.strip() for step in s))]
            for p, s in zip(prompts, steps)
        ]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """The micro model trained (full batch, Adam) on PROBLEM + GOOD and PROBLEM + BAD until
    its loss is within 0.01 of the floor: the two texts share everything but the choice of
    first result, so the loss cannot fall below log 2 over their 35 predicted tokens each,
    about 0.02. Near that floor it has learnt both solutions whole (a stop at a step count
    instead left some initialisations mixing their steps)."""
    model = build_tiny_model("micro", tokenizer, seed=0)
    texts = [PROBLEM + c + tokenizer.eos_token for c in (GOOD, BAD)]
    loss = fit_texts(model, tokenizer, texts, 800, lr=5e-3, stop_below=0.03)
    assert loss < 0.03, f"the micro model did not learn the two solutions (loss {loss:.3f})"
    return model


@pytest.fixture
def sampled(monkeypatch):
    """Records every call of the sampler refine uses: (prefix texts, attempts)."""
    calls = []
    real = refine_module.sample

    def recording(model, tokenizer, prompts, n, *args):
        calls.append((list(prompts), n))
        return real(model, tokenizer, prompts, n, *args)

    monkeypatch.setattr(refine_module, "sample", recording)
    return calls


def test_first_bad_step_is_the_first_score_below_the_threshold():
    """[0.9, 0.7, 0.2, 0.1] at 0.5: step 2 (0.2) is the first below; at 0.75, step 1 (0.7).
    A score equal to the threshold is not below it. None bad: None; no steps: None; first
    step bad: 0."""
    assert first_bad_step([0.9, 0.7, 0.2, 0.1], 0.5) == 2
    assert first_bad_step([0.9, 0.7, 0.2, 0.1], 0.75) == 1
    assert first_bad_step([0.5, 0.5], 0.5) is None
    assert first_bad_step([0.9, 0.8, 1.0], 0.5) is None
    assert first_bad_step([], 0.5) is None
    assert first_bad_step([0.1, 0.9, 0.9], 0.5) == 0


def test_refine_regenerates_from_the_step_before_the_first_error(model, tokenizer, sampled):
    """Five samples: GOOD (every step good: kept, untouched, no candidates), BAD (step 0
    bad: empty prefix), LATE_SLIP (step 1 bad: prefix " 12+7=19\\n"), WRONG_ANSWER (step 2
    bad: prefix " 12+7=19\\n 19-3=16\\n") and a wrong solution of a problem the model never
    saw (step 0 bad). The flagged four are sampled in one call, 8 attempts each, from
    prompt + prefix exactly; every candidate starts with its prefix, leading spaces kept.
    The first three are repaired to GOOD (every step good, the bad steps gone); no
    candidate for the unseen problem passes the checker: unrepaired."""
    prm, task = CheckedSteps(), LineArithmetic()
    prompts = [PROBLEM] * 4 + [UNSEEN]
    completions = [GOOD, BAD, LATE_SLIP, WRONG_ANSWER, UNSEEN_WRONG]
    results = refine(model, tokenizer, prm, task, prompts, completions, max_new_tokens=BUDGET, attempts=ATTEMPTS)

    prefixes = ["", " 12+7=19\n", " 12+7=19\n 19-3=16\n", ""]
    assert [r.bad_step for r in results] == [None, 0, 1, 2, 0]
    assert [r.prefix for r in results] == [None, *prefixes]
    assert sampled == [([p + prefix for p, prefix in zip(prompts[1:], prefixes)], ATTEMPTS)]
    assert len(prm.calls) == 2, "the originals in one call, every candidate in one more"

    kept = results[0]
    assert (kept.status, kept.original, kept.refined, kept.candidates) == (KEPT, GOOD, None, [])
    assert kept.scores == [1.0, 1.0, 1.0]
    for result, prefix in zip(results[1:], prefixes):
        assert len(result.candidates) == ATTEMPTS == len(result.candidate_scores)
        assert all(c.startswith(prefix) for c in result.candidates)
        assert 0.0 in result.scores and result.scores[result.bad_step] == 0.0
    for result in results[1:4]:
        assert result.status == REPAIRED and result.refined == GOOD
        assert result.refined in result.candidates and result.refined_scores == [1.0, 1.0, 1.0]
        assert (
            task.split_steps(result.refined)[: result.bad_step] == task.split_steps(result.original)[: result.bad_step]
        )
    unrepaired = results[4]
    assert (unrepaired.status, unrepaired.refined, unrepaired.refined_scores) == (UNREPAIRED, None, None)
    assert max(unrepaired.candidate_scores) < 0.5
    # No answers given: nothing is recorded as right or wrong.
    assert all(r.original_correct is None and r.refined_correct is None for r in results)


def test_refine_records_correctness_and_the_report_counts_it(model, tokenizer):
    """The same samples with their answers (16 for 12+7-3, None for the unseen problem:
    unknown). Correctness is recorded, selection is unchanged. Hand count: 5 samples, 1
    kept, 4 flagged (0.8), 3 repaired, 1 unrepaired (3/4 of flagged); checked 4 (the
    unseen one has no answer), wrong 3 (BAD, LATE_SLIP, WRONG_ANSWER), all 3 flagged and
    repaired right: share 1.0, no false repairs (0 of 3)."""
    prompts = [PROBLEM] * 4 + [UNSEEN]
    completions = [GOOD, BAD, LATE_SLIP, WRONG_ANSWER, UNSEEN_WRONG]
    answers = ["16"] * 4 + [None]
    task = LineArithmetic()
    settings = {"max_new_tokens": BUDGET, "attempts": ATTEMPTS}
    results = refine(model, tokenizer, CheckedSteps(), task, prompts, completions, answers=answers, **settings)
    blind = refine(model, tokenizer, CheckedSteps(), task, prompts, completions, **settings)
    assert [(r.status, r.refined) for r in results] == [(r.status, r.refined) for r in blind]
    assert [(r.original_correct, r.refined_correct) for r in results] == [
        (True, None),
        (False, True),
        (False, True),
        (False, True),
        (None, None),
    ]
    expected = {
        "samples": 5,
        "kept": 1,
        "flagged": 4,
        "flagged_share": 0.8,
        "repaired": 3,
        "unrepaired": 1,
        "repaired_share_of_flagged": 0.75,
        "checked": 4,
        "wrong_samples": 3,
        "wrong_flagged": 3,
        "wrong_repaired": 3,
        "share_of_wrong_repaired": 1.0,
        "false_repairs": 0,
        "false_repair_share": 0.0,
    }
    assert repair_report(results) == expected
    # The blind results checked afterwards against the same answers: the same report.
    assert repair_report(blind, answers, task) == expected


def test_refine_with_the_builtin_task_and_an_untrained_model(tokenizer, sampled):
    """The built-in task (steps joined by "; "), an untrained micro model (it writes
    gibberish): a right solution is kept; a slip in step 1 is regenerated from
    "12+7=19; " and nothing the model writes passes the checker (unrepaired), every
    candidate still starting with that prefix. A PRM whose separator is not the task's is
    refused."""
    task = arithmetic.ArithmeticTask()
    prm = CheckedSteps()
    prm.separator = task.step_separator
    model = build_tiny_model("micro", tokenizer, seed=0).eval()
    good, slip = "12+7=19; 19-3=16; answer 16", "12+7=19; 19-3=15; answer 15"
    results = refine(model, tokenizer, prm, task, [PROBLEM] * 2, [good, slip], max_new_tokens=12, attempts=3)
    assert (results[0].status, results[0].refined) == (KEPT, None)
    assert (results[1].status, results[1].bad_step, results[1].prefix) == (UNREPAIRED, 1, "12+7=19; ")
    assert sampled == [([PROBLEM + "12+7=19; "], 3)]
    assert len(results[1].candidates) == 3 and all(c.startswith("12+7=19; ") for c in results[1].candidates)
    with pytest.raises(ValueError, match="splits steps on"):
        refine(model, tokenizer, CheckedSteps(), task, [PROBLEM], [slip], max_new_tokens=12)


def test_repair_report_shares_on_hand_made_results():
    """Eight results, answer "16" for each; right = the text states 16.
    kept right, kept wrong, repaired wrong->right, repaired wrong->right, repaired
    wrong->wrong (a false repair), repaired right->wrong (a false repair), unrepaired
    wrong, unrepaired right.
    flagged 6 of 8 (0.75); repaired 4 of 6 flagged (2/3); wrong originals: kept wrong,
    three repaired wrong, unrepaired wrong = 5, of which 4 flagged and 2 repaired right:
    share 2/5 = 0.4; false repairs 2 of 4 repairs (0.5). Without answers or recorded
    correctness the report holds the counts alone; a task that checks no answers adds
    nothing either; answers without a task are an error."""
    right, wrong = "answer 16", "answer 15"

    def made(status, original, refined=None):
        return Refinement(original=original, status=status, scores=[], refined=refined)

    results = [
        made(KEPT, right),
        made(KEPT, wrong),
        made(REPAIRED, wrong, right),
        made(REPAIRED, wrong, right),
        made(REPAIRED, wrong, wrong),
        made(REPAIRED, right, wrong),
        made(UNREPAIRED, wrong),
        made(UNREPAIRED, right),
    ]
    answers = ["16"] * len(results)
    report = repair_report(results, answers, arithmetic.ArithmeticTask())
    counts = {
        "samples": 8,
        "kept": 2,
        "flagged": 6,
        "flagged_share": 0.75,
        "repaired": 4,
        "unrepaired": 2,
        "repaired_share_of_flagged": pytest.approx(2 / 3),
    }
    assert report == {
        **counts,
        "checked": 8,
        "wrong_samples": 5,
        "wrong_flagged": 4,
        "wrong_repaired": 2,
        "share_of_wrong_repaired": 0.4,
        "false_repairs": 2,
        "false_repair_share": 0.5,
    }
    assert json.loads(json.dumps(report)) == report
    assert repair_report(results) == counts
    none_task = Task()
    none_task.checks_answers = False
    assert repair_report(results, answers, none_task) == counts
    with pytest.raises(ValueError, match="needs the task"):
        repair_report(results, answers)
    empty = repair_report([])
    assert empty["samples"] == 0 and empty["flagged_share"] is None and empty["repaired_share_of_flagged"] is None
