"""A context compressor's training step (rlhf/models/compressor.py): its time with `select`,
and its memory with params `model.gradient_checkpointing`.

`--compare select` (the default): every chunk encoded once without gradients and only the
chunks read and a few others back-propagated through, against every chunk encoded with
gradients (`every_chunk`), same rows, same settings, same process (the two alternated).

`--compare checkpointing`: the same steps with the served model's layers recomputed in the
backward pass (`activation_checkpointing_enable`, what stage compress does under
`model.gradient_checkpointing`) against without, each in a process of its own: the peak
resident memory above the level before the first step, and seconds per step.

    python benchmarks/compress_step.py                  # the study's settings (a few minutes on 2 cores)
    python benchmarks/compress_step.py --steps 5 --repeats 1
    python benchmarks/compress_step.py --compare checkpointing --serve <a model folder> \\
        --context-chars 4000 --steps 2 --warmup 0

The model is the built-in tiny one, untrained (a step's time does not depend on its
weights), or the saved model in `--serve` (read through its chat template when it has one),
on the long-context word problems (`--context-chars` of context: 1,000 is the recipe
tiny-long-context's, 8 chunks of 128 tokens for the tiny model), with the study's
compressor: 32 slots per chunk, query-aware, the adapter reading, `select: 2`, 8 rows a
step, AdamW. Prints one JSON line with the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from studies.scratch import resident_gib  # noqa: E402


def setup(args):
    """(the compressor, its tokenizer, the rows, mean chunks per context)."""
    import torch

    from rlhf.models.compressor import ContextCompressor
    from rlhf.models.loading import build_tiny_model, build_tokenizer, load_causal_lm, load_tokenizer
    from rlhf.tasks.word_problems import WordProblemSizes, generate_datasets

    sizes = WordProblemSizes(sft=1, prefs=1, prefs_eval=1, unpaired=1, prm=1, prm_eval=1, prompts=1, eval_dev=1,
                             eval_test=1, eval_test_unseen=1, compress=args.batch * (args.steps + args.warmup))  # fmt: skip
    rows = generate_datasets(sizes, seed=0, context_chars=args.context_chars)["compress"]
    if args.serve is None:
        tokenizer = build_tokenizer()
        model, window = build_tiny_model("tiny", tokenizer, seed=0), 256
    else:
        tokenizer, model = load_tokenizer(args.serve), load_causal_lm(args.serve)
        window = getattr(model.config, "max_position_embeddings", None)
    if getattr(tokenizer, "chat_template", None):
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}],
                 "completion": [{"role": "assistant", "content": r["completion"]}]} for r in rows]  # fmt: skip
    compressor = ContextCompressor.new(
        model, 32, 128, str(args.serve or "tiny"), window=window, query_aware=True, adapter_reads=True,
        select=args.select, chunk_by=args.chunk_by,
    )  # fmt: skip
    compressor.train()
    torch.manual_seed(0)
    chunks = [len(tokenizer(r["context"], add_special_tokens=False)["input_ids"]) / 128 for r in rows]
    return compressor, tokenizer, rows, statistics.mean(chunks)


def steps(compressor, tokenizer, rows, args, every_chunk: bool = False) -> list[float]:
    """Seconds of each step after the warm-up ones (AdamW, lr 1e-4)."""
    import torch

    optimizer = torch.optim.AdamW([p for p in compressor.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for step in range(args.steps + args.warmup):
        part = rows[step * args.batch : (step + 1) * args.batch]
        start = time.perf_counter()
        loss = compressor.loss(
            tokenizer, [r["context"] for r in part], [r["prompt"] for r in part],
            [r["completion"] for r in part], [r["relevant"] for r in part], every_chunk=every_chunk,
        )  # fmt: skip
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def one_arm(args) -> dict:
    """`--arm on|off`, in its own process: checkpointing on or off."""
    compressor, tokenizer, rows, chunks = setup(args)
    if args.arm == "on":
        compressor.activation_checkpointing_enable()
    before, _ = resident_gib()
    times = steps(compressor, tokenizer, rows, args)
    return {"chunks_per_context": round(chunks, 2), "resident_gib_before": round(before, 3),
            "peak_above_gib": round(resident_gib()[1] - before, 3), "s_per_step": [round(t, 2) for t in times]}  # fmt: skip


def compare_checkpointing(args) -> dict:
    arms = {}
    for arm in ("off", "on"):
        command = [sys.executable, __file__, "--arm", arm] + [a for a in sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the {arm} arm failed:\n{done.stderr[-3000:]}")
        arms[arm] = json.loads(done.stdout.strip().splitlines()[-1])
    off, on = arms["off"], arms["on"]
    return {
        "serve": str(args.serve or "builtin:tiny"),
        "batch": args.batch,
        "select": args.select,
        "peak_above_gib": {"off": off["peak_above_gib"], "on": on["peak_above_gib"]},
        "memory_ratio": round(on["peak_above_gib"] / off["peak_above_gib"], 3),
        "time_ratio": round(statistics.median(on["s_per_step"]) / statistics.median(off["s_per_step"]), 3),
        "arms": arms,
    }


def compare_select(args) -> dict:
    compressor, tokenizer, rows, chunks = setup(args)
    picked, every = [], []
    for _ in range(args.repeats):
        every.append(statistics.median(steps(compressor, tokenizer, rows, args, every_chunk=True)))
        picked.append(statistics.median(steps(compressor, tokenizer, rows, args)))
    return {
        "chunks_per_context": round(chunks, 2),
        "select": args.select,
        "batch": args.batch,
        "every_chunk_s_per_step": round(statistics.median(every), 3),
        "picked_s_per_step": round(statistics.median(picked), 3),
        "ratio": round(statistics.median(picked) / statistics.median(every), 3),
        "runs": {"every_chunk": [round(t, 3) for t in every], "picked": [round(t, 3) for t in picked]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=("select", "checkpointing"), default="select")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat (after the warm-up ones)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="--compare select: alternated repeats")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--select", type=int, default=2)
    parser.add_argument("--chunk-by", choices=("tokens", "sentences"), default="tokens")
    parser.add_argument("--context-chars", type=int, default=1000)
    parser.add_argument("--serve", type=Path, default=None, help="a saved model's folder (default: the tiny model)")
    parser.add_argument("--arm", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(one_arm(args)))
    elif args.compare == "checkpointing":
        print(json.dumps(compare_checkpointing(args)))
    else:
        print(json.dumps(compare_select(args)))


if __name__ == "__main__":
    main()
