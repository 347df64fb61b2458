"""A model of real size through the real stages, on this machine: Qwen2.5-0.5B's
architecture and shape (0.49 B parameters, its 151,936-token vocabulary; built from its
config with random weights, saved as a local model folder in bfloat16, as the Hub's is),
through sft (LoRA on every linear layer), policy@dpo (LoRA) and evaluate.

It prints:

* the sft stage's peak memory above what its process held before it loaded the model
  (resident set, the same stage once with the base loaded in float32 and once in bfloat16:
  params `compute.dtype` float32, or bfloat16 with bf16 mixed precision, the LoRA base in
  that dtype), and their ratio;
* the sft stage's wall time against the bare TRL script benchmarks/bare_sft.py with the
  same settings (model and its dtype, data, LoRA, steps, batch, lengths; it saves the
  adapter, the stage the adapter and the merged model), both whole processes, in one run,
  alternated;
* whether the adapters load back onto the base with peft, and whether the merged model
  loads with plain transformers;
* policy@dpo's and evaluate's time and peak memory.

    python benchmarks/real_size.py                 # 30 sft steps, 8 DPO steps (about 35 min on 2 cores)
    python benchmarks/real_size.py --steps 8 --rounds 1

The data are text rows of 256 characters (256 tokens of the built-in character tokenizer:
2 x 256 tokens a step at batch 2). The model's embedding matrix has Qwen's size whatever
the tokenizer uses, so memory and time are those of the real shape.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Qwen/Qwen2.5-0.5B-Instruct's config.json (the shape; weights random).
QWEN25_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)  # fmt: skip
ROW = 256  # characters = tokens of a row (prompt + completion + EOS)


def build_model(path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.models.loading import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.model_max_length = 1024
    config = Qwen2Config(
        **QWEN25_05B,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, {path}")


def write_data(raw: Path) -> None:
    """Rows of ROW characters: a prompt of numbers and an answer line (task last_number)."""
    import random

    rng = random.Random(0)
    raw.mkdir(parents=True, exist_ok=True)

    def problem() -> tuple[str, str, str]:
        numbers = [rng.randint(1, 99) for _ in range(60)]
        prompt = " + ".join(map(str, numbers))[: ROW - 40] + " =\n"
        total = sum(numbers)
        answer = f"the sum is {total}"
        return prompt, answer.ljust(ROW - len(prompt) - 1, "."), str(total)

    rows = [problem() for _ in range(256)]
    with open(raw / "sft.jsonl", "w") as file:
        for prompt, completion, _ in rows:
            file.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    with open(raw / "prefs.jsonl", "w") as file:
        for prompt, completion, _ in rows[:64]:
            file.write(json.dumps({"prompt": prompt, "chosen": completion, "rejected": completion[::-1]}) + "\n")
    with open(raw / "heldout.jsonl", "w") as file:
        for prompt, _, answer in rows[-16:]:
            file.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")


def copy_code(root: Path) -> None:
    """This checkout's code into the scratch project `root`, replacing what a kept one held."""
    for name in ("rlhf", "stages", "flows", "configs", "dvc.yaml", ".dvcignore"):
        source, target = ROOT / name, root / name
        if target.is_dir():
            shutil.rmtree(target)
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)


def project(work: Path, model_dir: Path, steps: int) -> Path:
    """A scratch copy of the project's code with params for the real-size model."""
    import yaml

    root = work / "project"
    copy_code(root)
    write_data(root / "data/raw")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    budget = {"max_steps": steps, "save_steps": 1000, "logging_steps": 1, "per_device_train_batch_size": 2}
    lora = {"enabled": True, "r": 8, "alpha": 16, "target_modules": "all-linear"}
    params.update(
        task={"kind": "last_number"},
        prepare={**params["prepare"], "source": "files", "files": {
            "sft": {"path": "data/raw/sft.jsonl"}, "prefs": {"path": "data/raw/prefs.jsonl"},
            "eval_heldout": {"path": "data/raw/heldout.jsonl"}}},
        base={**params["base"], "model": str(model_dir)},
    )  # fmt: skip
    params["sft"].update(budget, max_length=ROW + 8, length_buckets=1, lora=lora, learning_rate=1e-4)
    params["policy"]["dpo"].update(budget, max_length=ROW + 8, lora=lora, per_device_train_batch_size=1)
    params["evaluate"].update(max_new_tokens=16, batch_size=4, kl_prompts=4, samples=1)
    params["infer"]["strategies"] = ["greedy", "self_consistency"]
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


# What runs in each measured process: the heavy libraries imported first, the resident set
# read, then the stage's main, then the peak. The peak is the process's own high-water mark
# (VmHWM of /proc/self/status: its memory map's, new at exec), not getrusage's ru_maxrss,
# which Linux carries over from the parent that forked the process.
PROBE = """
import json, sys, time, psutil, runpy
import torch, transformers, trl, peft, datasets, mlflow  # imported before the baseline

def high_water():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

before = psutil.Process().memory_info().rss
start = time.perf_counter()
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
seconds = time.perf_counter() - start
print("PROBE " + json.dumps({"before": before, "peak": high_water(), "seconds": seconds}))
"""


def measured(args: list[str], cwd: Path, env: dict | None = None) -> dict:
    """Run `python -m args[0] args[1:]` in a fresh process under PROBE: its wall time (the
    whole process) and peak resident memory above its level before the model loaded."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    probe = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])
    return {"wall": wall, "above": (probe["peak"] - probe["before"]) / 2**30, "peak": probe["peak"] / 2**30,
            "train_runtime": train_runtime(done.stdout)}  # fmt: skip


def train_runtime(stdout: str) -> float | None:
    """TRL's own measure of its training loop (the last `train_runtime` it printed)."""
    found = re.findall(r"'train_runtime': '([0-9.]+)'", stdout)
    return float(found[-1]) if found else None


def set_params(root: Path, update) -> None:
    import yaml

    params = yaml.safe_load((root / "params.yaml").read_text())
    update(params)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def check_outputs(root: Path) -> dict:
    """The adapter loads back onto the base with peft (and, merged, gives the stage's
    merged weights); the merged model loads with plain transformers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((root / "models/base/pointer.json").read_text())["path"]
    merged = AutoModelForCausalLM.from_pretrained(str(root / "models/sft"))
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=merged.dtype), str(root / "models/sft/adapter")
    ).merge_and_unload()
    plain = merged.state_dict()
    same = all(torch.allclose(with_adapter.state_dict()[k].float(), v.float(), atol=1e-2) for k, v in plain.items())
    return {"merged_loads_with_transformers": True, "adapter_loads_back": True, "adapter_merged_equals_saved": same,
            "merged_dtype": str(merged.dtype)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="sft steps")
    parser.add_argument("--dpo-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="stage/bare timing pairs, alternated")
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="real-size-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(work / "project")}
    model_dir = work / "qwen2.5-0.5b-random"
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    root = project(work, model_dir, args.steps)
    set_params(root, lambda p: p["policy"]["dpo"].update(max_steps=args.dpo_steps))
    env["PYTHONPATH"] = str(root)
    for stage in ("stages.prepare", "stages.base"):
        measured([stage], root, env)
    results: dict = {"sft_steps": args.steps, "dpo_steps": args.dpo_steps, "rows": f"2 x {ROW} tokens a step"}

    memory = {}
    # The LoRA base loads in the compute dtype (params model.dtype auto): float32, or
    # bfloat16 with bf16 mixed precision (CPU autocast, as a GPU's).
    for dtype in ("float32", "bfloat16"):
        set_params(root, lambda p, d=dtype: p["compute"].update(dtype=d))
        memory[dtype] = measured(["stages.sft"], root, env)
        print(f"sft, base in {dtype}: {memory[dtype]['above']:.2f} GiB above the pre-load level, "
              f"{memory[dtype]['wall']:.0f} s")  # fmt: skip
    results["sft_memory_gib_above_preload"] = {d: round(m["above"], 3) for d, m in memory.items()}
    results["sft_memory_ratio_bf16_to_fp32"] = round(memory["bfloat16"]["above"] / memory["float32"]["above"], 3)
    results["checks"] = check_outputs(root)

    # Time: the stage (bf16 base) against the bare TRL script, alternated, same settings.
    stage_times, bare_times, stage_loops, bare_loops = [], [], [], []
    for _ in range(args.rounds):
        run = measured(["stages.sft"], root, env)
        stage_times.append(run["wall"])
        stage_loops.append(run["train_runtime"])
        start = time.perf_counter()
        bare = [sys.executable, str(ROOT / "benchmarks/bare_sft.py"), str(root)]
        done = subprocess.run(bare, cwd=root, env={**os.environ, **env}, check=True, capture_output=True, text=True)
        bare_times.append(time.perf_counter() - start)
        bare_loops.append(train_runtime(done.stdout))
        print(f"sft stage {stage_times[-1]:.0f} s (training loop {stage_loops[-1]:.0f} s), "
              f"bare TRL {bare_times[-1]:.0f} s (training loop {bare_loops[-1]:.0f} s)")  # fmt: skip
    median = statistics.median
    results["sft_seconds"] = {
        "stage": [round(t, 1) for t in stage_times],
        "bare": [round(t, 1) for t in bare_times],
        "stage_training_loop": stage_loops,
        "bare_training_loop": bare_loops,
    }
    results["sft_time_ratio_stage_to_bare"] = {
        "whole_process_median": round(median(stage_times) / median(bare_times), 3),
        "whole_process_min": round(min(stage_times) / min(bare_times), 3),
        "training_loop_median": round(median(stage_loops) / median(bare_loops), 3),
        "fixed_cost_difference_s": round(
            (median(stage_times) - median(stage_loops)) - (median(bare_times) - median(bare_loops)), 1
        ),
    }

    for name, command in (("policy@dpo", ["stages.policy", "dpo"]), ("evaluate", ["stages.evaluate"])):
        if name == "evaluate":
            (root / "models/rm").mkdir(parents=True, exist_ok=True)  # no RM: the benchmark measures generation
            (root / "models/rm/absent.json").write_text(json.dumps({"absent": "not trained in this benchmark"}))
        m = measured(command, root, env)
        results[name] = {"seconds": round(m["wall"], 1), "peak_gib_above_preload": round(m["above"], 3)}
        print(f"{name}: {m['wall']:.0f} s, {m['above']:.2f} GiB above the pre-load level")
    report = json.loads((root / "reports/eval.json").read_text())
    results["evaluated"] = sorted(report["suites"]["heldout"]) if "suites" in report else sorted(report)
    print(json.dumps(results, indent=1))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
