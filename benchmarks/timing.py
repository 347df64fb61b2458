"""What the stage benchmarks share: a timer for one command in a fresh process, and a copy
of the project to time it in (the code as the studies copy it, studies/scratch.py; this
checkout's params; the outputs a stage reads, copied from this checkout's). The project's
own outputs are never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from studies.scratch import copy_code  # noqa: E402

ENV = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def ensure_outputs(*stages: str, needed: tuple[str, ...]) -> None:
    """Run `dvc repro` for `stages` when any `needed` output is missing in this checkout."""
    if not all((ROOT / path).exists() for path in needed):
        subprocess.run([sys.executable, "-m", "dvc", "repro", *stages], cwd=ROOT, env=ENV, check=True)


def timed(command: list[str], cwd: Path, env: dict | None = None) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, check=False, cwd=cwd, env={**ENV, **(env or {})}, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return elapsed


def scratch_project(tmp: Path, inputs: tuple[str, ...], params_update=None) -> Path:
    """A copy of the project's code and params under `tmp`, with the outputs `inputs`
    copied in; `params_update(params)` edits params.yaml in place. MLflow logs go to the
    copy's own sqlite store."""
    work = tmp / "project"
    work.mkdir(parents=True)
    copy_code(work)
    for name in inputs:
        shutil.copytree(ROOT / name, work / name, dirs_exist_ok=True)
    write_params(work, params_update)
    ENV["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    return work


def write_params(work: Path, params_update=None) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    if params_update:
        params_update(params)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
