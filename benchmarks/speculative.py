"""Speculative decoding: greedy generation of the SFT model with a small draft model
proposing tokens (transformers' assisted generation) against the same model's plain greedy
generation, one prompt at a time (assisted generation takes one sequence).

The target is this checkout's models/sft (`builtin:tiny`, 4 layers of 128). The draft is
`builtin:micro` (2 layers of 32) fine-tuned by the project's own sft stage for `--draft-steps`
steps in a scratch copy, so it shares the tokenizer and has learned the task's format. The
script checks that both decodings produce identical text, then prints the median times and
the ratio plain / speculative (above 1: speculative is faster).

    python benchmarks/speculative.py [--prompts 100] [--draft-steps 400] [--assistant-tokens 5]

Needs models/sft and data/prepared (runs `dvc repro sft` first if missing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
from timing import ROOT, ensure_outputs, scratch_project, timed

import rlhf  # noqa: F401  (offline environment)
from rlhf.inference.strategies import speculative
from rlhf.models.generation import generate
from rlhf.models.loading import count_parameters, load_causal_lm, load_tokenizer

INPUTS = ("models/sft", "data/prepared")


def micro_draft(steps: int):
    def update(params: dict) -> None:
        params["base"]["model"] = "builtin:micro"
        params["sft"].update(max_steps=steps, learning_rate=0.01)

    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--draft-steps", type=int, default=400)
    parser.add_argument("--assistant-tokens", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ensure_outputs("sft", needed=INPUTS)
    prompts = pd.read_parquet(ROOT / "data/prepared/eval/test.parquet")["prompt"].tolist()[: args.prompts]
    target, tokenizer = load_causal_lm(ROOT / "models/sft"), load_tokenizer(ROOT / "models/sft")
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_project(Path(tmp), ("data/prepared",), micro_draft(args.draft_steps))
        train = timed(["python", "-m", "stages.base"], work) + timed(["python", "-m", "stages.sft"], work)
        draft = load_causal_lm(work / "models/sft")
    print(
        f"target {count_parameters(target):,} parameters; draft {count_parameters(draft):,} (trained in {train:.0f} s)"
    )

    plain_times, assisted_times = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plain = [generate(target, tokenizer, [p], 64)[0] for p in prompts]
        plain_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        assisted = speculative(target, draft, tokenizer, prompts, 64, args.assistant_tokens)
        assisted_times.append(time.perf_counter() - start)
    same = sum(a.completion == p for a, p in zip(assisted, plain))
    if same != len(prompts):
        raise SystemExit(
            f"speculative output differs from plain greedy on {len(prompts) - same} of {len(prompts)} prompts"
        )
    plain_s, assisted_s = statistics.median(plain_times), statistics.median(assisted_times)
    print(f"identical greedy output on {same}/{len(prompts)} prompts")
    print(f"plain greedy:       median {plain_s:.2f} s  {[round(t, 2) for t in plain_times]}")
    print(f"speculative greedy: median {assisted_s:.2f} s  {[round(t, 2) for t in assisted_times]}")
    print(f"speed ratio plain/speculative: {plain_s / assisted_s:.2f}x (above 1 = speculative faster)")


if __name__ == "__main__":
    main()
