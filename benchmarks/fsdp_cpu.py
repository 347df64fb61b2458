"""FSDP2 on 2 CPU processes over gloo, as accelerate's FSDP2 plugin would run it, against
one process: what accelerate will not launch on a CPU (it starts FSDP configs there as
plain data parallelism; docs/guides/real-models.md), run with torch's own `fully_shard`.

    python benchmarks/fsdp_cpu.py                  # Qwen2.5-0.5B's shape (random bf16 weights)
    python benchmarks/fsdp_cpu.py --model micro    # the built-in micro model (seconds)

Each of the 2 processes loads the model (float32 master weights, as full fine-tuning loads
them), shards it as the plugin wraps a decoder model (each decoder layer, then the root),
takes two SGD steps on its half of a 4-row batch, and gathers the full state dict with
the options accelerate's `get_state_dict` uses for FSDP2; rank 0 saves it through
`save_model`, as the training stages' `final_weights` and `save_trained` do. One process
then takes the same two steps on the whole batch and saves. It prints one JSON line: each
rank's share of the parameters after wrapping, each process's peak resident memory, the
wall times, the largest change two steps made to a weight, and the largest difference
between the two saved models' weights (both saved
in float32 here, `model.save_dtype: float32`, so that bf16 rounding does not hide it).
tests/test_distributed.py runs it on the micro model.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

EXACT = {"save_dtype": "float32"}


def batch_of(rows: int) -> torch.Tensor:
    """`rows` sequences of the same 6 tokens (no padding: each process's mean loss weighs its
    rows as the whole batch's mean does)."""
    from rlhf.models.loading import build_tokenizer

    tokenizer = build_tokenizer()
    return torch.tensor([tokenizer(f"{a} + {a} = {2 * a}")["input_ids"][:6] for a in range(10, 10 + rows)])


def sgd_steps(model, ids: torch.Tensor, steps: int = 2) -> None:
    """Plain SGD, not AdamW: Adam's first steps move each weight by about lr times the sign of
    its gradient, so a gradient near zero whose float32 sum differs in its last bits between
    1 and 2 processes moves that weight the other way (two AdamW steps at lr 0.01 on the
    0.5B shape: weights up to 0.0058 apart), which says nothing about the sharding."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def peak_gib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")) / 2**30


def sharded_worker(rank: int, port: int, base: str, out: str, facts: dict) -> None:
    """One of the 2 processes (torch.multiprocessing.spawn's `rank`)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
    from rlhf.models.settings import ModelSettings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    start = time.perf_counter()
    model = load_causal_lm(base, training=True)
    total = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    share = sum(p.to_local().numel() for p in model.parameters()) / total
    sgd_steps(model, batch_of(4)[2 * rank : 2 * rank + 2])
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)  # every rank takes part
    if rank == 0:
        save_model(model, load_tokenizer(base), out, state_dict, settings=ModelSettings(**EXACT))
    dist.barrier()
    facts[rank] = {"share": share, "peak_gib": peak_gib(), "seconds": time.perf_counter() - start}
    dist.destroy_process_group()


def one_process(base: Path, out: Path) -> dict:
    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
    from rlhf.models.settings import ModelSettings

    start = time.perf_counter()
    model = load_causal_lm(base, training=True)
    sgd_steps(model, batch_of(4))
    save_model(model, load_tokenizer(base), out, settings=ModelSettings(**EXACT))
    return {"seconds": time.perf_counter() - start}


def sharded(base: Path, out: Path) -> dict:
    """Both processes' facts: rank -> share, peak_gib, seconds."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    facts = mp.Manager().dict()
    mp.spawn(sharded_worker, args=(port, str(base), str(out), facts), nprocs=2)
    return dict(facts)


def largest_difference(a: Path, b: Path) -> tuple[list[str], float]:
    """(the tensor names the two saved models share, the largest absolute difference)."""
    from safetensors.torch import load_file

    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if sorted(first) != sorted(second):
        raise SystemExit(f"the saved models hold other tensors: {sorted(set(first) ^ set(second))}")
    return sorted(first), max((first[k].float() - second[k].float()).abs().max().item() for k in first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("qwen0.5b", "micro"), default="qwen0.5b")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        base = work / "base"
        if args.model == "micro":
            from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model

            save_model(build_tiny_model("micro", build_tokenizer(), seed=0), build_tokenizer(), base)
        else:
            from real_size import build_model

            build_model(base)
        ranks = sharded(base, work / "sharded")
        # the one-process run in a fresh process, so that its peak is its own
        import subprocess

        code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import fsdp_cpu as b; "
                f"from pathlib import Path; r = b.one_process(Path({str(base)!r}), Path({str(work / 'one')!r})); "
                "r['peak_gib'] = b.peak_gib(); print(json.dumps(r))")  # fmt: skip
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        one = json.loads(done.stdout.strip().splitlines()[-1])
        names, difference = largest_difference(work / "sharded", work / "one")
        update = largest_difference(work / "sharded", base)[1]
        print(json.dumps({"model": args.model, "ranks": ranks, "one_process": one, "tensors": len(names),
                          "largest_difference": difference, "largest_update": update}))  # fmt: skip


if __name__ == "__main__":
    main()
