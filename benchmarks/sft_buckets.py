"""Length-bucketed SFT (rlhf.training.bucketed_sft) against TRL's plain padded batches.

The sft stage runs twice per repeat in a scratch copy of the project, alternating
`sft.length_buckets: 1` (TRL's path) and the params.yaml value (default 4), on the same
base model, data and steps. Printed: the training seconds of each (metrics/sft.json, so
imports and saving are left out), the ratio of the medians, and the final logged losses,
which must agree to rounding (the sub-batches compute the same loss).

    python benchmarks/sft_buckets.py [--steps 200] [--repeats 2]

Needs models/base and data/prepared (runs `dvc repro base prepare` first if missing).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from timing import ensure_outputs, scratch_project, timed, write_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ensure_outputs("base", "prepare", needed=("models/base", "data/prepared"))
    buckets = [1, None]  # None: the params.yaml value
    results: dict = {b: {"seconds": [], "loss": []} for b in buckets}
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_project(Path(tmp), ("models/base", "data/prepared"))
        for _ in range(args.repeats):
            for b in buckets:

                def update(params, b=b):
                    params["sft"]["max_steps"] = args.steps
                    if b is not None:
                        params["sft"]["length_buckets"] = b

                write_params(work, update)
                shutil.rmtree(work / "models/sft", ignore_errors=True)
                timed([sys.executable, "-m", "stages.sft"], work)
                metrics = json.loads((work / "metrics/sft.json").read_text())
                results[b]["seconds"].append(metrics["train_seconds"])
                results[b]["loss"].append(metrics["train_loss"])
    plain, bucketed = (statistics.median(results[b]["seconds"]) for b in buckets)
    print(f"plain (length_buckets 1): median {plain:.1f} s  {[round(t, 1) for t in results[1]['seconds']]}")
    print(f"bucketed (params.yaml):   median {bucketed:.1f} s  {[round(t, 1) for t in results[None]['seconds']]}")
    print(f"final losses: plain {results[1]['loss']}, bucketed {results[None]['loss']}")
    print(f"ratio bucketed/plain: {bucketed / plain:.3f} ({args.steps} steps)")


if __name__ == "__main__":
    main()
