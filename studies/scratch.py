"""Scratch projects for the studies' drivers (studies/<study>/run.py): a copy of this
checkout's code in another folder, where the real stages run as processes against their own
MLflow store, so that a study never touches the checkout's outputs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CODE = ("rlhf", "stages", "flows", "configs", "data/raw", "dvc.yaml", ".dvcignore")


def copy_code(work: Path) -> None:
    """This checkout's code and DVC pipeline into `work` (replacing the copy there)."""
    for name in CODE:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, work / name, dirs_exist_ok=True)
        else:
            shutil.copy2(source, work / name)


def enter(work: Path) -> dict:
    """Make `work` the current folder with its own MLflow store (sqlite), here and in the
    environment returned for stage processes (which also finds this interpreter first)."""
    os.chdir(work)
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    return env


def run_module(env: dict, module: str, *args: str) -> str:
    """`python -m module args` in the current folder; its stdout, or exit with its output."""
    result = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{module} {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def set_key(params: dict, key: str, value) -> None:
    """params[`key`] = value, `key` a dotted path (policy.grpo.max_steps) whose parents exist."""
    node = params
    *path, last = key.split(".")
    for part in path:
        node = node[part]
    node[last] = value


def edit_params(work: Path, update) -> None:
    """`update(params)` edits the scratch project's params.yaml in place."""
    params = yaml.safe_load((work / "params.yaml").read_text())
    update(params)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def write_results(out: Path, results: dict, table: str) -> None:
    """An experiment's results as --out/results.json and its markdown table as
    --out/table.md (the repository keeps both), the table also on stdout."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "table.md").write_text(table + "\n")
    print(table)


def resident_gib() -> tuple[float, float]:
    """(this process's resident memory now, its high-water mark since it started), in GiB:
    /proc/self/status's VmRSS and VmHWM (Linux). VmHWM starts afresh at exec, where
    getrusage's ru_maxrss carries the forking parent's over."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 2**20, int(fields["VmHWM"].split()[0]) / 2**20
