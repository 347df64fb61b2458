"""No-op rerun: `dvc repro` of the full, up-to-date pipeline against DVC's own floor.

The floor is a scratch DVC repository with the same DAG — the same stages (foreach
expanded), the same params sections, the same number of deps and outs with the same
dependency edges and cache/persist flags — whose commands only write tiny outputs. Both
are timed in this run, alternating, and the ratio of the medians is printed (target <= 1.2).
Whatever our no-op costs beyond the floor is the price of our outputs' sizes and layout.

    python benchmarks/noop_rerun.py [--repeats 5]

Runs `dvc repro` in the project first if anything is stale (that run is not timed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def dvc(*args: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "dvc", *args], check=False, cwd=cwd, env=ENV, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(f"dvc {' '.join(args)} failed in {cwd}:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def timed_noop(cwd: Path) -> float:
    start = time.perf_counter()
    output = dvc("repro", cwd=cwd)
    elapsed = time.perf_counter() - start
    if "Running stage" in output or "is cached" in output:
        raise SystemExit(f"not a no-op in {cwd}:\n{output}")
    return elapsed


def stage_layout(root: Path) -> list[dict]:
    """Stages of the project's DAG as plain data: name, deps, params, outs with flags."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        layout = []
        for stage in repo.index.stages:
            if not getattr(stage, "cmd", None):
                continue
            params = sorted({key for dep in stage.deps if hasattr(dep, "params") for key in dep.params})
            deps = [d.def_path for d in stage.deps if not hasattr(d, "params")]
            outs = [
                {
                    "path": o.def_path,
                    "cache": o.use_cache,
                    "persist": o.persist,
                    "metric": o.is_metric,
                    "plot": o.is_plot,
                }
                for o in stage.outs
            ]
            layout.append({"name": stage.addressing.replace("@", "-"), "deps": deps, "params": params, "outs": outs})
        return layout


WRITER = """import pathlib, sys
args = sys.argv[1:]
for arg in args:
    path = pathlib.Path(arg.rstrip("/"))
    # A folder: named with a slash, or holding another path written here.
    if arg.endswith("/") or any(other.startswith(arg.rstrip("/") + "/") for other in args):
        path.mkdir(parents=True, exist_ok=True)
        (path / "x").write_text("{}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
"""


def writer_command(outs: list[dict]) -> str:
    """A command that writes every out as a tiny file, or a folder holding one."""
    args = [o["path"] + ("/" if not Path(o["path"]).suffix else "") for o in outs]
    return "python write_outs.py " + " ".join(args)


def build_floor(root: Path, floor: Path) -> None:
    layout = stage_layout(root)
    produced = {o["path"] for s in layout for o in s["outs"]}
    stages = {}
    for stage in layout:
        for dep in stage["deps"]:
            if dep in produced or any(dep.startswith(p + "/") or p.startswith(dep + "/") for p in produced):
                continue
            target = floor / dep
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                if Path(dep).suffix:
                    target.write_text("x")
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    (target / "x").write_text("x")
        # Files inside this stage's output folders that other stages depend on must exist.
        inner = sorted({d for s in layout for d in s["deps"] for o in stage["outs"] if d.startswith(o["path"] + "/")})
        entry: dict = {"cmd": writer_command(stage["outs"]) + "".join(f" {d}" for d in inner), "deps": stage["deps"]}
        if stage["params"]:
            entry["params"] = stage["params"]
        for kind in ("outs", "metrics", "plots"):
            items = [o for o in stage["outs"] if (kind == "metrics") == o["metric"] and (kind == "plots") == o["plot"]]
            if items:
                entry[kind] = [{o["path"]: {"cache": o["cache"], "persist": o["persist"]}} for o in items]
        stages[stage["name"]] = entry
    (floor / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (floor / "write_outs.py").write_text(WRITER)
    shutil.copy2(root / "params.yaml", floor / "params.yaml")
    subprocess.run(["git", "init", "-q"], cwd=floor, check=True)
    dvc("init", "-q", cwd=floor)
    dvc("config", "core.analytics", "false", cwd=floor)
    dvc("repro", cwd=floor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dvc("repro", cwd=ROOT)  # bring the project up to date (untimed)
    with tempfile.TemporaryDirectory() as tmp:
        floor = Path(tmp) / "floor"
        floor.mkdir()
        build_floor(ROOT, floor)
        ours, base = [], []
        for _ in range(args.repeats):
            ours.append(timed_noop(ROOT))
            base.append(timed_noop(floor))
    ratio = statistics.median(ours) / statistics.median(base)
    print(f"no-op dvc repro, project: median {statistics.median(ours):.2f} s  {[round(t, 2) for t in ours]}")
    print(f"no-op dvc repro, floor:   median {statistics.median(base):.2f} s  {[round(t, 2) for t in base]}")
    print(f"ratio project/floor: {ratio:.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()
