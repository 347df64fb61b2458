"""What a flow run shows: the parent MLflow run's headline metrics, the tables published as
Prefect artifacts, and the markdown summary (per-stage status, eval suites, inference, the
rounds, the gate's verdict), all read from the reports of the stages that completed in the
run (`read_metrics`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from flows.dag import ROOT, stage_order

HEADLINE = ("accuracy", "accuracy_low", "accuracy_high", "format_rate", "reward", "win_rate", "kl_to_ref")


def table_artifacts(metrics: dict) -> dict[str, list[dict]]:
    """The tables that read better as tables than as logs, by artifact key: every model on
    every suite, the gate's verdict test by test, and the inference strategies."""
    tables: dict[str, list[dict]] = {}
    suites = ((metrics.get("eval") or {}).get("suites")) or {}
    rows = [
        {"suite": suite, "model": model, **{key: m.get(key) for key in HEADLINE}}
        for suite, models in suites.items()
        for model, m in models.items()
        if isinstance(m, dict)
    ]
    if rows:
        tables["eval-table"] = rows
    gate = metrics.get("gate")
    if gate:
        tables["gate-verdict"] = [
            {"candidate": name, "test": test["name"], "passed": test["passed"], "reason": test["reason"]}
            for name, result in gate["candidates"].items()
            for test in result["tests"]
        ]
    infer = metrics.get("infer")
    if infer:
        tables["inference-table"] = [
            {
                "strategy": name,
                **{
                    k: m.get(k)
                    for k in (
                        "accuracy",
                        "accuracy_low",
                        "accuracy_high",
                        "tokens_per_problem",
                        "samples_per_problem",
                        "seconds",
                    )
                },
            }
            for name, m in infer["strategies"].items()
        ]
    return tables


def headline_metrics(metrics: dict) -> dict[str, float]:
    """What the parent run carries for MLflow's Compare: per suite and model accuracy,
    format rate, reward, win-rate and KL (with the accuracy interval), the RM and PRM
    held-out accuracy, the gate's verdict, and per round its candidate's accuracy."""
    out: dict[str, float] = {}

    def put(name: str, value) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", name)] = float(value)

    for suite, models in ((metrics.get("eval") or {}).get("suites") or {}).items():
        for model, m in models.items():
            if isinstance(m, dict):
                for key in HEADLINE:
                    put(f"{suite}.{model}.{key}", m.get(key))
    put("rm.ensemble_accuracy", (metrics.get("rm") or {}).get("ensemble_accuracy"))
    put("prm.step_accuracy", (metrics.get("prm") or {}).get("step_accuracy"))
    gate = metrics.get("gate")
    if gate:
        put("gate.promoted", float(bool(gate.get("promoted"))))
        for name, result in gate["candidates"].items():
            put(f"gate.{name}.passed", float(result["passed"]))
    for name, report in (metrics.get("rounds") or {}).items():
        put(f"round.{name}.passed", float(bool(report.get("passed"))))
        for suite, m in (report.get("candidate_eval") or {}).items():
            put(f"round.{name}.{suite}.accuracy", m.get("accuracy"))
    for name, strategy in ((metrics.get("infer") or {}).get("strategies") or {}).items():
        put(f"infer.{name}.accuracy", strategy.get("accuracy"))
    return out


# The report each stage writes, under the key the summary and the parent run read it by.
REPORTS = {
    "sft": ("sft", "metrics/sft.json"),
    "rm": ("rm", "metrics/rm.json"),
    "prm": ("prm", "metrics/prm.json"),
    "eval": ("evaluate", "reports/eval.json"),
    "infer": ("infer", "reports/infer.json"),
    "gate": ("gate", "reports/gate.json"),
}


def read_metrics(root: Path = ROOT, current: set[str] | None = None) -> dict:
    """The stages' reports. With `current`, the stages whose outputs are this run's (they
    ran, were restored or were up to date), only theirs: a stage that failed or did not run
    (upstream of it failed) left an earlier run's report, for other inputs."""

    def load(stage: str, path: str):
        file = root / path
        return json.loads(file.read_text()) if file.exists() and (current is None or stage in current) else None

    rounds = {}
    for address in stage_order(root) if (root / "reports/rounds").is_dir() else []:
        if address.startswith("improve@"):
            name = address.split("@", 1)[1]
            rounds[name] = load(address, f"reports/rounds/{name}.json")
    metrics = {key: load(stage, path) for key, (stage, path) in REPORTS.items()}
    return metrics | {"rounds": {name: report for name, report in rounds.items() if report}}


def number(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def with_interval(metrics: dict, name: str) -> str:
    """`0.934 [0.912, 0.955]`: a mean and its bootstrap interval, when the report has one."""
    value, low, high = metrics.get(name), metrics.get(f"{name}_low"), metrics.get(f"{name}_high")
    if value is None or low is None:
        return number(value)
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def rounds_table(rounds: dict) -> list[str]:
    """A row per self-improvement round: what it kept, its candidate's accuracy per suite,
    and the verdict."""
    suites = sorted({s for r in rounds.values() for s in (r.get("candidate_eval") or {})})
    lines = ["", "## Self-improvement rounds", ""]
    lines.append("| round | kept / samples | " + " | ".join(f"{s} accuracy [95% CI]" for s in suites) + " | verdict |")
    lines.append("|---" * (len(suites) + 3) + "|")
    for name, r in rounds.items():
        data = r.get("data") or {}
        kept = f"{data['kept_samples']} / {data['samples']}" if data else "n/a"
        evals = r.get("candidate_eval") or {}
        cells = [with_interval(evals[s], "accuracy") if s in evals else "n/a" for s in suites]
        if r.get("passed"):
            verdict = "passed: the candidate is the winner"
        elif r.get("passed") is None:
            verdict = f"not run: the loop stopped at round {r.get('stopped_at')}"
        else:
            verdict = "stopped: " + "; ".join(r.get("failures") or ["nothing to train on"])
        lines.append(f"| {name} | {kept} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def summary_markdown(results: list[dict], metrics: dict) -> str:
    lines = ["# rlhf-pipeline run", "", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['stage']} | {r['status']} | {r['seconds']:.1f} |" for r in results]
    for key, what, metric in (
        ("rm", "Reward-model ensemble held-out pairwise accuracy", "ensemble_accuracy"),
        ("prm", "Process reward model held-out step accuracy", "step_accuracy"),
    ):
        report = metrics.get(key) or {}
        if report.get(metric) is not None:
            lines += ["", f"{what}: **{report[metric]:.3f}**"]
        elif report.get("absent"):  # the stage dropped out (no data for it)
            lines += ["", f"Stage {key} dropped out: {report['absent']}"]
    if metrics.get("eval"):
        for suite, models in metrics["eval"]["suites"].items():
            if suite.startswith("harness/"):  # lm-eval's own metrics
                lines += [
                    "",
                    f"## Harness task `{suite.removeprefix('harness/')}`",
                    "",
                    "| model | metrics |",
                    "|---|---|",
                ]
                lines += [
                    f"| {name} | " + ", ".join(f"{k} {number(v)}" for k, v in m.items() if isinstance(v, float)) + " |"
                    for name, m in models.items()
                    if isinstance(m, dict)
                ]
                continue
            lines += [
                "",
                f"## Eval suite `{suite}`",
                "",
                "| model | accuracy [95% CI] | format | KL to ref | reward | win-rate |",
            ]
            lines.append("|---|---|---|---|---|---|")
            for name, m in models.items():
                if isinstance(m, dict):
                    lines.append(
                        f"| {name} | {with_interval(m, 'accuracy')} | {number(m.get('format_rate'))} "
                        f"| {number(m.get('kl_to_ref'))} | {number(m.get('reward'))} | {number(m.get('win_rate'))} |"
                    )
    if metrics.get("infer"):
        infer = metrics["infer"]
        lines += [
            "",
            f"## Inference-time compute on `{infer['candidate']}` ({infer['problems']} problems)",
            "",
            "| strategy | accuracy [95% CI] | tokens / problem | samples / problem | seconds |",
            "|---|---|---|---|---|",
        ]
        for name, m in infer["strategies"].items():
            lines.append(
                f"| {name} | {with_interval(m, 'accuracy')} | {m['tokens_per_problem']:.1f} "
                f"| {m['samples_per_problem']:.1f} "
                f"| {m['seconds']:.1f} |"
            )
    if metrics.get("rounds"):
        lines += rounds_table(metrics["rounds"])
    gate = metrics["gate"]
    gate_status = next((r["status"] for r in results if r["stage"] == "gate"), None)
    if gate and gate_status == "skipped":  # up to date: an earlier run's verdict, nothing moved now
        lines += ["", f"## Gate: not run, its inputs are unchanged (champion: {gate['champion']})"]
    elif gate:
        verdict = f"promoted **{gate['promote']}**" if gate["promoted"] else "no promotion"
        lines += ["", f"## Gate: {verdict} (champion: {gate['champion']})"]
        for name, result in gate["candidates"].items():
            status = "pass" if result["passed"] else "fail: " + "; ".join(result["failures"])
            lines.append(f"- {name}: {status}")
    return "\n".join(lines)
