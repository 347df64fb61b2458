"""Stage overhead: `python -m stages.sft` against a bare TRL `SFTTrainer` script.

Both run as fresh processes (imports included) on the same base model, data, config and
number of steps, in a scratch copy of the project so the project's own outputs are not
touched. The bare script (benchmarks/bare_sft.py) is what a user would write by hand: load,
train, save, nothing else. Our stage adds params validation, MLflow logging, checkpoints,
metrics and plots. Alternating runs; the ratio of the medians is printed (target <= 1.15).

    python benchmarks/sft_overhead.py [--steps 600] [--repeats 2]

Needs models/base and data/prepared (runs `dvc repro base prepare` first if missing).
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


def timed(command: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return elapsed


def scratch_project(tmp: Path, steps: int | None) -> Path:
    work = tmp / "project"
    for name in ("rlhf", "stages", "flows", "dvc.yaml", ".dvcignore"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, work / name)
    for name in ("models/base", "data/prepared"):
        shutil.copytree(ROOT / name, work / name)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    if steps:
        params["sft"]["max_steps"] = steps
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="override sft.max_steps (default: params.yaml)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not (ROOT / "models/base").exists() or not (ROOT / "data/prepared").exists():
        subprocess.run([sys.executable, "-m", "dvc", "repro", "base", "prepare"], cwd=ROOT, env=ENV, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_project(Path(tmp), args.steps)
        env_tracking = f"sqlite:///{work / 'mlflow.db'}"
        ENV["MLFLOW_TRACKING_URI"] = env_tracking
        stage, bare = [], []
        for _ in range(args.repeats):
            shutil.rmtree(work / "models/sft", ignore_errors=True)
            stage.append(timed([sys.executable, "-m", "stages.sft"], work))
            bare.append(timed([sys.executable, str(ROOT / "benchmarks/bare_sft.py"), str(work)], work))
    ratio = statistics.median(stage) / statistics.median(bare)
    print(f"stages.sft:    median {statistics.median(stage):.1f} s  {[round(t, 1) for t in stage]}")
    print(f"bare TRL SFT:  median {statistics.median(bare):.1f} s  {[round(t, 1) for t in bare]}")
    print(f"ratio stage/bare: {ratio:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
