"""Stage `gate`: promote the best candidate only if it passes every capability test.

In:  reports/eval.json, the candidates' model directories, models/champion (the current
     champion and its record, if any), params `gate`.
Out: reports/gate.json (the verdict: per candidate, every test with its value, baseline and
     reason), models/champion (moved only on promotion), and in MLflow a new version of
     the registered model with the alias `champion`.

The tests and the rule are in rlhf.promotion. The champion is state, not a function of
this run's inputs, so models/champion is a persistent, uncached DVC output: DVC never
deletes or restores it, and a failed gate leaves it exactly where it was.

    python -m stages.capability_gate
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import mlflow
from mlflow.tracking import MlflowClient
from pydantic import Field

from rlhf.artifacts import atomic_dir, read_json, write_json
from rlhf.params import StageConfig
from rlhf.promotion import create_version, decide, install_champion, read_champion, set_champion_alias
from rlhf.tracking import git_commit, stage_run, tracking_uri
from stages import load_config

REPORT = Path("reports/eval.json")
VERDICT = Path("reports/gate.json")
CHAMPION_DIR = Path("models/champion")
MODEL_ARTIFACT = "model"


class CapabilityTest(StageConfig):
    name: str | None = Field(None, description="label in reports (default: built from the fields)")
    metric: str = Field(description="a metric of reports/eval.json, e.g. accuracy, format_rate, kl_to_ref")
    suite: str = Field("heldout", description="eval suite the metric is read from")
    op: Literal[">=", "<=", ">", "<"] = Field(">=", description="comparison")
    threshold: float = Field(0.0, description="added to the baseline: value op baseline + threshold")
    relative_to: Literal["absolute", "sft", "champion"] = Field("absolute", description="the baseline")


def _default_tests() -> list[CapabilityTest]:
    return [
        CapabilityTest(metric="accuracy", relative_to="sft", op=">=", threshold=0.0),
        CapabilityTest(metric="accuracy", relative_to="champion", op=">=", threshold=0.0),
        CapabilityTest(metric="format_rate", relative_to="absolute", op=">=", threshold=0.9),
        CapabilityTest(metric="kl_to_ref", relative_to="absolute", op="<=", threshold=10.0),
    ]


class Config(StageConfig):
    tests: list[CapabilityTest] = Field(default_factory=_default_tests, description="all must pass to promote")
    select_metric: str = Field("accuracy", description="among passing candidates, the highest of this wins")
    select_suite: str = Field("heldout", description="suite of select_metric")
    registered_model: str = Field("rlhf-policy", description="MLflow registered model that holds the champion")


def candidate_dir(name: str) -> Path:
    # `merged` is stage merge's output (see stages.evaluate.candidate_dirs); every other
    # candidate is a policy method's.
    return Path("models/merged") if name == "merged" else Path("models/policy") / name


def run(config: Config, report: dict, champion_dir: Path) -> dict:
    champion = read_champion(champion_dir)
    verdict = decide(
        config.tests, report, champion["metrics"] if champion else None, config.select_metric, config.select_suite
    )
    verdict["previous_champion"] = champion["candidate"] if champion else None
    return verdict


def promote(config: Config, verdict: dict, run_id: str) -> dict:
    """Log the winner's weights to the gate run, register them, move models/champion and
    the registry alias. Returns the new champion record."""
    name = verdict["promote"]
    source = candidate_dir(name)
    mlflow.log_artifacts(str(source), MODEL_ARTIFACT)
    client = MlflowClient(tracking_uri())
    version = create_version(client, config.registered_model, run_id, MODEL_ARTIFACT, {"candidate": name})
    record = {
        "candidate": name,
        "metrics": verdict["metrics"],
        "gate_run_id": run_id,
        "git_commit": git_commit(),
        "model_version": version,
    }
    with atomic_dir(CHAMPION_DIR) as staging:
        install_champion(source, record, staging)
    # The alias moves last: until here the registry's champion is still the old one.
    set_champion_alias(client, config.registered_model, version)
    return record


def keep_champion_dir(champion_dir: Path) -> None:
    """Before the first promotion, models/champion is a folder that says so (DVC expects
    the stage's declared output to exist); afterwards it is left exactly as it is."""
    if not champion_dir.exists():
        with atomic_dir(champion_dir) as staging:
            (staging / "README.md").write_text("No candidate has passed the capability gate yet.\n")


def main() -> None:
    config = load_config("gate")
    report = read_json(REPORT)
    with stage_run("gate", config) as active:
        verdict = run(config, report, CHAMPION_DIR)
        if verdict["promote"]:
            record = promote(config, verdict, active.info.run_id)
            verdict["champion"] = record["candidate"]
            verdict["model_version"] = record["model_version"]
            print(f"gate: promoted {record['candidate']} (registry version {record['model_version']})")
        else:
            verdict["champion"] = verdict["previous_champion"]
            keep_champion_dir(CHAMPION_DIR)
            for name, result in verdict["candidates"].items():
                print(f"gate: rejected {name}: " + "; ".join(result["failures"]))
        verdict["promoted"] = verdict["promote"] is not None
        mlflow.set_tags({"gate.promoted": str(verdict["promoted"]), "gate.champion": str(verdict["champion"])})
        mlflow.log_metric("promoted", float(verdict["promoted"]))
        write_json(VERDICT, verdict)
        mlflow.log_artifact(str(VERDICT))


if __name__ == "__main__":
    main()
