"""Data-parallel training speed: the sft stage in 2 processes (`compute.launcher: torchrun`,
gloo on CPUs) against 1 process, on the same global batch and number of steps.

Both run `python -m stages.launch stages.sft` as fresh processes in a scratch copy of the
project (models/base and data/prepared copied in): one process with the default
`per_device_train_batch_size`, then 2 processes with half of it each. Each process of the
2-process run gets `OMP_NUM_THREADS = cores / 2`, the 1-process run all the cores, so both
use the whole machine. The time is the stage's own `train_seconds` (training only; startup
is printed apart) and the ratio 2-process / 1-process of the medians is printed: below 1
means the second process pays. Alternating runs.

    python benchmarks/data_parallel.py [--steps 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from scratch import ensure_outputs, scratch_project, timed, write_params


def params_for(steps: int, processes: int):
    def update(params: dict) -> None:
        params["sft"]["max_steps"] = steps
        params["sft"]["save_steps"] = steps  # one checkpoint at the end, as the default pipeline
        if processes > 1:
            batch = params["sft"].get("per_device_train_batch_size", 32)
            params["sft"]["per_device_train_batch_size"] = batch // processes
            params["compute"] = {**params.get("compute", {}), "launcher": "torchrun", "processes": processes}

    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ensure_outputs("base", "prepare", needed=("models/base", "data/prepared"))
    cores = os.cpu_count() or 2
    times: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_project(Path(tmp), ("models/base", "data/prepared"))
        for _ in range(args.repeats):
            for processes in (1, 2):
                write_params(work, params_for(args.steps, processes))
                shutil.rmtree(work / "models/sft", ignore_errors=True)
                shutil.rmtree(work / "checkpoints", ignore_errors=True)
                env = {"OMP_NUM_THREADS": str(max(1, cores // processes))}
                total = timed([sys.executable, "-m", "stages.launch", "stages.sft"], work, env=env)
                metrics = json.loads((work / "metrics/sft.json").read_text())
                assert metrics["processes"] == processes, metrics
                times[processes].append((metrics["train_seconds"], total))
    one = statistics.median(t for t, _ in times[1])
    two = statistics.median(t for t, _ in times[2])
    for processes in (1, 2):
        runs = ", ".join(f"{t:.1f} s (process {total:.1f} s)" for t, total in times[processes])
        print(f"{processes} process(es): training {runs}")
    print(f"ratio 2 processes / 1 process (training, medians): {two / one:.2f} on {cores} cores")


if __name__ == "__main__":
    main()
