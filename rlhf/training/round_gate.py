"""A self-improvement round's evaluation and gate (stage improve@<name>, stages/improve.py):
the models on the eval suites, greedy, with KL to SFT; the round's default tests (progress
on the frontier over the round's start, retention against SFT); the verdict, by the same
paired tests as the pipeline's gate (rlhf.evaluation.gate.decide); and the round's
headline numbers. The stage names the folders."""

from __future__ import annotations

from pathlib import Path

from rlhf.evaluation.gate import CapabilityTest
from rlhf.training.rounds import Settings

# What a round's summary keeps of each suite's metrics.
ACCURACY_KEYS = (
    "accuracy", "accuracy_low", "accuracy_high", "accuracy_by_difficulty", "accuracy_by_difficulty_interval",
)  # fmt: skip


def evaluate_models(
    config,
    task,
    models: dict[str, Path],
    suites: list[str],
    trust_remote_code: bool = False,
    *,
    reference: Path,
    eval_dir: Path,
) -> dict:
    """{name: {suite: {"metrics", "outcomes", "digest"}}} of each model on each suite (the
    tables `eval_dir`/<suite>.parquet), greedy, with KL to the `reference` model (SFT), as
    `config` (params `evaluate`) says; custom modelling code with its or the caller's
    `trust_remote_code`."""
    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.suites import SUITE_COLUMNS, evaluate_model, suite_identity
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    trust = config.trust_remote_code or trust_remote_code
    tokenizer = load_tokenizer(reference, trust)
    reference_model = load_causal_lm(reference, trust, what=str(reference))
    tables = {suite: read_prepared(eval_dir / f"{suite}.parquet", "improve", SUITE_COLUMNS) for suite in suites}
    identities = {suite: suite_identity(table) for suite, table in tables.items()}
    results: dict = {}
    for name, path in models.items():
        model = reference_model if path == reference else load_causal_lm(path, trust, what=str(path))
        results[name] = {}
        for suite, table in tables.items():
            metrics, outcomes, _, _ = evaluate_model(config, task, model, reference_model, tokenizer, None, table, None)
            results[name][suite] = {"metrics": metrics, "outcomes": outcomes, **identities[suite]}
        del model
    return results


def earlier_evals(
    config, task, suites: list[str], previous: dict, start_dir: Path, trust: bool, *, reference, eval_dir
):
    """(SFT's, the start's) evaluation on `suites`, from the report of the round before (the
    start): a suite that round did not evaluate (this round evaluates more) is evaluated here."""
    sft_eval, start_eval = dict(previous["sft"]), dict(previous["winner_eval"])
    where = {"reference": reference, "eval_dir": eval_dir}
    if missing := [s for s in suites if s not in sft_eval]:
        sft_eval |= evaluate_models(config, task, {"sft": reference}, missing, trust, **where)["sft"]
    if missing := [s for s in suites if s not in start_eval]:
        start_eval |= evaluate_models(config, task, {"start": start_dir}, missing, trust, **where)["start"]
    return sft_eval, start_eval


def default_tests(settings: Settings, suites: list[str], decision: str) -> list[CapabilityTest]:
    progress = settings.progress_suite or ("dev_long" if "dev_long" in suites else decision)
    retention = settings.retention_suite or decision
    at = "" if settings.progress_difficulty is None else "@" + ",".join(settings.progress_difficulty)
    tests = [
        CapabilityTest(
            name=f"progress{at}",
            metric="accuracy",
            suite=progress,
            difficulty=settings.progress_difficulty,
            relative_to="champion",
            op=">",
        )
    ]
    tests.append(
        CapabilityTest(
            name="retention",
            metric="accuracy",
            suite=retention,
            relative_to="sft",
            op=">=",
            threshold=-settings.retention_margin,
        )
    )
    return tests


def gate(settings: Settings, tests, name: str, sft: dict, start: dict, candidate: dict) -> dict:
    """The round's verdict (rlhf.evaluation.gate.decide): `candidate` against SFT and
    against the round's start as the champion, paired on the same problems."""
    from rlhf.evaluation.gate import decide

    suites = list(candidate)
    report = {
        "reference": "sft",
        "candidates": [name],
        "suites": {s: {"sft": sft[s]["metrics"], name: candidate[s]["metrics"]} for s in suites},
    }
    outcomes = {
        "suites": {
            s: {
                "digest": candidate[s]["digest"],
                "difficulty": candidate[s].get("difficulty"),
                "models": {"sft": sft[s]["outcomes"], name: candidate[s]["outcomes"]},
            }
            for s in suites
        }
    }
    champion = {
        "metrics": {s: start[s]["metrics"] for s in suites},
        "outcomes": {s: {"digest": start[s]["digest"], "values": start[s]["outcomes"]} for s in suites},
    }
    select = tests[0].suite
    confidence, resamples = settings.confidence, settings.bootstrap_samples
    return decide(
        tests, report, champion, "accuracy", select, outcomes, confidence, resamples, champion_name="the round's start"
    )


def metrics_only(results: dict) -> dict:
    return {suite: entry["metrics"] for suite, entry in results.items()}


def round_summary(report: dict) -> dict:
    """The round's headline numbers (reports/rounds/<name>.json, a DVC metric)."""
    summary = {
        "passed": report.get("passed"),
        "stopped": report.get("stopped"),
        "stopped_at": report.get("stopped_at"),
        "winner": report.get("winner"),
        "data": {k: v for k, v in (report.get("data") or {}).items() if not isinstance(v, dict)},
    }
    if report.get("data", {}).get("repair"):
        summary["repair"] = report["data"]["repair"]
    for role in ("candidate_eval", "start_eval"):
        if report.get(role):
            summary[role] = {suite: {k: m.get(k) for k in ACCURACY_KEYS} for suite, m in report[role].items()}
    if report.get("failures"):
        summary["failures"] = report["failures"]
    return summary
