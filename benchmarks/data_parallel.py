"""Data-parallel training speed: a training stage in 2 processes (`compute.launcher:
torchrun`, gloo on CPUs) against 1 process, on the same global batch and number of steps.

Both run `python -m rlhf.cli.launch ...` as fresh processes in a scratch copy of the project
(its inputs copied in): one process with the default batch, then 2 processes sharing it
(sft and grpo: half of `per_device_train_batch_size` each; ppo: half of the
`rollout_batch_size` prompts each, its own loop). Each process of the 2-process run gets
`OMP_NUM_THREADS = cores / 2`, the 1-process run all the cores, so both use the whole
machine. The time is the stage's own `train_seconds` (training only; startup is printed
apart) and the ratio 2-process / 1-process of the medians is printed: below 1 means the
second process pays. Alternating runs.

    python benchmarks/data_parallel.py [--stage sft|grpo|ppo] [--steps 60] [--repeats 2]
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

from timing import ensure_outputs, scratch_project, timed, write_params

# stage: (launch arguments, its inputs, its output, its metrics file)
STAGES = {
    "sft": (["stages.sft"], ("models/base", "data/prepared"), "models/sft", "metrics/sft.json"),
    **{
        method: (["stages.rl", method], ("models/sft", "data/prepared"), f"models/policy/{method}",
                 f"metrics/policy/{method}.json")
        for method in ("grpo", "ppo")
    },
}  # fmt: skip


def params_for(stage: str, steps: int, processes: int):
    def update(params: dict) -> None:
        if stage == "sft":
            section = params["sft"]
        else:
            params["policy"] = {**params["policy"], "offline": [], "online": [stage]}
            section = params["policy"].setdefault(stage, {})
        section["max_steps"] = steps
        section["save_steps"] = steps  # one checkpoint at the end, as the default pipeline
        if processes > 1:
            if stage != "ppo":  # ppo shares rollout_batch_size across its processes itself
                section["per_device_train_batch_size"] = section.get("per_device_train_batch_size", 64) // processes
            params["compute"] = {**params.get("compute", {}), "launcher": "torchrun", "processes": processes}

    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=sorted(STAGES), default="sft")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    launch, inputs, output, metrics_file = STAGES[args.stage]
    ensure_outputs(*("base", "prepare") if args.stage == "sft" else ("sft",), needed=inputs)
    cores = os.cpu_count() or 2
    times: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_project(Path(tmp), inputs)
        for _ in range(args.repeats):
            for processes in (1, 2):
                write_params(work, params_for(args.stage, args.steps, processes))
                shutil.rmtree(work / output, ignore_errors=True)
                shutil.rmtree(work / "checkpoints", ignore_errors=True)
                env = {"OMP_NUM_THREADS": str(max(1, cores // processes))}
                total = timed([sys.executable, "-m", "rlhf.cli.launch", *launch], work, env=env)
                metrics = json.loads((work / metrics_file).read_text())
                assert metrics["processes"] == processes, metrics
                times[processes].append((metrics["train_seconds"], total))
    one = statistics.median(t for t, _ in times[1])
    two = statistics.median(t for t, _ in times[2])
    for processes in (1, 2):
        runs = ", ".join(f"{t:.1f} s (process {total:.1f} s)" for t, total in times[processes])
        print(f"{processes} process(es): training {runs}")
    print(f"{args.stage}: ratio 2 processes / 1 process (training, medians): {two / one:.2f} on {cores} cores")


if __name__ == "__main__":
    main()
