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
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from timing import ROOT, ensure_outputs, scratch_project, timed


def override_steps(steps: int | None):
    def update(params: dict) -> None:
        if steps:
            params["sft"]["max_steps"] = steps

    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="override sft.max_steps (default: params.yaml)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ensure_outputs("base", "prepare", needed=("models/base", "data/prepared"))
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_project(Path(tmp), ("models/base", "data/prepared"), override_steps(args.steps))
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
