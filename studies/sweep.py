"""Sweeps through DVC's experiment queue, for the studies whose settings are params changes
(seed_spread, prm_repair, ewc_shift, curriculum): a scratch DVC project with this
checkout's code, one `dvc exp run --queue -S ...` per experiment, `dvc queue start` workers,
and the results read back with `dvc exp show --json`, as a user runs a sweep of their own. In the scratch
project `dvc exp show` compares the experiments as it does any user's; an experiment the
project already has (by name) is not queued again, so running a study again with the same
`--work` resumes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from studies.scratch import ROOT, copy_code, write_results

# What a study's own stage (this checkout's driver, run in the scratch project) imports.
QUEUE_CODE = ("studies/sweep.py", "studies/scratch.py")


def project(work: Path, name: str, edit: Callable[[dict], None], stages: dict | None = None, files=()) -> Path:
    """The study's DVC project in `work`/project: this checkout's code, dvc.yaml with the
    study's own `stages` added, params.yaml edited by `edit`, `files` (paths relative to
    this checkout, such as the study's driver) and QUEUE_CODE copied, all committed to a
    git repository of its own. Made once; an existing one is returned as it is (a resumed study)."""
    root = work / "project"
    if (root / ".dvc").is_dir():
        return root
    root.mkdir(parents=True)
    copy_code(root)
    for path in (*QUEUE_CODE, *files):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, root / path)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    edit(params)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if stages:
        pipeline = yaml.safe_load((root / "dvc.yaml").read_text())
        pipeline["stages"].update(stages)
        (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    commit = ["git", "-c", "user.name=study", "-c", "user.email=study@localhost", "commit", "-qm", name]
    for command in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"], ["git", "add", "-A"], commit):
        subprocess.run(command, cwd=root, check=True, capture_output=True)
    return root


# Every seed of a round study's run: initialisation, SFT's data order, the round's problems
# and samples, its training's data order (the eval suites, prepare.seed, stay the same).
ROUND_SEEDS = ("base.seed", "sft.seed", "improve.defaults.seed", "improve.defaults.train.seed")


def round_project(work: Path, study: str, name: str, settings: dict) -> Path:
    """A round study's project (`project`): the built-in task with no planted habit
    (`shortcut_rate: 0`) and one round, `name` with `settings`, in `improve.rounds`."""

    def no_habit_round(params: dict) -> None:
        params["prepare"]["builtin"]["shortcut_rate"] = 0.0
        params["improve"]["rounds"] = {name: settings}

    return project(work, study, no_habit_round)


def round_overrides(seed: int, changes: dict | None = None, extra: list[str] = ()) -> list[str]:
    """A round study's experiment: every seed of ROUND_SEEDS set to `seed`, and `changes`."""
    return overrides({**{key: seed for key in ROUND_SEEDS}, **(changes or {})}, extra)


def enter_project(folder: Path) -> None:
    """Run a study's own stage in `folder` (the experiment's workspace), on its code."""
    os.chdir(folder)
    sys.path.insert(0, str(folder))


def environment(threads: int) -> dict:
    """What the queue's workers run with: this interpreter first on PATH, `threads` threads
    a stage, each experiment's MLflow runs in its own workspace's store."""
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RLHF_PARENT_RUN_ID", "DVC_STAGE", "DVC_ROOT"):
        env.pop(name, None)
    return env


def dvc(root: Path, env: dict, *args: str, check: bool = True) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"dvc {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def overrides(changes: dict, extra: list[str] = ()) -> list[str]:
    """`changes` ({params key: value}) and `extra` (KEY=VALUE) as `dvc exp run -S` arguments,
    in Hydra's override syntax: `++` sets a key params.yaml may not write out (a method's
    seed), or replaces it."""
    sets = [f"++{key}={value}" for key, value in changes.items()] + list(extra)
    return [arg for change in sets for arg in ("-S", change)]


def enqueue(root: Path, env: dict, experiments: dict[str, tuple[list[str], str]]) -> None:
    """Queue each experiment {name: (-S arguments, target stage)} the project does not have."""
    done = set(dvc(root, env, "exp", "list", "--name-only").split())
    for name, (arguments, target) in experiments.items():
        if name not in done:
            dvc(root, env, "exp", "run", "--queue", "--name", name, *arguments, target)


def start_workers(root: Path, env: dict, count: int) -> None:
    with open(root.parent / "queue-start.log", "a") as log:  # the workers outlive the command
        subprocess.run([sys.executable, "-m", "dvc", "queue", "start", "-j", str(count)], cwd=root, env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=True)  # fmt: skip


def run_queue(root: Path, env: dict, jobs: int) -> str:
    """Start `jobs` queue workers and wait until nothing is queued or running: the last
    `dvc queue status`. A worker that stops while experiments are still queued (seen once,
    with an experiment queued after the workers started) is replaced."""
    start_workers(root, env, jobs)
    shown = ""
    while True:
        status = dvc(root, env, "queue", "status")
        states = ("Queued", "Running", "Success", "Failed")
        counts = {state: len(re.findall(rf"\b{state}\b", status)) for state in states}
        line = ", ".join(f"{n} {state.lower()}" for state, n in counts.items() if n)
        if line != shown:
            print(f"{time.strftime('%H:%M:%S')} queue: {line}", flush=True)
            shown = line
        if not counts["Queued"] and not counts["Running"]:
            return status
        workers = re.search(r"Worker status: (\d+) active, (\d+) idle", status)
        busy = int(workers.group(1)) + int(workers.group(2)) if workers else jobs
        if counts["Queued"] and busy < jobs:
            start_workers(root, env, min(jobs - busy, counts["Queued"]))
        time.sleep(15)


def finished(root: Path, env: dict, names: set[str]) -> dict[str, dict]:
    """Each experiment of `names` that finished with metrics: {name: {"params": params.yaml's
    values, "metrics": {metrics file: its values}}} (`dvc exp show --json`)."""
    results = {}
    for baseline in json.loads(dvc(root, env, "exp", "show", "--json")):
        for experiment in baseline.get("experiments") or []:
            for rev in experiment["revs"]:
                data = rev.get("data") or {}
                metrics = {path: entry.get("data") for path, entry in (data.get("metrics") or {}).items()}
                if rev.get("name") in names and any(metrics.values()):
                    results[rev["name"]] = {"params": data["params"]["params.yaml"]["data"], "metrics": metrics}
    return results


def sweep(root: Path, env: dict, experiments: dict[str, tuple[list[str], str]], jobs: int):
    """Queue `experiments`, run the queue with `jobs` workers, and return what finished
    (`finished`), the minutes it took and the names of those that failed (the end of each
    one's log is printed): the caller writes what it has, then stops naming them."""
    start = time.perf_counter()
    enqueue(root, env, experiments)
    run_queue(root, env, jobs)
    results = finished(root, env, set(experiments))
    failed = sorted(set(experiments) - set(results))
    for name in failed:
        log = dvc(root, env, "queue", "logs", name, check=False)
        print(f"{name} failed; the end of its log (dvc queue logs {name}):\n{log[-3000:]}")
    return results, (time.perf_counter() - start) / 60, failed


def conclude(
    out: Path, results, table: str, count: int, minutes: float, jobs: int, failed: list[str], work: Path | None
) -> None:
    """A sweep's results and table to `out` (studies.scratch.write_results, the table headed
    by how many experiments finished and how long they took), then stop naming the failed
    ones, or remove the scratch folder when the study made it (`work` None: --work given)."""
    summary = f"{count} experiments through `dvc exp run --queue` (-j {jobs}), {minutes:.1f} min"
    write_results(out, results, f"{summary}\n\n{table}")
    if failed:
        raise SystemExit(f"{len(failed)} experiment(s) failed: {failed}")
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
