"""Time of a context compressor's training step with `select` (rlhf/models/compressor.py):
every chunk encoded once without gradients and only the chunks read and a few others
back-propagated through (the default), against every chunk encoded with gradients
(`every_chunk`), same rows, same settings, same process.

    python benchmarks/compress_step.py                  # the study's settings (a few minutes on 2 cores)
    python benchmarks/compress_step.py --steps 5 --repeats 1

The model is the built-in tiny one, untrained (a step's time does not depend on its
weights), on the long-context word problems of the recipe tiny-long-context (1,000
characters of context: 8 chunks of 128 tokens), with the study's compressor: 32 slots per
chunk, query-aware, the adapter reading, `select: 2`, 8 rows a step, AdamW. Prints one JSON
line: seconds per step of each (medians over repeats, the two alternated) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat (after 2 untimed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--select", type=int, default=2)
    args = parser.parse_args()

    import torch

    from rlhf.models.compressor import ContextCompressor
    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.tasks.word_problems import WordProblemSizes, generate_datasets

    sizes = WordProblemSizes(sft=1, prefs=1, prefs_eval=1, unpaired=1, prm=1, prm_eval=1, prompts=1, eval_dev=1,
                             eval_test=1, eval_test_unseen=1, compress=args.batch * (args.steps + 2))  # fmt: skip
    rows = generate_datasets(sizes, seed=0, context_chars=1000)["compress"]
    tokenizer = build_tokenizer()
    model = build_tiny_model("tiny", tokenizer, seed=0)
    compressor = ContextCompressor.new(
        model, 32, 128, "tiny", window=256, query_aware=True, adapter_reads=True, select=args.select
    )
    optimizer = torch.optim.AdamW([p for p in compressor.parameters() if p.requires_grad], lr=1e-4)
    chunks = [len(tokenizer(r["context"], add_special_tokens=False)["input_ids"]) / 128 for r in rows]

    def run(every_chunk: bool) -> float:
        times = []
        for step in range(args.steps + 2):
            part = rows[step * args.batch : (step + 1) * args.batch]
            start = time.perf_counter()
            loss = compressor.loss(
                tokenizer, [r["context"] for r in part], [r["prompt"] for r in part],
                [r["completion"] for r in part], [r["relevant"] for r in part], every_chunk=every_chunk,
            )  # fmt: skip
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= 2:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    picked, every = [], []
    for _ in range(args.repeats):
        every.append(run(True))
        picked.append(run(False))
    result = {
        "chunks_per_context": round(statistics.mean(chunks), 2),
        "select": args.select,
        "batch": args.batch,
        "every_chunk_s_per_step": round(statistics.median(every), 3),
        "picked_s_per_step": round(statistics.median(picked), 3),
        "ratio": round(statistics.median(picked) / statistics.median(every), 3),
        "runs": {"every_chunk": [round(t, 3) for t in every], "picked": [round(t, 3) for t in picked]},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
