"""Capability tests and the promotion rule.

A capability test compares one metric of a candidate on one eval suite with a baseline:

    value(candidate)  op  baseline + threshold

where the baseline is 0 (``relative_to: absolute``), the reference model's value
(``relative_to: sft``) or the current champion's value as recorded when it was promoted
(``relative_to: champion``; passes while there is no champion yet).

A relative test on a metric with one outcome per problem (accuracy, format, reward,
win-rate: `reports/outcomes.json`) is a paired test, so that noise is neither promoted nor
allowed to block a real gain: the candidate and its baseline are compared on the same
problems by a paired bootstrap of their mean difference (rlhf.evaluation.statistics), and
the test is judged on the conservative end of its interval,

    >= / >:  lower bound of (candidate - baseline)  op  threshold
    <= / <:  upper bound of (candidate - baseline)  op  threshold

so `threshold` is the minimum effect: `accuracy >= champion + 0.01` passes only when the
candidate beats the champion by at least one point with the configured confidence. A
comparison with no per-problem outcomes (KL, distinct-n, or a champion evaluated on another
version of the suite) falls back to the point estimates and says so in its reason; an
absolute test compares the point estimate with its bound.

Some metrics are scores of other models: reward and its std (the reward model), win-rate
(the reward model and the reference), KL (the reference). The eval report records which
versions scored them (`scorers`: their dvc.lock hashes) and the champion's record keeps
those of its promotion; when one has changed since (the RM retrained on new human
feedback), the champion's recorded value is on another scale, and a test against it is not
compared (it passes, saying so) rather than judged on two rulers. The tests against SFT,
measured in the same run, still hold.

A candidate is promotable only if every test passes; among promotable candidates the one
with the best selection metric wins. A rejected candidate is reported with the reason of
every failed test, and the champion does not move.

Moving the champion is `rlhf.tracking.champion`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from rlhf.params import InputError, StageConfig

OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
# The models that score a metric (keys of the eval report's `scorers`), and their names.
METRIC_SCORERS = {
    "reward": ("rm",),
    "reward_std": ("rm",),
    "win_rate": ("rm", "reference"),
    "kl_to_ref": ("reference",),
}
SCORER_NAMES = {"rm": "reward model (models/rm)", "reference": "reference model (models/sft)"}


def changed_scorers(metric: str, current: dict | None, recorded: dict | None) -> list[str]:
    """The scorers of `metric` whose version differs between this run (`current`) and the
    champion's promotion (`recorded`); an unknown version on either side (no dvc.lock)
    counts as unchanged."""
    current, recorded = current or {}, recorded or {}
    return [
        s for s in METRIC_SCORERS.get(metric, ()) if current.get(s) and recorded.get(s) and current[s] != recorded[s]
    ]


def _as_labels(value):
    if value is None:
        return None
    values = value if isinstance(value, list | tuple) else [value]
    return [str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for v in values]


# Difficulty labels as the eval reports spell them (YAML's 8 is "8"); one label or a list.
DifficultyLabels = Annotated[list[str] | None, BeforeValidator(_as_labels)]


def accuracy_at(metrics: dict, labels: list[str]) -> float | None:
    """Accuracy over a suite's problems of the difficulties `labels`, from its eval report
    entry (accuracy_by_difficulty weighted by problems_by_difficulty); None when a label is
    missing."""
    by = metrics.get("accuracy_by_difficulty") or {}
    counts = metrics.get("problems_by_difficulty") or {}
    if any(label not in by for label in labels):
        return None
    if len(labels) == 1:
        return by[labels[0]]
    if any(label not in counts for label in labels):
        return None
    return sum(by[k] * counts[k] for k in labels) / sum(counts[k] for k in labels)


class CapabilityTest(StageConfig):
    name: str | None = Field(None, description="label in reports (default: built from the fields)")
    metric: str = Field(description="a metric of reports/eval.json, e.g. accuracy, format_rate, kl_to_ref")
    suite: str | None = Field(
        None, description="eval suite the metric is read from; null: the decision suite (dev when there is one)"
    )
    op: Literal[">=", "<=", ">", "<"] = Field(">=", description="comparison")
    threshold: float = Field(
        0.0, description="added to the baseline: value op baseline + threshold (relative tests: the minimum effect)"
    )
    relative_to: Literal["absolute", "sft", "champion"] = Field("absolute", description="the baseline")
    difficulty: DifficultyLabels = Field(
        None,
        description="accuracy on the suite's problems of this difficulty (or these: a list) only, by its "
        "`difficulty` column, e.g. 8 for the built-in task's 8-number problems; null: every problem",
    )

    @model_validator(mode="after")
    def _check_difficulty(self):
        if self.difficulty is not None and self.metric != "accuracy":
            raise ValueError(
                f"difficulty {','.join(self.difficulty)} with metric {self.metric!r}: a test restricted by "
                "difficulty reads accuracy only (reports/eval.json keeps accuracy_by_difficulty); set metric: accuracy"
            )
        if self.difficulty == []:
            raise ValueError("difficulty []: name at least one difficulty, or null for every problem")
        return self

    @property
    def where(self) -> str:
        """The suite, and the difficulties the test reads: `dev_long@7,8`."""
        return self.suite if self.difficulty is None else f"{self.suite}@{','.join(self.difficulty)}"

    @property
    def label(self) -> str:
        return self.name or f"{self.metric}[{self.where}] {self.op} {self.relative_to}{self.threshold:+g}"


@dataclass
class TestResult:
    name: str
    metric: str
    suite: str
    value: float | None
    baseline: float | None
    bound: float | None
    op: str
    passed: bool
    reason: str
    difference: float | None = None  # paired tests: mean(candidate - baseline) ...
    interval: tuple[float, float] | None = None  # ... and its bootstrap interval


@dataclass
class Paired:
    """Per-problem outcomes of a candidate and its baseline on the same problems."""

    candidate: Sequence[float]
    baseline: Sequence[float]


def run_test(
    test,
    candidate: dict,
    reference: dict,
    champion: dict | None,
    paired: Paired | None = None,
    confidence: float = 0.95,
    samples: int = 2000,
    rescored: Sequence[str] = (),
    unpaired: str = "no per-problem outcomes to pair",
    champion_name: str = "champion",
) -> TestResult:
    """`candidate`, `reference`, `champion`: {suite: {metric: value}} of one model each;
    `paired`: the outcomes behind a relative test, when both sides have them; `rescored`:
    the scorers of the metric that changed since the champion was promoted
    (`changed_scorers`); `unpaired`: why a relative test without `paired` compares point
    estimates (`unpaired_reason`); `champion_name`: what the champion is called in reasons
    (a round's gate: its start)."""
    name = test.label

    def read(metrics: dict):
        suite = metrics.get(test.suite, {})
        return suite.get(test.metric) if test.difficulty is None else accuracy_at(suite, test.difficulty)

    value = read(candidate)
    what = repr(test.metric) if test.difficulty is None else f"accuracy at difficulty {','.join(test.difficulty)}"

    def result(passed: bool, reason: str, baseline=None, bound=None, **paired_fields) -> TestResult:
        return TestResult(
            name, test.metric, test.suite, value, baseline, bound, test.op, passed, reason, **paired_fields
        )

    if value is None:
        missing = f"metric {what}" if test.difficulty is None else what
        return result(False, f"{missing} missing for suite {test.suite!r} in the eval report")
    if test.relative_to == "absolute":
        baseline = 0.0
    elif test.relative_to == "sft":
        baseline = read(reference)
        if baseline is None:
            return result(False, f"reference has no {what} on suite {test.suite!r}")
    else:
        if champion is None:
            return result(True, "no champion yet: nothing to regress from")
        baseline = read(champion)
        if baseline is None:
            return result(True, f"champion has no recorded {what} on {test.suite!r}: not compared")
        if rescored:
            changed = " and the ".join(SCORER_NAMES[s] for s in rescored)
            return result(
                True,
                f"not compared: the champion's {what} on {test.suite!r} ({baseline:.4f}) was scored by another "
                f"version of the {changed}, which has changed since its promotion",
                baseline,
            )
    bound = baseline + test.threshold
    if paired is not None and test.relative_to != "absolute":
        from rlhf.evaluation.statistics import paired_difference

        diff = paired_difference(paired.candidate, paired.baseline, confidence, samples)
        end = diff["low"] if test.op in (">=", ">") else diff["high"]
        which = "lower" if test.op in (">=", ">") else "upper"
        passed = OPS[test.op](round(end, 9), round(test.threshold, 9))
        reason = (
            f"{diff['difference']:+.4f} [{diff['low']:+.4f}, {diff['high']:+.4f}] vs "
            f"{champion_name if test.relative_to == 'champion' else test.relative_to} "
            f"over {diff['problems']} problems: {which} bound {end:+.4f} {test.op} {test.threshold:+.4f}"
            + ("" if passed else " fails")
        )
        return result(
            passed, reason, baseline, bound, difference=diff["difference"], interval=(diff["low"], diff["high"])
        )
    # Rounded so that float noise in `baseline + threshold` (0.40 - 0.05 = 0.35000000000000003)
    # does not fail a candidate that sits exactly on the bound.
    passed = OPS[test.op](round(value, 9), round(bound, 9))
    reason = f"{value:.4f} {test.op} {bound:.4f}" + ("" if passed else " fails")
    if test.relative_to != "absolute":
        reason += f" (point estimates: {unpaired})"
    return result(passed, reason, baseline, bound)


def unpaired_reason(test, outcomes: dict | None, champion_outcomes: dict | None, champion_metrics) -> str:
    """Why a relative test has no paired outcomes: the champion's were recorded on another
    version of the suite (its problems changed since the promotion: its score is from
    those), or there are none."""
    if test.relative_to == "champion" and outcomes is not None:
        suite = outcomes.get("suites", {}).get(test.suite) or {}
        recorded = (champion_outcomes or {}).get(test.suite)
        if recorded is not None and suite.get("digest") and recorded.get("digest") != suite.get("digest"):
            value = (champion_metrics or {}).get(test.suite, {}).get(test.metric)
            shown = f" {value:.4f}" if isinstance(value, int | float) else ""
            return (
                f"the champion's{shown} was measured on another version of suite {test.suite!r}, which has changed "
                "since its promotion: its problems cannot be paired"
            )
    return "no per-problem outcomes to pair"


def paired_outcomes(test, name: str, reference: str, outcomes: dict | None, champion_outcomes: dict | None):
    """The `Paired` outcomes for a relative test of candidate `name`, or None when either
    side has none for the test's suite and metric (then the test compares point values). A
    test restricted by difficulty pairs the problems of those difficulties only (the labels
    are the suite's `difficulty`, aligned with its accuracy outcomes)."""
    if outcomes is None or test.relative_to == "absolute":
        return None
    suite = outcomes.get("suites", {}).get(test.suite)
    if suite is None:
        return None
    candidate = suite["models"].get(name, {}).get(test.metric)
    if test.relative_to == "sft":
        baseline = suite["models"].get(reference, {}).get(test.metric)
    else:
        recorded = (champion_outcomes or {}).get(test.suite)
        same_problems = recorded is not None and recorded.get("digest") == suite.get("digest")
        baseline = recorded["values"].get(test.metric) if same_problems else None
    if not candidate or not baseline or len(candidate) != len(baseline):
        return None
    if test.difficulty is not None:
        labels = suite.get("difficulty")
        if labels is None or len(labels) != len(candidate):
            return None
        keep = [i for i, label in enumerate(labels) if label in test.difficulty]
        if not keep:
            return None
        candidate, baseline = [candidate[i] for i in keep], [baseline[i] for i in keep]
    return Paired(candidate, baseline)


def validator_tests(validation: dict | None, name: str) -> list[dict]:
    """The validator's checks of candidate `name` as test results; a candidate the
    validator did not check fails (its report is stale or from other candidates)."""
    if validation is None:
        return []
    checked = validation["candidates"].get(name)
    if checked is None:
        return [
            asdict(TestResult("validator", "validator", validation["suite"], None, None, None, "", False,
                              f"the validator's report has no candidate {name!r}; rerun stage validate"))
        ]  # fmt: skip
    return [
        asdict(
            TestResult(
                f"validator:{c['name']}",
                c["metric"],
                validation["suite"],
                c["value"],
                c["baseline"],
                c["limit"],
                "",
                c["passed"],
                c["reason"],
            )
        )  # fmt: skip
        for c in checked["checks"]
    ]


class SelectMetricError(InputError, ValueError):
    """A candidate that passed has no `gate.select_metric` to be ranked on (check_params
    refuses the metrics a run cannot measure; this catches the rest, e.g. a harness task's)."""


def decide(
    tests,
    report: dict,
    champion: dict | None,
    select_metric: str,
    select_suite: str,
    outcomes: dict | None = None,
    confidence: float = 0.95,
    samples: int = 2000,
    validation: dict | None = None,
    champion_name: str = "champion",
) -> dict:
    """The gate's verdict over every candidate in an eval `report` (see stages.evaluate).
    `champion` is the champion's record (its `metrics` and, when recorded, its per-problem
    `outcomes`); `outcomes` the eval's per-problem outcomes (reports/outcomes.json);
    `validation` the validator's report (reports/validation.json), whose every check counts
    as one more test (named `validator:<check>`)."""
    reference_name = report["reference"]
    per_model = {
        name: {suite: results[name] for suite, results in report["suites"].items() if name in results}
        for name in [reference_name, *report["candidates"]]
    }
    champion_metrics = champion["metrics"] if champion else None
    champion_outcomes = champion.get("outcomes") if champion else None
    verdicts = {}
    for name in report["candidates"]:
        results = [
            run_test(
                t,
                per_model[name],
                per_model[reference_name],
                champion_metrics,
                paired_outcomes(t, name, reference_name, outcomes, champion_outcomes),
                confidence,
                samples,
                changed_scorers(t.metric, report.get("scorers"), champion.get("scorers"))
                if champion and t.relative_to == "champion"
                else (),
                unpaired_reason(t, outcomes, champion_outcomes, champion_metrics),
                champion_name,
            )
            for t in tests
        ]
        results = [asdict(r) for r in results] + validator_tests(validation, name)
        verdicts[name] = {
            "passed": all(r["passed"] for r in results),
            "tests": results,
            "failures": [f"{r['name']}: {r['reason']}" for r in results if not r["passed"]],
        }
    passing = [n for n in report["candidates"] if verdicts[n]["passed"]]
    missing = [n for n in passing if per_model[n].get(select_suite, {}).get(select_metric) is None]
    if missing:
        raise SelectMetricError(
            f"gate.select_metric {select_metric!r} on suite {select_suite!r} is missing for {missing} in the eval "
            "report; choose a metric every candidate has (see reports/eval.json), e.g. reward or win_rate for a "
            "suite without answers"
        )
    best = max(passing, key=lambda n: per_model[n][select_suite][select_metric], default=None)
    return {
        "promote": best,
        "candidates": verdicts,
        "metrics": per_model.get(best) if best else None,
        "scorers": report.get("scorers"),
    }
