"""Memory of evaluate's KL to the reference at real size: `completion_kl`
(rlhf/evaluation/metrics.py) over 32 completions of 400 tokens on Qwen2.5-0.5B's shape
(its 151,936-token vocabulary, random weights; benchmarks/real_size.py's model), against
the same computation without chunks (both models' full-vocabulary log-probs for a whole
batch), measured on 2 rows in the same process and scaled to the batch.

    python benchmarks/kl_memory.py                 # 32 rows of 400 tokens (a few minutes on 2 cores)
    python benchmarks/kl_memory.py --rows 8 --tokens 200

Prints one JSON line: each computation's peak resident memory above what the process held
with both models loaded (the kernel's high-water mark, reset before each through
/proc/self/clear_refs), its seconds, and the ratio of the unchunked estimate to the chunked
peak. The policy is the reference with its weights moved by a little noise, so the KL is
not zero.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GIB = 2**30


def resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def high_water() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def reset_high_water() -> None:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the current resident set


def measured(function) -> tuple[float, float]:
    """(peak GiB above the resident set before, seconds) of `function()`."""
    reset_high_water()
    before, start = resident(), time.perf_counter()
    function()
    return (high_water() - before) / GIB, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=400, help="tokens of each prompt + completion")
    parser.add_argument("--model", type=Path, help="a Qwen2.5-0.5B-shaped folder (default: built in a temporary one)")
    args = parser.parse_args()

    import torch
    from real_size import build_model

    from rlhf.evaluation.metrics import completion_kl
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    model_dir = args.model or Path(tempfile.mkdtemp(prefix="kl-memory-")) / "qwen2.5-0.5b-random"
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    reference = load_causal_lm(model_dir)
    policy = load_causal_lm(model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    prompt_chars = args.tokens // 10  # the character-level tokenizer: a character a token
    prompts = [f"{i:0{prompt_chars}d}" for i in range(args.rows)]
    completions = [("12+34=46 " * args.tokens)[: args.tokens - prompt_chars] for _ in range(args.rows)]
    models_gib = resident() / GIB

    kl = []
    chunked_gib, chunked_s = measured(lambda: kl.append(completion_kl(policy, reference, tokenizer, prompts,
                                                                      completions, batch_size=args.rows)))  # fmt: skip
    rows = 2
    unchunked_gib, unchunked_s = measured(
        lambda: completion_kl(
            policy, reference, tokenizer, prompts[:rows], completions[:rows], batch_size=rows, budget=2**62
        )  # fmt: skip
    )
    vocab = policy.get_output_embeddings().weight.shape[0]
    line = {
        "rows": args.rows,
        "tokens": args.tokens,
        "vocabulary": vocab,
        "process_with_models_gib": round(models_gib, 2),
        "chunked_above_models_gib": round(chunked_gib, 2),
        "chunked_seconds": round(chunked_s, 1),
        f"unchunked_{rows}_rows_above_models_gib": round(unchunked_gib, 2),
        "unchunked_estimate_gib": round(unchunked_gib * args.rows / rows, 1),
        "ratio_unchunked_to_chunked": round(unchunked_gib * args.rows / rows / max(chunked_gib, 1e-9), 1),
        "mean_kl": round(float(kl[0].mean()), 4),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
