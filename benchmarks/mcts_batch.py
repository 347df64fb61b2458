"""MCTS over several problems in lockstep (`infer.mcts.problems_per_batch`) against one
problem at a time, on the same problems in the same call.

The policy is this checkout's models/sft, the step scorer its models/prm (the default
pipeline's, as stage infer uses them), the settings params.yaml's `infer.mcts`. Each
setting of problems_per_batch searches the first `--problems` test problems; the script
prints, per setting, the wall time, the accuracy, and the speed ratio against
problems_per_batch 1 measured in the same run (above 1: lockstep is faster). The answers
differ between settings (a batch's draws depend on which problems share it), so the
accuracies are there to show none collapses, not to rank the settings.

    python benchmarks/mcts_batch.py [--problems 32] [--batches 1,8,32] [--repeats 2]

Needs models/sft, models/prm and data/prepared (runs `dvc repro prm` first if missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pandas as pd
import yaml
from timing import ROOT, ensure_outputs

import rlhf  # noqa: F401  (offline environment)
from rlhf.inference.settings import MCTS
from rlhf.inference.strategies import mcts_batch
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.rewards.prm import load_prm
from rlhf.tasks import TaskConfig, get_task

INPUTS = ("models/sft", "models/prm", "data/prepared")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32", help="problems_per_batch settings; the first is the baseline")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ensure_outputs("prm", "sft", needed=INPUTS)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    task = get_task(TaskConfig(**params["task"]))
    rows = pd.read_parquet(ROOT / "data/prepared/eval/test.parquet").head(args.problems)
    prompts, answers = rows["prompt"].tolist(), rows["answer"].tolist()
    model, tokenizer = load_causal_lm(ROOT / "models/sft"), load_tokenizer(ROOT / "models/sft")
    prm = load_prm(ROOT / "models/prm", False, task.step_separator)
    budget, seed = params["infer"]["max_new_tokens"], params["infer"]["seed"]
    settings = [int(b) for b in args.batches.split(",")]
    seconds: dict[int, list[float]] = {b: [] for b in settings}
    accuracy: dict[int, float] = {}
    for _ in range(args.repeats):
        for group in settings:
            options = MCTS(**{**params["infer"]["mcts"], "problems_per_batch": group})
            start, found = time.perf_counter(), []
            for first in range(0, len(prompts), group):
                found += mcts_batch(
                    model, tokenizer, prompts[first : first + group], task, prm.score_steps, options, budget,
                    seed + first,
                )  # fmt: skip
            seconds[group].append(time.perf_counter() - start)
            accuracy[group] = sum(task.is_correct(a.completion, y) for a, y in zip(found, answers)) / len(prompts)
    baseline = statistics.median(seconds[settings[0]])
    for group in settings:
        median = statistics.median(seconds[group])
        print(json.dumps({
            "problems_per_batch": group, "problems": len(prompts), "seconds": round(median, 1),
            "runs": [round(s, 1) for s in seconds[group]], "accuracy": round(accuracy[group], 3),
            "speedup": round(baseline / median, 2),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
