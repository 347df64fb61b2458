"""Stage `gate`: promote the best candidate only if it passes every capability test.

In:  reports/eval.json and reports/outcomes.json (per-problem outcomes, for paired tests),
     reports/validation.json (the adversarial validator's checks: each is one more test),
     the candidates' model directories, models/champion (the current champion and its
     record, if any), params `gate`, `task` (the default tests: `default_tests`) and
     `prepare.source`/`prepare.files` (which suite decides: dev when there is one).
Out: reports/gate.json (the verdict: per candidate, every test with its value, baseline,
     paired difference and interval, and reason), models/champion (moved only on
     promotion), and in MLflow a new version of the registered model with the alias
     `champion`.

The tests and the rule are in rlhf.evaluation.gate: relative tests are paired bootstrap
tests on the decision suite's per-problem outcomes, judged on the conservative end of the
interval, so the champion moves only for a gain larger than `threshold` with the
configured confidence. The champion is state, not a function of this run's inputs, so
models/champion is a persistent, uncached DVC output: DVC never deletes or restores it, and
a failed gate leaves it exactly where it was.

The verdict is written before any tracking call. The run's last tracking calls (the
verdict's tags, metric and file) come after the champion moved; when the tracking store
does not answer them, they are kept in models/.tracking-owed/ and the next gate logs them
to that run before anything else (`rlhf status` lists what is owed).

    python -m stages.gate
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from rlhf.atomic import atomic_dir, read_json, write_json
from rlhf.evaluation.gate import CapabilityTest
from rlhf.params import InputError
from rlhf.tracking.champion import ChampionMovedError, RegistryChampion, RegistryParams
from stages import (
    CHAMPION_DIR,
    REPORTS_DIR,
    TRACKING_OWED_DIR,
    candidate_dir,
    decision_suite,
    load_all,
    stage_process,
)

REPORT = REPORTS_DIR / "eval.json"
OUTCOMES = REPORTS_DIR / "outcomes.json"
VERDICT = REPORTS_DIR / "gate.json"
VALIDATION_REPORT = REPORTS_DIR / "validation.json"
MODEL_ARTIFACT = "model"
EXPERIMENT_ENV = "DVC_EXP_NAME"  # set by `dvc exp run` for the stages it runs


def default_tests(checks_answers: bool, has_format: bool, kl: bool = True) -> list[CapabilityTest]:
    """The tests `tests: null` means, for a task: accuracy shown above SFT's (the paired
    interval's lower end above 0: a candidate that scores as SFT does on every problem, one
    whose training changed nothing, is not promoted) and a
    gain of a point over the champion (tasks with checkable answers; otherwise the same on
    the RM's reward, with a win-rate of at least a half against SFT), a format rate of 0.9
    (tasks that define a format), and a bounded KL to SFT (where evaluate measures it:
    `kl`, evaluate.kl_prompts above 0)."""
    quality = "accuracy" if checks_answers else "reward"
    tests = [
        CapabilityTest(metric=quality, relative_to="sft", op=">", threshold=0.0),
        CapabilityTest(metric=quality, relative_to="champion", op=">", threshold=0.01),
    ]
    if not checks_answers:
        tests.append(CapabilityTest(metric="win_rate", relative_to="absolute", op=">=", threshold=0.5))
    if has_format:
        tests.append(CapabilityTest(metric="format_rate", relative_to="absolute", op=">=", threshold=0.9))
    if kl:
        tests.append(CapabilityTest(metric="kl_to_ref", relative_to="absolute", op="<=", threshold=10.0))
    return tests


class Config(RegistryParams):
    tests: list[CapabilityTest] | None = Field(
        None, description="all must pass to promote; null: the task's defaults (default_tests)"
    )
    select_metric: str | None = Field(
        None, description="among passing candidates, the highest of this wins; null: accuracy, or reward"
    )
    select_suite: str | None = Field(None, description="suite of select_metric; null: the decision suite")
    confidence: float = Field(0.95, gt=0, lt=1, description="level of the paired bootstrap intervals")
    bootstrap_samples: int = Field(2000, ge=100, description="resamples per paired test")
    trust_remote_code: bool = Field(
        False, description="a candidate with its own modelling code: allow it when logging the champion to MLflow"
    )
    promote_in_experiments: bool = Field(
        False, description="let a `dvc exp run` move the champion (by default its verdict is only reported)"
    )

    def cross_problems(self, run, section: str) -> list[str]:
        """The suites and metrics the tests and the selection read, and what the run needs
        for each metric to be in the eval report."""
        problems = run.suite_problems("gate.select_suite", self.select_suite, harness_scores=True)
        for index, test in enumerate(self.tests or []):
            problems += run.suite_problems(f"gate.tests[{index}].suite", test.suite, harness_scores=True)
        if not run.task.checks_answers and "prefs" not in run.available and None in (self.tests, self.select_metric):
            problems.append(
                f"gate: task.kind {run.task.name!r} has no checkable answers, so the default gate judges the reward "
                "model's reward, which needs preference data: add prepare.files.prefs, or set gate.tests and "
                "gate.select_metric"
            )
        for index, test in enumerate(self.tests or []):
            problems += run.metric_problems(f"gate.tests[{index}].metric", test.metric, test.suite)
        problems += run.metric_problems("gate.select_metric", self.select_metric, self.select_suite)
        for index, test in enumerate(self.tests or []):
            problems += run.metric_needs(test.metric, f"gate.tests[{index}]", "remove the test")
        if self.select_metric is not None:  # the candidates that pass are ranked on it
            problems += run.metric_needs(self.select_metric, "gate.select_metric", "choose another metric")
        return problems + self.difficulty_problems(run)

    def difficulty_problems(self, run) -> list[str]:
        """The tests that name a difficulty their suite lacks (run.difficulties tells)."""
        return [
            problem
            for index, test in enumerate(self.tests or [])
            for problem in run.difficulty_problems(f"gate.tests[{index}]", test.suite or run.decision, test)
        ]


def resolved_config(params: dict) -> Config:
    """The gate's Config of validated `params`, every null filled: the task's default tests
    on the decision suite, with a KL bound only where evaluate measures the KL."""
    from rlhf.tasks import get_task

    return resolve(params["gate"], get_task(params["task"]), decision_suite(params), params["evaluate"].kl_prompts > 0)


def resolve(config: Config, task, suite: str, kl: bool = True) -> Config:
    """`config` with every null filled for `task` and the decision `suite` (`kl`: evaluate
    measures the KL to SFT)."""
    tests = config.tests if config.tests is not None else default_tests(task.checks_answers, task.has_format, kl)
    return config.model_copy(
        update={
            "tests": [t if t.suite else t.model_copy(update={"suite": suite}) for t in tests],
            "select_metric": config.select_metric or ("accuracy" if task.checks_answers else "reward"),
            "select_suite": config.select_suite or suite,
        }
    )


def run(
    config: Config, report: dict, outcomes: dict | None, champion_dir: Path, validation: dict | None = None
) -> dict:
    """The verdict of a resolved `config` (`resolve`) on the eval report, with the
    validator's checks (reports/validation.json) as more tests."""
    from rlhf.evaluation.gate import decide
    from rlhf.tracking.champion import read_champion

    champion = read_champion(champion_dir)
    verdict = decide(
        config.tests,
        report,
        champion,
        config.select_metric,
        config.select_suite,
        outcomes,
        config.confidence,
        config.bootstrap_samples,
        validation,
    )
    verdict["previous_champion"] = champion["candidate"] if champion else None
    verdict["champion_record"] = (
        {k: champion.get(k) for k in ("pinned", "model_version", "gate_run_id")} if champion else None
    )
    return verdict


def champion_outcomes(outcomes: dict | None, name: str) -> dict:
    """The winner's per-problem outcomes per suite, kept in its record so that the next gate
    can pair a new candidate with it on the same problems."""
    if outcomes is None:
        return {}
    return {
        suite: {"digest": entry["digest"], "values": entry["models"][name]}
        for suite, entry in outcomes["suites"].items()
        if name in entry["models"]
    }


def promote(config: Config, verdict: dict, outcomes: dict | None, run_id: str, registry=None) -> dict:
    """Log the winner to the gate run as an MLflow transformers model, register it, move
    models/champion and the registry alias, unless the registry's champion is no longer
    `registry` (what the verdict was held against: `ChampionMovedError`). Returns the new
    champion record."""
    import mlflow

    from rlhf.tracking.champion import CHAMPION_RECORD, install_champion, log_registered_model, moving_champion
    from rlhf.tracking.runs import git_commit

    name = verdict["promote"]
    source = candidate_dir(name)
    version = log_registered_model(
        source, config.registered_model, MODEL_ARTIFACT, {"candidate": name}, config.trust_remote_code
    )
    client = registry_client()
    record = {
        "candidate": name,
        "metrics": verdict["metrics"],
        "outcomes": champion_outcomes(outcomes, name),
        "scorers": verdict.get("scorers"),  # the RM and reference that scored `metrics`
        "gate_run_id": run_id,
        "git_commit": git_commit(),
        "model_version": version,
    }
    mlflow.log_dict(record, CHAMPION_RECORD)  # what a rollback to this version restores
    # The folder and the alias move together: until then the registry's champion is the old one.
    with moving_champion(client, config.registered_model, version, CHAMPION_DIR, registry) as staging:
        install_champion(source, record, staging)
    return record


def keep_champion_dir(champion_dir: Path) -> None:
    """Before the first promotion, models/champion is a folder that says so (DVC expects
    the stage's declared output to exist); afterwards it is left exactly as it is."""
    if not champion_dir.exists():
        with atomic_dir(champion_dir) as staging:
            (staging / "README.md").write_text("No candidate has passed the capability gate yet.\n")


def held_back(
    verdict: dict, config: Config, experiment: str | None, temporary: bool, registry: tuple = (None, None)
) -> str | None:
    """Why a passing candidate does not move the champion, or None: a DVC experiment unless
    `promote_in_experiments` (never from a queued one's temporary copy: the champion it
    wrote would be discarded while the registry alias moved), a registry champion other than
    the one models/champion holds (another clone moved it: `registry` is the registry's
    (champion version, pin), `registry_champion`), or a champion pinned by a rollback, here
    or in the registry."""
    name = verdict["promote"]
    if not name:
        return None
    again = "run `dvc repro -f -s gate` in the workspace to promote it"
    if experiment and temporary:
        return (
            f"{name} passed in queued DVC experiment {experiment!r}, which runs in a temporary copy of the project: "
            f"the champion moves only in the workspace (`dvc exp apply {experiment}`, then {again})"
        )
    if experiment and not config.promote_in_experiments:
        return (
            f"{name} passed, but this is DVC experiment {experiment!r}: the champion moves only in the workspace's "
            f"own runs ({again}; gate.promote_in_experiments: true allows it)"
        )
    version, registry_pin, registry_run = RegistryChampion(*registry)
    record = verdict.get("champion_record") or {}
    local, local_run = record.get("model_version"), record.get("gate_run_id")
    if version is not None and version != local:
        holds = f"version {local}" if local else "no champion"
        return (
            f"{name} passed, but the registry's champion is version {version} and {CHAMPION_DIR} holds {holds} "
            f"(another clone moved it): `rlhf rollback --sync` brings {CHAMPION_DIR} to version "
            f"{version}; then {again}"
        )
    if version is not None and registry_run and local_run and registry_run != local_run:
        return (
            f"{name} passed, but the registry's champion, version {version}, is another model than {CHAMPION_DIR}'s "
            f"version {local} (logged by run {registry_run}, not {local_run}: a tracking store or registered model "
            f"other than the one this champion was promoted in): `rlhf rollback --sync` brings "
            f"{CHAMPION_DIR} to the registry's champion; then {again}"
        )
    pinned = record.get("pinned") or registry_pin
    if pinned:
        return (
            f"{name} passed, but the champion is pinned: {pinned}; `rlhf rollback --unpin` lets the gate move it again"
        )
    return None


def pending(verdict: dict) -> dict:
    """The verdict as written before the registry is read: nothing promoted yet."""
    waiting = {"promoted": False, "champion": verdict["previous_champion"]}
    if verdict["promote"]:
        waiting["pending"] = (
            f"{verdict['promote']} passed; the registry decides whether it is promoted, after this verdict "
            "was written (a gate that could not reach the tracking store failed here: rerun `dvc repro`)"
        )
    return {**verdict, **waiting}


def check_tracking_answers() -> None:
    """One message instead of the client's traceback when the tracking store does not
    answer: it holds the registry the champion moves in, so such a gate fails (its verdict
    on disk, nothing moved) and the next `dvc repro` runs it again."""
    from rlhf.tracking.runs import tracking_uri

    try:
        registry_client().search_experiments(max_results=1)
    except Exception as error:  # noqa: BLE001 - whatever the client raises for a store it cannot reach
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TrackingUnreachableError(
            f"gate: the tracking store at {tracking_uri()} (the model registry) did not answer ({first[:300]}); "
            f"the verdict is in {VERDICT} and nothing was promoted: `dvc repro` runs the gate again once it answers"
        ) from error


class TrackingUnreachableError(InputError, RuntimeError):
    """The gate's tracking store (the registry) cannot be reached."""


def registry_client():
    from mlflow.tracking import MlflowClient

    from rlhf.tracking.runs import tracking_uri

    return MlflowClient(tracking_uri())


def registry_state(config: Config):
    """The registry's champion (rlhf.tracking.champion.registry_champion)."""
    from rlhf.tracking.champion import registry_champion

    return registry_champion(registry_client(), config.registered_model)


def log_verdict(client, run_id: str, verdict: dict) -> None:
    """The verdict in gate run `run_id`: tags gate.promoted and gate.champion, metric
    promoted, and the verdict itself as gate.json."""
    import tempfile

    client.set_tag(run_id, "gate.promoted", str(verdict["promoted"]))
    client.set_tag(run_id, "gate.champion", str(verdict["champion"]))
    client.log_metric(run_id, "promoted", float(verdict["promoted"]))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / VERDICT.name
        write_json(path, verdict)
        client.log_artifact(run_id, str(path))


def owe_verdict(run_id: str, verdict: dict) -> Path:
    """Keep what `log_verdict` could not log, for the next gate (`settle_owed`)."""
    path = TRACKING_OWED_DIR / f"{run_id}.json"
    write_json(path, {"run_id": run_id, "verdict": verdict})
    return path


def settle_owed(client) -> list[str]:
    """Log every owed verdict to its run; those the store still refuses stay owed. Returns
    the runs brought up to date."""
    settled = []
    for path in sorted(TRACKING_OWED_DIR.glob("*.json")):
        owed = read_json(path)
        try:
            log_verdict(client, owed["run_id"], owed["verdict"])
        except Exception as error:  # noqa: BLE001 - whatever the tracking client raises
            print(f"gate: the verdict of gate run {owed['run_id']} is still owed to MLflow ({error})")
            continue
        path.unlink()
        settled.append(owed["run_id"])
        print(f"gate: logged the verdict of gate run {owed['run_id']}, which the tracking store missed then")
    return settled


def main() -> None:
    from rlhf.models.compute import freeze_startup_objects
    from rlhf.tracking.champion import recover_move
    from rlhf.tracking.runs import project_root, stage_run, tracked

    params = load_all()
    if stage_process():  # MLflow imported: out of the collector's sight (load_model_stage says why)
        freeze_startup_objects()
    config = resolved_config(params)
    report = read_json(REPORT)
    outcomes = read_json(OUTCOMES) if OUTCOMES.is_file() else None
    validation = read_json(VALIDATION_REPORT) if VALIDATION_REPORT.is_file() else None
    # A queued experiment runs in a temporary copy of the project, which has no champion
    # (models/ is not in git): it is judged against the workspace's.
    workspace_champion = project_root() / CHAMPION_DIR
    temporary = workspace_champion.resolve() != CHAMPION_DIR.resolve()
    champion_dir = workspace_champion if temporary else CHAMPION_DIR
    # The verdict first, from the files alone, before any tracking call: a tracking store
    # that cannot be reached below fails the stage with this verdict on disk (nothing
    # promoted yet), and the next `dvc repro` reruns the gate, which promotes and logs.
    verdict = run(config, report, outcomes, champion_dir, validation)
    write_json(VERDICT, pending(verdict))
    check_tracking_answers()
    with stage_run("gate", config) as active:
        if not temporary:  # what an earlier gate's tracking store missed, first
            settle_owed(registry_client())
        # A promotion or rollback killed midway is finished or undone before the verdict is
        # final (the workspace's own gate does it: a queued experiment's copy has none).
        recovered = None if temporary else recover_move(registry_client(), config.registered_model, CHAMPION_DIR)
        if recovered is not None:
            print(f"gate: {recovered.message}")
            verdict = run(config, report, outcomes, champion_dir, validation)  # against the champion now
            verdict["recovered"] = recovered.message
        registry = registry_state(config)
        held = held_back(verdict, config, os.environ.get(EXPERIMENT_ENV), temporary, registry)
        record = None
        if not held and verdict["promote"]:
            try:
                record = promote(config, verdict, outcomes, active.info.run_id, registry)
            except ChampionMovedError as error:  # another clone moved it meanwhile: nothing moved here
                held = f"{verdict['promote']} passed, but {error}"
        if held:
            verdict["held_back"] = held
            print(f"gate: {held}")
            verdict["promote"] = None
        if record is not None:
            verdict["champion"] = record["candidate"]
            verdict["model_version"] = record["model_version"]
            print(f"gate: promoted {record['candidate']} (registry version {record['model_version']})")
        else:
            verdict["champion"] = verdict["previous_champion"]
            keep_champion_dir(CHAMPION_DIR)
        for name, result in verdict["candidates"].items():
            if not result["passed"]:
                print(f"gate: rejected {name}: " + "; ".join(result["failures"]))
        verdict["promoted"] = verdict["promote"] is not None
        # The verdict is written before the run's last tracking calls, which only warn: a
        # tracking store gone away after a promotion never leaves a moved champion with a
        # failed stage whose rerun would report "not promoted".
        write_json(VERDICT, verdict)
        logged = False
        with tracked("the gate's verdict (kept in models/.tracking-owed: the next gate logs it)"):
            log_verdict(registry_client(), active.info.run_id, verdict)
            logged = True
        if not logged and not temporary:
            owe_verdict(active.info.run_id, verdict)


if __name__ == "__main__":
    main()
