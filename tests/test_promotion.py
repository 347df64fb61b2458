"""The capability gate's rule (rlhf.evaluation.gate): tests against SFT, the champion or an
absolute bound, and the choice among candidates, on hand-built eval reports."""

from __future__ import annotations

import copy

import pytest

from rlhf.evaluation.gate import decide, run_test
from stages.capability_gate import CapabilityTest, Config

SFT = {"accuracy": 0.40, "format_rate": 0.98, "kl_to_ref": 0.0}
GOOD = {"accuracy": 0.55, "format_rate": 0.97, "kl_to_ref": 3.2}
BAD = {"accuracy": 0.30, "format_rate": 0.99, "kl_to_ref": 1.5}
REPORT = {
    "reference": "sft",
    "candidates": ["good", "bad"],
    # `seconds` sits beside the models in every suite of a real report (stages.evaluate).
    "suites": {"heldout": {"sft": SFT, "good": GOOD, "bad": BAD, "seconds": 12.5}},
}


def per_suite(metrics: dict) -> dict:
    return {"heldout": metrics}


def report_with(**candidates: dict) -> dict:
    report = copy.deepcopy(REPORT)
    report["candidates"] = list(candidates)
    report["suites"]["heldout"] = {"sft": SFT, **candidates, "seconds": 1.0}
    return report


ACCURACY_VS_SFT = CapabilityTest(metric="accuracy", relative_to="sft", op=">=", threshold=0.0)
ACCURACY_VS_CHAMPION = CapabilityTest(metric="accuracy", relative_to="champion", op=">=", threshold=0.0)
FORMAT = CapabilityTest(metric="format_rate", relative_to="absolute", op=">=", threshold=0.9)
KL = CapabilityTest(metric="kl_to_ref", relative_to="absolute", op="<=", threshold=10.0)


# ----------------------------------------------------------------------------- run_test


def test_worse_than_sft_fails_with_both_numbers():
    """bad 0.30 >= sft 0.40 + 0 is false: the reason gives 0.3000 and 0.4000."""
    result = run_test(ACCURACY_VS_SFT, per_suite(BAD), per_suite(SFT), None)
    assert not result.passed
    assert (result.value, result.baseline, result.bound) == (0.30, 0.40, 0.40)
    assert result.name == "accuracy[heldout] >= sft+0"
    assert result.reason == "0.3000 >= 0.4000 fails"


def test_better_than_sft_passes():
    """good 0.55 >= 0.40 + 0.1 = 0.50 passes; with threshold 0.2 the bound is 0.60 and fails."""
    test = CapabilityTest(metric="accuracy", relative_to="sft", threshold=0.1)
    result = run_test(test, per_suite(GOOD), per_suite(SFT), None)
    assert result.passed
    assert result.bound == pytest.approx(0.50)
    assert result.reason == "0.5500 >= 0.5000"
    stricter = CapabilityTest(metric="accuracy", relative_to="sft", threshold=0.2)
    result = run_test(stricter, per_suite(GOOD), per_suite(SFT), None)
    assert not result.passed
    assert result.reason == "0.5500 >= 0.6000 fails"


def test_a_candidate_exactly_on_the_bound_passes():
    """sft 0.40, threshold -0.05: the bound is 0.35, and a candidate at 0.35 (7 of 20) is
    on it, so `>=` passes and `>` fails — although 0.40 + (-0.05) is 0.35000000000000003
    in floating point."""
    candidate = per_suite({"accuracy": 7 / 20})
    at_least = CapabilityTest(metric="accuracy", relative_to="sft", op=">=", threshold=-0.05)
    above = CapabilityTest(metric="accuracy", relative_to="sft", op=">", threshold=-0.05)
    assert run_test(at_least, candidate, per_suite(SFT), None).passed
    assert not run_test(above, candidate, per_suite(SFT), None).passed
    assert run_test(at_least, candidate, per_suite(SFT), None).name == "accuracy[heldout] >= sft-0.05"


def test_equal_to_sft():
    """0.40 vs 0.40: `>=` and `<=` pass, `>` and `<` fail."""
    same = per_suite(dict(SFT))
    outcomes = {
        op: run_test(CapabilityTest(metric="accuracy", relative_to="sft", op=op), same, per_suite(SFT), None).passed
        for op in (">=", "<=", ">", "<")
    }
    assert outcomes == {">=": True, "<=": True, ">": False, "<": False}


def test_absolute_bounds():
    """format_rate 0.97 >= 0 + 0.9 passes; kl_to_ref 3.2 <= 0 + 10 passes, <= 2 fails."""
    assert run_test(FORMAT, per_suite(GOOD), per_suite(SFT), None).passed
    result = run_test(KL, per_suite(GOOD), per_suite(SFT), None)
    assert result.passed and result.baseline == 0.0 and result.bound == 10.0
    tight = CapabilityTest(metric="kl_to_ref", op="<=", threshold=2.0)
    result = run_test(tight, per_suite(GOOD), per_suite(SFT), None)
    assert not result.passed
    assert result.reason == "3.2000 <= 2.0000 fails"


def test_relative_to_champion():
    """The champion's recorded accuracy is the baseline, not SFT's: good 0.55 passes
    against SFT 0.40 but fails against a champion at 0.60, and passes against one at 0.50."""
    result = run_test(ACCURACY_VS_CHAMPION, per_suite(GOOD), per_suite(SFT), per_suite({"accuracy": 0.60}))
    assert not result.passed
    assert result.baseline == 0.60
    assert result.reason == "0.5500 >= 0.6000 fails"
    assert run_test(ACCURACY_VS_CHAMPION, per_suite(GOOD), per_suite(SFT), per_suite({"accuracy": 0.50})).passed


def test_relative_to_champion_without_a_champion():
    """No champion yet: nothing to regress from, so even bad (0.30) passes, and no
    baseline is recorded."""
    result = run_test(ACCURACY_VS_CHAMPION, per_suite(BAD), per_suite(SFT), None)
    assert result.passed
    assert result.baseline is None
    assert "no champion yet" in result.reason


def test_champion_without_the_metric_is_not_compared():
    result = run_test(ACCURACY_VS_CHAMPION, per_suite(BAD), per_suite(SFT), {"other_suite": {"accuracy": 0.9}})
    assert result.passed
    assert result.reason == "champion has no recorded 'accuracy' on 'heldout': not compared"


def test_missing_metric_fails():
    """A metric the report does not have, or a suite it does not have, fails the test."""
    result = run_test(CapabilityTest(metric="win_rate", op=">=", threshold=0.5), per_suite(GOOD), per_suite(SFT), None)
    assert not result.passed
    assert result.value is None
    assert result.reason == "metric 'win_rate' missing for suite 'heldout' in the eval report"
    other_suite = CapabilityTest(metric="accuracy", suite="gsm8k")
    assert not run_test(other_suite, per_suite(GOOD), per_suite(SFT), None).passed
    # `accuracy: None` (a suite without answers) counts as missing, not as 0.
    assert not run_test(ACCURACY_VS_SFT, per_suite({"accuracy": None}), per_suite(SFT), None).passed


def test_reference_without_the_metric_fails():
    result = run_test(ACCURACY_VS_SFT, per_suite(GOOD), per_suite({"format_rate": 1.0}), None)
    assert not result.passed
    assert result.reason == "reference has no 'accuracy' on suite 'heldout'"


# ----------------------------------------------------------------------------- decide


def test_default_tests_reject_the_candidate_worse_than_sft():
    """Default tests: accuracy >= sft, accuracy >= champion (none yet), format_rate >= 0.9,
    kl_to_ref <= 10. good (0.55, 0.97, 3.2) passes all four; bad (0.30, 0.99, 1.5) fails
    only the first, 0.30 < 0.40."""
    verdict = decide(Config().tests, REPORT, None, "accuracy", "heldout")
    assert verdict["promote"] == "good"
    assert verdict["metrics"] == {"heldout": GOOD}
    assert verdict["candidates"]["good"]["passed"]
    assert verdict["candidates"]["good"]["failures"] == []
    bad = verdict["candidates"]["bad"]
    assert not bad["passed"]
    assert bad["failures"] == ["accuracy[heldout] >= sft+0: 0.3000 >= 0.4000 fails"]
    assert [t["passed"] for t in bad["tests"]] == [False, True, True, True]
    assert bad["tests"][0]["value"] == 0.30 and bad["tests"][0]["baseline"] == 0.40


def test_the_better_of_two_passing_candidates_is_promoted():
    """Both beat SFT (0.40); `best` (0.62) beats `good` (0.55) on accuracy, whichever is
    listed first. Selected on format_rate instead, good (0.97) beats best (0.95)."""
    best = {"accuracy": 0.62, "format_rate": 0.95, "kl_to_ref": 4.0}
    tests = [ACCURACY_VS_SFT, FORMAT, KL]
    for order in (("good", "best"), ("best", "good")):
        report = report_with(**{name: {"good": GOOD, "best": best}[name] for name in order})
        verdict = decide(tests, report, None, "accuracy", "heldout")
        assert verdict["promote"] == "best"
        assert verdict["metrics"] == {"heldout": best}
        assert all(verdict["candidates"][name]["passed"] for name in order)
    assert decide(tests, report, None, "format_rate", "heldout")["promote"] == "good"


def test_a_better_but_failing_candidate_is_not_promoted():
    """`sloppy` has the highest accuracy (0.70) but a format rate of 0.80 < 0.9: only
    good is promotable, so good wins."""
    sloppy = {"accuracy": 0.70, "format_rate": 0.80, "kl_to_ref": 2.0}
    verdict = decide([ACCURACY_VS_SFT, FORMAT], report_with(sloppy=sloppy, good=GOOD), None, "accuracy", "heldout")
    assert verdict["promote"] == "good"
    assert verdict["candidates"]["sloppy"]["failures"] == [
        "format_rate[heldout] >= absolute+0.9: 0.8000 >= 0.9000 fails"
    ]


def test_champion_blocks_a_regression():
    """Champion recorded at 0.58: good (0.55) is above SFT but below the champion, so it
    is rejected and nothing is promoted — the champion stays."""
    champion = {"heldout": {"accuracy": 0.58, "format_rate": 0.99}}
    verdict = decide(Config().tests, report_with(good=GOOD), champion, "accuracy", "heldout")
    assert verdict["promote"] is None
    assert verdict["metrics"] is None
    assert verdict["candidates"]["good"]["failures"] == ["accuracy[heldout] >= champion+0: 0.5500 >= 0.5800 fails"]


def test_nothing_promoted_when_no_candidate_passes():
    """bad fails accuracy >= sft (0.30 < 0.40); worse fails it too (0.35 < 0.40) and also
    kl_to_ref <= 10 (12.0 > 10): every failure is listed."""
    worse = {"accuracy": 0.35, "format_rate": 0.95, "kl_to_ref": 12.0}
    verdict = decide(Config().tests, report_with(bad=BAD, worse=worse), None, "accuracy", "heldout")
    assert verdict["promote"] is None
    assert verdict["metrics"] is None
    assert not any(v["passed"] for v in verdict["candidates"].values())
    assert verdict["candidates"]["worse"]["failures"] == [
        "accuracy[heldout] >= sft+0: 0.3500 >= 0.4000 fails",
        "kl_to_ref[heldout] <= absolute+10: 12.0000 <= 10.0000 fails",
    ]


def test_a_candidate_missing_a_metric_is_not_promoted():
    """`partial` has accuracy 0.9 but no format_rate in the report: format_rate >= 0.9
    fails as missing, so good (all metrics present) is promoted."""
    partial = {"accuracy": 0.9, "kl_to_ref": 1.0}
    verdict = decide(Config().tests, report_with(partial=partial, good=GOOD), None, "accuracy", "heldout")
    assert verdict["promote"] == "good"
    assert verdict["candidates"]["partial"]["failures"] == [
        "format_rate[heldout] >= absolute+0.9: metric 'format_rate' missing for suite 'heldout' in the eval report"
    ]


def test_named_test_in_failures():
    """A test's `name` labels its failure line."""
    test = CapabilityTest(name="no regression", metric="accuracy", relative_to="sft")
    verdict = decide([test], REPORT, None, "accuracy", "heldout")
    assert verdict["candidates"]["bad"]["failures"] == ["no regression: 0.3000 >= 0.4000 fails"]
