"""The capability gate's rule (rlhf.evaluation.gate): tests against SFT, the champion or an
absolute bound, and the choice among candidates, on hand-built eval reports — first with
point estimates only (no per-problem outcomes), then as paired bootstrap tests on
hand-built per-problem outcomes (reports/outcomes.json) and champion records."""

from __future__ import annotations

import copy

import pytest

from rlhf.evaluation.gate import Paired, decide, paired_outcomes, run_test
from rlhf.tasks.arithmetic import ArithmeticTask
from rlhf.tracking.champion import install_champion, read_champion
from stages import gate
from stages.gate import Config, champion_outcomes, resolve
from stages.gate import run as run_gate


def CapabilityTest(**fields) -> gate.CapabilityTest:  # noqa: N802 (a test on suite dev by default)
    return gate.CapabilityTest(**{"suite": "dev", **fields})


def default_config() -> Config:
    """The gate's defaults resolved for the built-in task, on suite dev."""
    return resolve(Config(), ArithmeticTask(), "dev")


SFT = {"accuracy": 0.40, "format_rate": 0.98, "kl_to_ref": 0.0}
GOOD = {"accuracy": 0.55, "format_rate": 0.97, "kl_to_ref": 3.2}
BAD = {"accuracy": 0.30, "format_rate": 0.99, "kl_to_ref": 1.5}
REPORT = {
    "reference": "sft",
    "candidates": ["good", "bad"],
    # A key of a suite that names no model is ignored (older reports had `seconds` here).
    "suites": {"dev": {"sft": SFT, "good": GOOD, "bad": BAD, "seconds": 12.5}},
}


def per_suite(metrics: dict) -> dict:
    return {"dev": metrics}


def report_with(**candidates: dict) -> dict:
    report = copy.deepcopy(REPORT)
    report["candidates"] = list(candidates)
    report["suites"]["dev"] = {"sft": SFT, **candidates, "seconds": 1.0}
    return report


ACCURACY_VS_SFT = CapabilityTest(metric="accuracy", relative_to="sft", op=">=", threshold=0.0)
ACCURACY_VS_CHAMPION = CapabilityTest(metric="accuracy", relative_to="champion", op=">=", threshold=0.0)
FORMAT = CapabilityTest(metric="format_rate", relative_to="absolute", op=">=", threshold=0.9)
KL = CapabilityTest(metric="kl_to_ref", relative_to="absolute", op="<=", threshold=10.0)
# Appended to the reason of a relative test that compared point estimates.
POINT = " (point estimates: no per-problem outcomes to pair)"


def record(metrics: dict, candidate: str = "old", **fields) -> dict:
    """A champion record as stages.gate.promote writes it (metrics per suite)."""
    return {"candidate": candidate, "metrics": {"dev": metrics}, **fields}


# ----------------------------------------------------------------------------- run_test


def test_worse_than_sft_fails_with_both_numbers():
    """bad 0.30 >= sft 0.40 + 0 is false: the reason gives 0.3000 and 0.4000 and says that
    point estimates were compared (no per-problem outcomes were given)."""
    result = run_test(ACCURACY_VS_SFT, per_suite(BAD), per_suite(SFT), None)
    assert not result.passed
    assert (result.value, result.baseline, result.bound) == (0.30, 0.40, 0.40)
    assert result.name == "accuracy[dev] >= sft+0"
    assert result.reason == "0.3000 >= 0.4000 fails" + POINT
    assert result.difference is None and result.interval is None


def test_better_than_sft_passes():
    """good 0.55 >= 0.40 + 0.1 = 0.50 passes; with threshold 0.2 the bound is 0.60 and fails."""
    test = CapabilityTest(metric="accuracy", relative_to="sft", threshold=0.1)
    result = run_test(test, per_suite(GOOD), per_suite(SFT), None)
    assert result.passed
    assert result.bound == pytest.approx(0.50)
    assert result.reason == "0.5500 >= 0.5000" + POINT
    stricter = CapabilityTest(metric="accuracy", relative_to="sft", threshold=0.2)
    result = run_test(stricter, per_suite(GOOD), per_suite(SFT), None)
    assert not result.passed
    assert result.reason == "0.5500 >= 0.6000 fails" + POINT


def test_a_candidate_exactly_on_the_bound_passes():
    """sft 0.40, threshold -0.05: the bound is 0.35, and a candidate at 0.35 (7 of 20) is
    on it, so `>=` passes and `>` fails — although 0.40 + (-0.05) is 0.35000000000000003
    in floating point."""
    candidate = per_suite({"accuracy": 7 / 20})
    at_least = CapabilityTest(metric="accuracy", relative_to="sft", op=">=", threshold=-0.05)
    above = CapabilityTest(metric="accuracy", relative_to="sft", op=">", threshold=-0.05)
    assert run_test(at_least, candidate, per_suite(SFT), None).passed
    assert not run_test(above, candidate, per_suite(SFT), None).passed
    assert run_test(at_least, candidate, per_suite(SFT), None).name == "accuracy[dev] >= sft-0.05"


def test_equal_to_sft():
    """0.40 vs 0.40: `>=` and `<=` pass, `>` and `<` fail."""
    same = per_suite(dict(SFT))
    outcomes = {
        op: run_test(CapabilityTest(metric="accuracy", relative_to="sft", op=op), same, per_suite(SFT), None).passed
        for op in (">=", "<=", ">", "<")
    }
    assert outcomes == {">=": True, "<=": True, ">": False, "<": False}


def test_absolute_bounds():
    """format_rate 0.97 >= 0 + 0.9 passes; kl_to_ref 3.2 <= 0 + 10 passes, <= 2 fails. An
    absolute test has no baseline to pair with, so its reason has no point-estimate note."""
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
    assert run_test(ACCURACY_VS_SFT, per_suite(GOOD), per_suite(SFT), None).passed
    result = run_test(ACCURACY_VS_CHAMPION, per_suite(GOOD), per_suite(SFT), per_suite({"accuracy": 0.60}))
    assert not result.passed
    assert result.baseline == 0.60
    assert result.reason == "0.5500 >= 0.6000 fails" + POINT
    assert run_test(ACCURACY_VS_CHAMPION, per_suite(GOOD), per_suite(SFT), per_suite({"accuracy": 0.50})).passed


def test_relative_to_champion_without_a_champion():
    """No champion yet: nothing to regress from, so even bad (0.30) passes, and no
    baseline is recorded."""
    result = run_test(ACCURACY_VS_CHAMPION, per_suite(BAD), per_suite(SFT), None)
    assert result.passed
    assert result.baseline is None
    assert "no champion yet" in result.reason


def test_champion_without_the_metric_is_not_compared():
    """A champion with accuracy recorded only on another suite is not compared: passes."""
    result = run_test(ACCURACY_VS_CHAMPION, per_suite(BAD), per_suite(SFT), {"other_suite": {"accuracy": 0.9}})
    assert result.passed
    assert result.reason == "champion has no recorded 'accuracy' on 'dev': not compared"


def test_missing_metric_fails():
    """A metric the report does not have, or a suite it does not have, fails the test."""
    result = run_test(CapabilityTest(metric="win_rate", op=">=", threshold=0.5), per_suite(GOOD), per_suite(SFT), None)
    assert not result.passed
    assert result.value is None
    assert result.reason == "metric 'win_rate' missing for suite 'dev' in the eval report"
    other_suite = CapabilityTest(metric="accuracy", suite="gsm8k")
    assert not run_test(other_suite, per_suite(GOOD), per_suite(SFT), None).passed
    # `accuracy: None` (a suite without answers) counts as missing, not as 0.
    assert not run_test(ACCURACY_VS_SFT, per_suite({"accuracy": None}), per_suite(SFT), None).passed


def test_reference_without_the_metric_fails():
    """An SFT entry without accuracy fails an accuracy-vs-SFT test, and says so."""
    result = run_test(ACCURACY_VS_SFT, per_suite(GOOD), per_suite({"format_rate": 1.0}), None)
    assert not result.passed
    assert result.reason == "reference has no 'accuracy' on suite 'dev'"


# ----------------------------------------------------------------------------- decide


def test_default_tests_reject_the_candidate_worse_than_sft():
    """Default tests: accuracy > sft + 0, accuracy > champion + 0.01 (none yet),
    format_rate >= 0.9, kl_to_ref <= 10, all on dev. good (0.55, 0.97, 3.2) passes all
    four; bad (0.30, 0.99, 1.5) fails only the first, 0.30 < 0.40."""
    assert [t.suite for t in default_config().tests] == ["dev"] * 4
    verdict = decide(default_config().tests, REPORT, None, "accuracy", "dev")
    assert verdict["promote"] == "good"
    assert verdict["metrics"] == {"dev": GOOD}
    assert verdict["candidates"]["good"]["passed"]
    assert verdict["candidates"]["good"]["failures"] == []
    bad = verdict["candidates"]["bad"]
    assert not bad["passed"]
    assert bad["failures"] == ["accuracy[dev] > sft+0: 0.3000 > 0.4000 fails" + POINT]
    assert [t["passed"] for t in bad["tests"]] == [False, True, True, True]
    assert bad["tests"][0]["value"] == 0.30 and bad["tests"][0]["baseline"] == 0.40


def test_the_better_of_two_passing_candidates_is_promoted():
    """Both beat SFT (0.40); `best` (0.62) beats `good` (0.55) on accuracy, whichever is
    listed first. Selected on format_rate instead, good (0.97) beats best (0.95)."""
    best = {"accuracy": 0.62, "format_rate": 0.95, "kl_to_ref": 4.0}
    tests = [ACCURACY_VS_SFT, FORMAT, KL]
    for order in (("good", "best"), ("best", "good")):
        report = report_with(**{name: {"good": GOOD, "best": best}[name] for name in order})
        verdict = decide(tests, report, None, "accuracy", "dev")
        assert verdict["promote"] == "best"
        assert verdict["metrics"] == {"dev": best}
        assert all(verdict["candidates"][name]["passed"] for name in order)
    assert decide(tests, report, None, "format_rate", "dev")["promote"] == "good"


def test_a_selection_metric_a_passing_candidate_lacks_is_an_input_error():
    """The message alone says what to fix (a stage prints it, not a traceback)."""
    from rlhf.params import InputError

    with pytest.raises(
        ValueError, match=r"gate.select_metric 'win_rate' on suite 'dev' is missing for \['good'\]"
    ) as error:
        decide([ACCURACY_VS_SFT], report_with(good=GOOD), None, "win_rate", "dev")
    assert isinstance(error.value, InputError)


def test_a_better_but_failing_candidate_is_not_promoted():
    """`sloppy` has the highest accuracy (0.70) but a format rate of 0.80 < 0.9: only
    good is promotable, so good wins."""
    sloppy = {"accuracy": 0.70, "format_rate": 0.80, "kl_to_ref": 2.0}
    verdict = decide([ACCURACY_VS_SFT, FORMAT], report_with(sloppy=sloppy, good=GOOD), None, "accuracy", "dev")
    assert verdict["promote"] == "good"
    assert verdict["candidates"]["sloppy"]["failures"] == ["format_rate[dev] >= absolute+0.9: 0.8000 >= 0.9000 fails"]


def test_champion_blocks_a_regression():
    """Champion recorded at 0.58 (a record without per-problem outcomes): good (0.55) is
    above SFT but not above the champion + 0.01 = 0.59, so it is rejected and nothing is
    promoted — the champion stays."""
    champion = record({"accuracy": 0.58, "format_rate": 0.99})
    verdict = decide(default_config().tests, report_with(good=GOOD), champion, "accuracy", "dev")
    assert verdict["promote"] is None
    assert verdict["metrics"] is None
    assert verdict["candidates"]["good"]["failures"] == ["accuracy[dev] > champion+0.01: 0.5500 > 0.5900 fails" + POINT]


def test_a_champion_scored_by_another_reward_model_is_not_compared_on_its_scores():
    """A task without answers gates on the RM's reward. The champion's reward (5.0) was
    scored by RM version rm-1; the RM has since been retrained (rm-2, another scale: the
    candidate's reward is 1.2). The reward test against the champion is not compared (it
    passes, saying why), the tests measured in this run against SFT still decide, and the
    promoted record keeps this run's scorer versions. With the same RM version the champion
    blocks the candidate, as before; a record without versions (older) is compared."""
    tests = resolve(Config(), capability_gate_task_without_answers(), "dev").tests
    sft = {"reward": 0.4, "reward_std": 0.1, "win_rate": 0.5, "kl_to_ref": 0.0}
    good = {"reward": 1.2, "reward_std": 0.1, "win_rate": 0.7, "kl_to_ref": 2.0}
    report = {"reference": "sft", "candidates": ["good"], "suites": {"dev": {"sft": sft, "good": good}}}
    report["scorers"] = {"rm": "rm-2", "reference": "sft-1"}
    champion = record({"reward": 5.0, "win_rate": 0.9}, scorers={"rm": "rm-1", "reference": "sft-1"})
    verdict = decide(tests, report, champion, "reward", "dev")
    assert verdict["promote"] == "good" and verdict["scorers"] == report["scorers"]
    (vs_champion,) = [t for t in verdict["candidates"]["good"]["tests"] if t["name"] == "reward[dev] > champion+0.01"]
    assert vs_champion["passed"] and vs_champion["reason"] == (
        "not compared: the champion's 'reward' on 'dev' (5.0000) was scored by another version of the reward "
        "model (models/rm), which has changed since its promotion"
    )
    same_rm = record({"reward": 5.0}, scorers={"rm": "rm-2", "reference": "sft-1"})
    assert decide(tests, report, same_rm, "reward", "dev")["promote"] is None
    assert decide(tests, report, record({"reward": 5.0}), "reward", "dev")["promote"] is None
    both = CapabilityTest(metric="win_rate", relative_to="champion", op=">=", threshold=0.0)
    moved = record({"win_rate": 0.9}, scorers={"rm": "rm-1", "reference": "sft-0"})
    (result,) = decide([both], report, moved, "reward", "dev")["candidates"]["good"]["tests"]
    assert result["passed"] and "the reward model (models/rm) and the reference model (models/sft)" in result["reason"]


def capability_gate_task_without_answers():
    from rlhf.tasks import TaskConfig, get_task

    return get_task(TaskConfig(kind="none"))


def test_the_default_minimum_effect_over_the_champion():
    """accuracy > champion + 0.01 by default: good (0.55) is not promoted over a champion
    at 0.545 (0.55 > 0.555 is false: half a point is not enough) but is over one at 0.53
    (0.55 > 0.54)."""
    report = report_with(good=GOOD)
    assert decide(default_config().tests, report, record({"accuracy": 0.545}), "accuracy", "dev")["promote"] is None
    assert decide(default_config().tests, report, record({"accuracy": 0.53}), "accuracy", "dev")["promote"] == "good"


def test_nothing_promoted_when_no_candidate_passes():
    """bad fails accuracy >= sft (0.30 < 0.40); worse fails it too (0.35 < 0.40) and also
    kl_to_ref <= 10 (12.0 > 10): every failure is listed."""
    worse = {"accuracy": 0.35, "format_rate": 0.95, "kl_to_ref": 12.0}
    verdict = decide(default_config().tests, report_with(bad=BAD, worse=worse), None, "accuracy", "dev")
    assert verdict["promote"] is None
    assert verdict["metrics"] is None
    assert not any(v["passed"] for v in verdict["candidates"].values())
    assert verdict["candidates"]["worse"]["failures"] == [
        "accuracy[dev] > sft+0: 0.3500 > 0.4000 fails" + POINT,
        "kl_to_ref[dev] <= absolute+10: 12.0000 <= 10.0000 fails",
    ]


def test_a_candidate_missing_a_metric_is_not_promoted():
    """`partial` has accuracy 0.9 but no format_rate in the report: format_rate >= 0.9
    fails as missing, so good (all metrics present) is promoted."""
    partial = {"accuracy": 0.9, "kl_to_ref": 1.0}
    verdict = decide(default_config().tests, report_with(partial=partial, good=GOOD), None, "accuracy", "dev")
    assert verdict["promote"] == "good"
    assert verdict["candidates"]["partial"]["failures"] == [
        "format_rate[dev] >= absolute+0.9: metric 'format_rate' missing for suite 'dev' in the eval report"
    ]


def test_named_test_in_failures():
    """A test's `name` labels its failure line."""
    test = CapabilityTest(name="no regression", metric="accuracy", relative_to="sft")
    verdict = decide([test], REPORT, None, "accuracy", "dev")
    assert verdict["candidates"]["bad"]["failures"] == ["no regression: 0.3000 >= 0.4000 fails" + POINT]


def test_a_passing_candidate_without_the_selection_metric_raises():
    """Choosing among passing candidates on a metric one of them lacks is a config error."""
    with pytest.raises(ValueError, match="select_metric 'win_rate'"):
        decide([FORMAT], REPORT, None, "win_rate", "dev")


# ----------------------------------------------------------------------------- paired tests
#
# 100 dev problems; 1 = right. Differences are candidate - baseline per problem, and their
# mean's bootstrap standard error is sqrt(variance of the differences / 100).

# SFT is right on the first 50.
SFT_RIGHT = [1.0] * 50 + [0.0] * 50
# Right wherever SFT is and on 10 more: differences are 10 ones and 90 zeros, mean 0.10,
# standard error sqrt(0.1 * 0.9 / 100) = 0.03, 95% interval about [0.04, 0.16].
BETTER_RIGHT = [1.0] * 60 + [0.0] * 40
# Right wherever SFT is and on 20 more: 20 ones and 80 zeros, mean 0.20, standard error 0.04.
BEST_RIGHT = [1.0] * 70 + [0.0] * 30
# Right on 25 of SFT's 50 and on 26 of the other 50 (51 in all): differences are 26 ones,
# 25 minus ones and 49 zeros, mean 0.01, standard error sqrt(0.51 / 100) = 0.071, 95%
# interval about 0.01 +- 0.14, which includes 0.
LUCKY_RIGHT = [1.0] * 25 + [0.0] * 25 + [1.0] * 26 + [0.0] * 24
DIGEST = "dev-v1"
OPS = (">=", "<=", ">", "<")


def point(right: list) -> dict:
    """The eval report's entry for a model with these outcomes (format 100%, KL 1)."""
    return {"accuracy": sum(right) / len(right), "format_rate": 1.0, "kl_to_ref": 1.0}


def paired_report(**candidates: list) -> dict:
    """An eval report of SFT (SFT_RIGHT) and the candidates, from their outcomes."""
    models = {"sft": SFT_RIGHT, **candidates}
    return {
        "reference": "sft",
        "candidates": list(candidates),
        "suites": {"dev": {name: point(right) for name, right in models.items()}},
    }


def outcomes_file(digest: str = DIGEST, **candidates: list) -> dict:
    """reports/outcomes.json for SFT and the candidates (accuracy and format per problem)."""
    models = {"sft": SFT_RIGHT, **candidates}
    return {
        "suites": {
            "dev": {
                "digest": digest,
                "models": {n: {"accuracy": r, "format_rate": [1.0] * len(r)} for n, r in models.items()},
            }
        }
    }


def champion_record(right: list, digest: str = DIGEST) -> dict:
    """The record of a champion with these outcomes on the dev suite version `digest`."""
    values = {"accuracy": right, "format_rate": [1.0] * len(right)}
    return record(point(right), outcomes={"dev": {"digest": digest, "values": values}})


def champion_test(op: str, threshold: float) -> CapabilityTest:
    return CapabilityTest(metric="accuracy", relative_to="champion", op=op, threshold=threshold)


def sft_test(op: str, threshold: float) -> CapabilityTest:
    return CapabilityTest(metric="accuracy", relative_to="sft", op=op, threshold=threshold)


def paired_reason(diff: float, interval, vs: str, op: str, threshold: float, passed: bool) -> str:
    low, high = interval
    end, which = (low, "lower") if op in (">=", ">") else (high, "upper")
    return (
        f"{diff:+.4f} [{low:+.4f}, {high:+.4f}] vs {vs} over 100 problems: "
        f"{which} bound {end:+.4f} {op} {threshold:+.4f}" + ("" if passed else " fails")
    )


def test_a_paired_gain_over_sft_passes_on_its_lower_bound():
    """Candidate right on 60, SFT on 50, the candidate right wherever SFT is: the mean
    difference is 0.10 and its lower bound is above 0.04 (about 0.10 - 1.96 * 0.03), so
    accuracy >= sft + 0 passes on the lower bound, and the reason gives the difference,
    the interval and the bound compared. The point values 0.60 and 0.50 are kept."""
    result = run_test(
        sft_test(">=", 0.0),
        per_suite(point(BETTER_RIGHT)),
        per_suite(point(SFT_RIGHT)),
        None,
        Paired(BETTER_RIGHT, SFT_RIGHT),
    )
    assert result.passed
    assert result.difference == pytest.approx(0.10)
    low, high = result.interval
    assert 0.04 < low < 0.10 < high < 0.20
    assert (result.value, result.baseline) == (0.6, 0.5)
    assert result.reason == paired_reason(0.10, result.interval, "sft", ">=", 0.0, True)


def test_a_minimum_effect_above_the_lower_bound_fails():
    """The same +0.10 against a champion at 0.50 (SFT's outcomes): accuracy > champion + 0.2
    fails (lower bound below 0.10, let alone 0.2); > champion + 0.08 fails too although the
    point estimates pass it (0.60 > 0.58), because the lower bound (about 0.04-0.05) is
    below 0.08; > champion + 0.04 passes, the lower bound being above 0.04."""
    candidate, champion = per_suite(point(BETTER_RIGHT)), per_suite(point(SFT_RIGHT))
    paired = Paired(BETTER_RIGHT, SFT_RIGHT)
    result = run_test(champion_test(">", 0.2), candidate, per_suite(SFT), champion, paired)
    assert not result.passed
    low = result.interval[0]
    assert 0.04 < low < 0.08
    assert result.reason == paired_reason(0.10, result.interval, "champion", ">", 0.2, False)
    assert run_test(champion_test(">", 0.08), candidate, per_suite(SFT), champion).passed
    assert not run_test(champion_test(">", 0.08), candidate, per_suite(SFT), champion, paired).passed
    assert run_test(champion_test(">", 0.04), candidate, per_suite(SFT), champion, paired).passed


def test_noise_is_not_promoted():
    """51 right against a champion's 50, with 26 problems gained and 25 lost: the point
    estimates differ by 0.01, so the raw comparison 0.51 > 0.50 + 0 passes, but the paired
    interval (about 0.01 +- 0.14) includes 0, so accuracy > champion + 0 fails on its
    lower bound."""
    candidate, champion = per_suite(point(LUCKY_RIGHT)), per_suite(point(SFT_RIGHT))
    assert candidate["dev"]["accuracy"] - champion["dev"]["accuracy"] == pytest.approx(0.01)
    assert run_test(champion_test(">", 0.0), candidate, per_suite(SFT), champion).passed
    result = run_test(champion_test(">", 0.0), candidate, per_suite(SFT), champion, Paired(LUCKY_RIGHT, SFT_RIGHT))
    assert not result.passed
    assert result.difference == pytest.approx(0.01)
    low, high = result.interval
    assert low < 0.0 < high
    assert result.reason == paired_reason(0.01, result.interval, "champion", ">", 0.0, False)


def test_at_most_tests_use_the_upper_bound():
    """accuracy <= sft + 0.12 for the +0.10 candidate: the point estimates pass it (0.60 <=
    0.62) but the upper bound of the difference (about 0.10 + 1.96 * 0.03 = 0.16, above
    0.13) does not, so it fails; <= sft + 0.25 and < sft + 0.25 pass (upper bound < 0.20)."""
    candidate, reference = per_suite(point(BETTER_RIGHT)), per_suite(point(SFT_RIGHT))
    paired = Paired(BETTER_RIGHT, SFT_RIGHT)
    assert run_test(sft_test("<=", 0.12), candidate, reference, None).passed
    result = run_test(sft_test("<=", 0.12), candidate, reference, None, paired)
    assert not result.passed
    assert 0.13 < result.interval[1] < 0.20
    assert result.reason == paired_reason(0.10, result.interval, "sft", "<=", 0.12, False)
    assert run_test(sft_test("<=", 0.25), candidate, reference, None, paired).passed
    assert run_test(sft_test("<", 0.25), candidate, reference, None, paired).passed


def test_identical_outcomes_under_pairing():
    """A candidate right on exactly SFT's problems: difference 0, interval [0, 0], so with
    threshold 0 `>=` and `<=` pass and `>` and `<` fail, as for equal point estimates."""
    same = per_suite(point(SFT_RIGHT))
    results = {op: run_test(sft_test(op, 0.0), same, same, None, Paired(SFT_RIGHT, SFT_RIGHT)) for op in OPS}
    assert {op: r.passed for op, r in results.items()} == {">=": True, "<=": True, ">": False, "<": False}
    assert all(r.difference == 0.0 and r.interval == (0.0, 0.0) for r in results.values())


def test_paired_outcomes_choose_what_to_pair():
    """Pairs: the candidate with SFT from the same outcomes file; with the champion only
    when the champion's record holds outcomes of the same suite version (digest) and
    length. None (point estimates) for an absolute test, no outcomes file, a metric or
    suite without outcomes, a champion on another suite version, a champion record
    without outcomes, or a different number of problems."""
    outcomes = outcomes_file(better=BETTER_RIGHT)
    champion = champion_record(SFT_RIGHT)["outcomes"]
    accuracy_sft, accuracy_champion = sft_test(">=", 0.0), champion_test(">", 0.01)
    assert paired_outcomes(accuracy_sft, "better", "sft", outcomes, None) == Paired(BETTER_RIGHT, SFT_RIGHT)
    assert paired_outcomes(accuracy_champion, "better", "sft", outcomes, champion) == Paired(BETTER_RIGHT, SFT_RIGHT)
    assert paired_outcomes(FORMAT, "better", "sft", outcomes, champion) is None
    assert paired_outcomes(accuracy_sft, "better", "sft", None, champion) is None
    kl_vs_sft = CapabilityTest(metric="kl_to_ref", relative_to="sft", op="<=", threshold=1.0)
    assert paired_outcomes(kl_vs_sft, "better", "sft", outcomes, champion) is None
    on_test = CapabilityTest(metric="accuracy", suite="test", relative_to="sft")
    assert paired_outcomes(on_test, "better", "sft", outcomes, champion) is None
    other_version = champion_record(SFT_RIGHT, digest="dev-v0")["outcomes"]
    assert paired_outcomes(accuracy_champion, "better", "sft", outcomes, other_version) is None
    assert paired_outcomes(accuracy_champion, "better", "sft", outcomes, None) is None
    shorter = champion_record(SFT_RIGHT[:99])["outcomes"]
    assert paired_outcomes(accuracy_champion, "better", "sft", outcomes, shorter) is None


def test_decide_pairs_against_sft_and_the_champion():
    """Default tests, a champion at 0.50 (SFT's outcomes, same suite version) and the +0.10
    candidate: both relative tests are paired (lower bounds above 0.04 clear 0 and 0.01),
    the absolute ones are not, and the candidate is promoted with its point metrics."""
    verdict = decide(
        default_config().tests,
        paired_report(better=BETTER_RIGHT),
        champion_record(SFT_RIGHT),
        "accuracy",
        "dev",
        outcomes_file(better=BETTER_RIGHT),
    )
    assert verdict["promote"] == "better"
    assert verdict["metrics"] == {"dev": point(BETTER_RIGHT)}
    sft, champion, format_rate, kl = verdict["candidates"]["better"]["tests"]
    for test, vs, threshold in ((sft, "sft", 0.0), (champion, "champion", 0.01)):
        assert test["passed"] and test["difference"] == pytest.approx(0.10)
        assert test["interval"][0] > 0.04
        assert test["reason"] == paired_reason(0.10, test["interval"], vs, test["op"], threshold, True)
    assert format_rate["interval"] is None and kl["interval"] is None
    assert format_rate["reason"] == "1.0000 >= 0.9000"


def test_a_champion_on_another_suite_version_is_compared_on_point_estimates():
    """The champion's outcomes were recorded on dev version dev-v0, the eval ran on dev-v1:
    its problems may differ, so the champion test compares point estimates (0.60 > 0.50 +
    0.01) and says so, while the SFT test, on the same file, is still paired."""
    verdict = decide(
        default_config().tests,
        paired_report(better=BETTER_RIGHT),
        champion_record(SFT_RIGHT, digest="dev-v0"),
        "accuracy",
        "dev",
        outcomes_file(better=BETTER_RIGHT),
    )
    sft, champion, _, _ = verdict["candidates"]["better"]["tests"]
    assert champion["passed"]
    assert champion["reason"] == (
        "0.6000 > 0.5100 (point estimates: the champion's 0.5000 was measured on another version of suite 'dev', "
        "which has changed since its promotion: its problems cannot be paired)"
    )
    assert champion["interval"] is None and champion["difference"] is None
    assert sft["interval"] is not None
    assert verdict["promote"] == "better"


def test_decide_with_outcomes_promotes_the_best_passing_candidate():
    """No champion yet; lucky (51: +0.01 over SFT, interval about +-0.14), better (60) and
    best (70). better and best pass every default test; best has the higher accuracy and
    is promoted. lucky's point estimate (0.51 > 0.50) would pass accuracy > sft + 0, but
    its paired lower bound is below 0, so it is rejected with that one reason."""
    candidates = {"lucky": LUCKY_RIGHT, "better": BETTER_RIGHT, "best": BEST_RIGHT}
    report, outcomes = paired_report(**candidates), outcomes_file(**candidates)
    verdict = decide(default_config().tests, report, None, "accuracy", "dev", outcomes)
    assert verdict["promote"] == "best"
    assert verdict["metrics"] == {"dev": point(BEST_RIGHT)}
    assert verdict["candidates"]["better"]["passed"] and verdict["candidates"]["best"]["passed"]
    lucky = verdict["candidates"]["lucky"]
    assert not lucky["passed"]
    interval = lucky["tests"][0]["interval"]
    assert interval[0] < 0.0
    assert lucky["failures"] == ["accuracy[dev] > sft+0: " + paired_reason(0.01, interval, "sft", ">", 0.0, False)]


def test_default_tests_do_not_promote_a_candidate_that_changed_nothing():
    """No champion yet, and a candidate right on exactly SFT's problems (training that
    changed nothing): difference 0, interval [0, 0]. The default test against SFT asks for
    a gain shown (lower bound above 0), so it is not promoted, with that one reason; the
    champion test passes (no champion yet)."""
    verdict = decide(
        default_config().tests,
        paired_report(same=list(SFT_RIGHT)),
        None,
        "accuracy",
        "dev",
        outcomes_file(same=list(SFT_RIGHT)),
    )
    assert verdict["promote"] is None
    same = verdict["candidates"]["same"]
    assert same["failures"] == ["accuracy[dev] > sft+0: " + paired_reason(0.0, (0.0, 0.0), "sft", ">", 0.0, False)]
    assert [t["passed"] for t in same["tests"]] == [False, True, True, True]


def test_a_failed_paired_gate_keeps_the_champion_and_lists_every_reason():
    """Champion: better (60 right). `same` is right on exactly its problems: difference 0,
    interval [0, 0], and 0 > 0.01 fails. lucky (51) fails accuracy > sft + 0 (lower bound
    below 0) and accuracy > champion + 0.01 (difference 0.51 - 0.60 = -0.09). Nothing is
    promoted."""
    candidates = {"same": list(BETTER_RIGHT), "lucky": LUCKY_RIGHT}
    verdict = decide(
        default_config().tests,
        paired_report(**candidates),
        champion_record(BETTER_RIGHT),
        "accuracy",
        "dev",
        outcomes_file(**candidates),
    )
    assert verdict["promote"] is None and verdict["metrics"] is None
    same = verdict["candidates"]["same"]
    assert same["failures"] == [
        "accuracy[dev] > champion+0.01: " + paired_reason(0.0, (0.0, 0.0), "champion", ">", 0.01, False)
    ]
    lucky = verdict["candidates"]["lucky"]
    assert [t["passed"] for t in lucky["tests"]] == [False, False, True, True]
    assert lucky["tests"][0]["interval"][0] < 0.0
    assert lucky["tests"][1]["difference"] == pytest.approx(-0.09)
    assert len(lucky["failures"]) == 2


def test_a_promoted_record_pairs_the_next_gate(tmp_path):
    """The record promote() writes (champion_outcomes of the winner) is what the next gate
    pairs with: better is recorded with its dev outcomes and digest, installed with its
    model files and read back unchanged; the next gate (stages.gate.run) rejects
    `same` (difference 0 to the champion) and promotes best (+0.10 over the champion), and
    names better as the previous champion. An empty folder has no champion record."""
    first = outcomes_file(better=BETTER_RIGHT)
    kept = champion_outcomes(first, "better")
    assert kept == {"dev": {"digest": DIGEST, "values": first["suites"]["dev"]["models"]["better"]}}
    assert champion_outcomes(None, "better") == {}
    model_dir, champion_dir = tmp_path / "better", tmp_path / "champion"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    entry = record(point(BETTER_RIGHT), candidate="better", outcomes=kept)
    install_champion(model_dir, entry, champion_dir)
    assert (champion_dir / "config.json").read_text() == "{}"
    assert read_champion(champion_dir) == entry
    assert read_champion(model_dir) is None

    candidates = {"same": list(BETTER_RIGHT), "best": BEST_RIGHT}
    verdict = run_gate(default_config(), paired_report(**candidates), outcomes_file(**candidates), champion_dir)
    assert verdict["previous_champion"] == "better"
    assert verdict["promote"] == "best"
    assert verdict["candidates"]["same"]["tests"][1]["interval"] == (0.0, 0.0)
    assert not verdict["candidates"]["same"]["passed"]
    assert verdict["candidates"]["best"]["tests"][1]["difference"] == pytest.approx(0.10)


# ----------------------------------------------------------------------------- by difficulty


def test_a_test_by_difficulty_reads_and_pairs_that_difficulty_only():
    """Labels: the first 20 problems are of difficulty 8, the other 80 of 3. Against SFT
    (right on the first 50), BETTER_RIGHT gains 10 problems, all of difficulty 3: on the 20
    eight-number problems the pair is identical (difference 0, interval [0, 0]), so
    accuracy@8 > sft fails where the whole-suite test passes. Without the labels in the
    outcomes file the test compares the report's accuracy_by_difficulty point values."""
    labels = ["8"] * 20 + ["3"] * 80
    outcomes = outcomes_file(better=BETTER_RIGHT)
    outcomes["suites"]["dev"]["difficulty"] = labels
    test = CapabilityTest(metric="accuracy", relative_to="sft", op=">", difficulty=8)
    assert test.difficulty == ["8"] and test.label == "accuracy[dev@8] > sft+0"
    assert paired_outcomes(test, "better", "sft", outcomes, None) == Paired([1.0] * 20, [1.0] * 20)
    report = paired_report(better=BETTER_RIGHT)
    counts = {"problems_by_difficulty": {"8": 20, "3": 80}}
    report["suites"]["dev"]["sft"] |= {"accuracy_by_difficulty": {"8": 1.0, "3": 30 / 80}} | counts
    report["suites"]["dev"]["better"] |= {"accuracy_by_difficulty": {"8": 1.0, "3": 40 / 80}} | counts
    verdict = decide([test, sft_test(">", 0.0)], report, None, "accuracy", "dev", outcomes)
    by_difficulty, whole = verdict["candidates"]["better"]["tests"]
    assert whole["passed"] and whole["difference"] == pytest.approx(0.10)
    assert not by_difficulty["passed"] and by_difficulty["interval"] == (0.0, 0.0)
    assert by_difficulty["reason"].startswith("+0.0000 [+0.0000, +0.0000] vs sft over 20 problems")

    at_three = CapabilityTest(metric="accuracy", relative_to="sft", op=">", difficulty="3")
    del outcomes["suites"]["dev"]["difficulty"]
    assert paired_outcomes(at_three, "better", "sft", outcomes, None) is None
    better, sft = ({"dev": report["suites"]["dev"][name]} for name in ("better", "sft"))
    result = run_test(at_three, better, sft, None)
    assert result.passed and result.reason == "0.5000 > 0.3750" + POINT
    both = CapabilityTest(metric="accuracy", relative_to="sft", op=">", difficulty=[3, 8])
    result = run_test(both, better, sft, None)  # the problem-weighted mean: all of dev
    assert result.value == pytest.approx(0.6) and result.baseline == pytest.approx(0.5)
    unknown = CapabilityTest(metric="accuracy", relative_to="sft", op=">", difficulty=[8, 9])
    result = run_test(unknown, better, sft, None)
    assert (
        not result.passed and result.reason == "accuracy at difficulty 8,9 missing for suite 'dev' in the eval report"
    )


def test_a_test_by_difficulty_reads_accuracy_only():
    with pytest.raises(ValueError, match="difficulty 8 with metric 'format_rate'.*set metric: accuracy"):
        CapabilityTest(metric="format_rate", difficulty=8)
    with pytest.raises(ValueError, match=r"difficulty \[\]: name at least one difficulty, or null"):
        CapabilityTest(metric="accuracy", difficulty=[])


def test_a_registry_champion_of_the_same_number_but_another_run_holds_the_gate_back():
    """Version numbers repeat across tracking stores (and registered model names): a
    folder holding version 2 of one store is not version 2 of another. The gate compares
    the run that logged the registry's champion with the record's and holds back (it moved
    a team's better champion to a worse candidate); the same run passes."""
    from stages.gate import held_back

    verdict = {"promote": "dpo", "champion_record": {"model_version": "2", "gate_run_id": "run-a", "pinned": None}}
    reason = held_back(verdict, Config(), None, False, ("2", None, "run-b"))
    assert reason.startswith("dpo passed, but the registry's champion, version 2, is another model than ")
    assert "(logged by run run-b, not run-a" in reason and "rlhf rollback --sync" in reason
    assert held_back(verdict, Config(), None, False, ("2", None, "run-a")) is None
    assert held_back(verdict, Config(), None, False, ("2", None)) is None  # a caller without the run
