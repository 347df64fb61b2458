"""Capability tests, the promotion rule, and moving the champion.

A capability test compares one metric of a candidate on one eval suite with a baseline:

    value(candidate)  op  baseline + threshold

where the baseline is 0 (``relative_to: absolute``), the reference model's value
(``relative_to: sft``) or the current champion's value as recorded when it was promoted
(``relative_to: champion``; passes while there is no champion yet). A candidate is
promotable only if every test passes; among promotable candidates the one with the best
selection metric wins. A rejected candidate is reported with the reason of every failed
test, and the champion does not move.

Promotion writes `models/champion` atomically (a copy of the candidate plus
champion.json, the record the next gate compares against) and moves the MLflow registry
alias ``champion`` to a new model version holding the candidate's weights.
"""

from __future__ import annotations

import json
import operator
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

CHAMPION_RECORD = "champion.json"
CHAMPION_ALIAS = "champion"
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


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


def run_test(test, candidate: dict, reference: dict, champion: dict | None) -> TestResult:
    """`candidate`, `reference`, `champion`: {suite: {metric: value}} of one model each."""
    name = test.name or f"{test.metric}[{test.suite}] {test.op} {test.relative_to}{test.threshold:+g}"
    value = candidate.get(test.suite, {}).get(test.metric)

    def result(passed: bool, reason: str, baseline=None, bound=None) -> TestResult:
        return TestResult(name, test.metric, test.suite, value, baseline, bound, test.op, passed, reason)

    if value is None:
        return result(False, f"metric {test.metric!r} missing for suite {test.suite!r} in the eval report")
    if test.relative_to == "absolute":
        baseline = 0.0
    elif test.relative_to == "sft":
        baseline = reference.get(test.suite, {}).get(test.metric)
        if baseline is None:
            return result(False, f"reference has no {test.metric!r} on suite {test.suite!r}")
    else:
        if champion is None:
            return result(True, "no champion yet: nothing to regress from")
        baseline = champion.get(test.suite, {}).get(test.metric)
        if baseline is None:
            return result(True, f"champion has no recorded {test.metric!r} on {test.suite!r}: not compared")
    bound = baseline + test.threshold
    # Rounded so that float noise in `baseline + threshold` (0.40 - 0.05 = 0.35000000000000003)
    # does not fail a candidate that sits exactly on the bound.
    passed = OPS[test.op](round(value, 9), round(bound, 9))
    reason = f"{value:.4f} {test.op} {bound:.4f}" + ("" if passed else " fails")
    return result(passed, reason, baseline, bound)


def decide(tests, report: dict, champion: dict | None, select_metric: str, select_suite: str) -> dict:
    """The gate's verdict over every candidate in an eval `report` (see stages.evaluate)."""
    reference_name = report["reference"]
    per_model = {
        name: {suite: results[name] for suite, results in report["suites"].items() if name in results}
        for name in [reference_name, *report["candidates"]]
    }
    verdicts = {}
    for name in report["candidates"]:
        results = [run_test(t, per_model[name], per_model[reference_name], champion) for t in tests]
        verdicts[name] = {
            "passed": all(r.passed for r in results),
            "tests": [asdict(r) for r in results],
            "failures": [f"{r.name}: {r.reason}" for r in results if not r.passed],
        }
    passing = [n for n in report["candidates"] if verdicts[n]["passed"]]
    missing = [n for n in passing if per_model[n].get(select_suite, {}).get(select_metric) is None]
    if missing:
        raise ValueError(
            f"gate.select_metric {select_metric!r} on suite {select_suite!r} is missing for {missing} in the eval "
            "report; choose a metric every candidate has (see reports/eval.json), e.g. reward or win_rate for a "
            "suite without answers"
        )
    best = max(passing, key=lambda n: per_model[n][select_suite][select_metric], default=None)
    return {"promote": best, "candidates": verdicts, "metrics": per_model.get(best) if best else None}


def read_champion(champion_dir: Path) -> dict | None:
    record = champion_dir / CHAMPION_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def install_champion(model_dir: Path, record: dict, staging: Path) -> None:
    """Fill `staging` (an atomic_dir for models/champion) with the model and its record."""
    shutil.copytree(model_dir, staging, dirs_exist_ok=True)
    (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def create_version(client, registered_model: str, run_id: str, artifact_path: str, tags: dict) -> str:
    """A new registry version from the model logged under `artifact_path` of the run."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(registered_model)
    except MlflowException:
        client.create_registered_model(registered_model, description="Models promoted by the capability gate")
    run = client.get_run(run_id)
    version = client.create_model_version(
        registered_model, source=f"{run.info.artifact_uri}/{artifact_path}", run_id=run_id, tags=tags
    )
    return str(version.version)


def set_champion_alias(client, registered_model: str, version: str) -> None:
    client.set_registered_model_alias(registered_model, CHAMPION_ALIAS, version)
