"""What the stage benchmarks share: a scratch copy of the project (code, params and the
inputs a stage needs, copied from this checkout's outputs) and a timer for one command in
a fresh process. The project's own outputs are never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
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
    for name in ("rlhf", "stages", "flows", "dvc.yaml", ".dvcignore"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, work / name)
    for name in inputs:
        shutil.copytree(ROOT / name, work / name)
    write_params(work, params_update)
    ENV["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    return work


def write_params(work: Path, params_update=None) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    if params_update:
        params_update(params)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
