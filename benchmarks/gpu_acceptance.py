"""GPU acceptance: a model of real size through the real stages' training on a GPU, next to
the bare TRL trainers on the same model and data, in one process.

The model is Qwen2.5-0.5B's architecture and shape built from its config with random
weights (benchmarks/real_size.py; no model hub is reachable from the GPU machine either).
Each run trains for `--steps` steps and reports its peak GPU memory (torch's allocator,
reset before each run) and the tokens it trained on per second (TRL's `num_tokens` over its
train_runtime):

* sft: stage sft's training (stages.sft.run: rlhf.training.methods.sft) against TRL's
  SFTTrainer, full fine-tuning in bf16 mixed precision;
* dpo: stage policy@dpo's (stages.policy.run) against TRL's DPOTrainer, the same;
* grpo: stage rl@grpo's against TRL's GRPOTrainer (HF generation, the answer reward);
* sft-qlora: stage sft with params model.quantization {bits: 4} and LoRA against TRL's
  SFTTrainer with the same BitsAndBytesConfig and LoRA, when bitsandbytes imports.

sft and dpo also run TRL's trainer with TRL's own defaults (`trl_defaults`: 8 sequences of
up to 1,024 tokens, gradient checkpointing on, no packing, no Liger), as a user who calls
it with nothing set gets (Liger's module-wide replacements from a stage's run are undone
first). Every run reports its steady state after WARMUP steps: the median step and the
median interval between step ends (synchronised with the GPU), the tokens a step trained
on (TRL's `num_tokens` over the steps), their rate over the interval, and model-FLOPs
utilisation, 6N FLOPs a token (N: the parameters, an untied input embedding left out;
attention's own FLOPs left out, about 2% at this shape and length; `utilisation` says what
6N leaves out for DPO, LoRA and GRPO) against the GPU's dense bf16 peak (PEAK_TFLOPS by
device name, or --peak-tflops). GRPO's runs report the share of their steady steps spent
in generation (TRL's `_generate`, synchronised).

The stages run as their `run()` with their params validated as in a stage process, and
RLHF_TRACKING=off: the GPU machine has no MLflow (the stages' publishing, MLflow runs and
DVC are not what this measures). On the device machine (torch, transformers, peft and
accelerate there; TRL, datasets and pydantic carried as wheels, benchmarks/README.md):

    python3 benchmarks/gpu_acceptance.py --out $OUT           # the model's build included (--runs to choose)
    python benchmarks/gpu_acceptance.py --tiny --steps 2      # the same code on a CPU, in seconds (the tests)

Liger's kernels (params model.kernels, auto: on a CUDA GPU where liger-kernel imports) are
on in the stages' runs when its wheel is carried; the JSON's `liger` says whether it was.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RLHF_TRACKING", "off")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
for _offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_offline, "1")  # nothing is fetched: the model and data are local files

LORA = {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"}
WARMUP = 10  # steps left out of the steady state (compilation, the allocator's growth, the first batches)
# Dense bf16 tensor-core peaks, TFLOP/s (the vendors' data sheets, without sparsity), by a
# whole word of torch.cuda.get_device_name ("L4" is not "L40"); the first match wins. A card
# not listed gets no MFU unless --peak-tflops gives its peak.
PEAK_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("GH200", 989.4), ("A100", 312.0),
    ("L40S", 362.1), ("L4", 121.0), ("RTX 4090", 165.2),
)  # fmt: skip


def params_for(root: Path, model_dir: Path, steps: int, tiny: bool, small: bool = False) -> dict:
    """The project's params with this benchmark's model, data and budgets. On a GPU a token
    budget sized to the card: sft packs rows of 1,024 tokens (8 a step), dpo takes 32 pairs
    a step; `small`: 8 sequences of up to 264 tokens for both, as the first four calls."""
    import yaml

    batch = 2 if tiny else 8
    sft_length = 264 if tiny or small else 1024
    dpo_batch = batch if tiny or small else 32
    budget = {"max_steps": steps, "save_steps": 10_000, "logging_steps": 1, "per_device_train_batch_size": batch}
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["task"] = {"kind": "last_number"}
    params["compute"]["dtype"] = "float32" if tiny else "bfloat16"
    params["prepare"].update(
        source="files",
        files={
            "sft": {"path": str(root / "raw/sft.jsonl")},
            "prefs": {"path": str(root / "raw/prefs.jsonl")},
            "eval_heldout": {"path": str(root / "raw/heldout.jsonl")},
        },
    )
    params["base"]["model"] = str(model_dir)
    params["sft"].update(budget, max_length=sft_length, length_buckets=1, learning_rate=1e-5)
    params["policy"]["offline"], params["policy"]["online"] = ["dpo"], ["grpo"]
    params["policy"]["dpo"].update(
        budget, max_length=264, sft_weight=0.0, per_device_train_batch_size=dpo_batch
    )  # plain DPO, as TRL's default
    params["policy"]["grpo"].update(
        budget, num_generations=4, per_device_train_batch_size=4 * (2 if tiny else 8),
        max_completion_length=8 if tiny else 64, rewards=[{"name": "answer_match"}],
    )  # fmt: skip
    return params


CLOCKS: list = []  # the step clock of every training run in this process, in order
PROFILE: dict = {"dir": None, "label": "", "steps": (10, 12)}  # profile these steps of the next run when dir is set


def clock_every_training() -> None:
    """Give every Trainer's `train()` in this process a step clock (the stage's and the bare
    trainer's alike): the seconds of each optimizer step (synchronised with the GPU, from the
    step's start to its end, the batch's loading excluded) and between successive step ends
    (all of it). With PROFILE["dir"] set, the next run's steps PROFILE["steps"] are profiled
    (torch.profiler, CPU and CUDA) into `profile-<label>.txt` there."""
    import torch
    import transformers

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.steps, self.intervals, self.begun, self.ended, self.profiler = [], [], None, None, None
            self.generating = []  # (the step's index, seconds) of each call to GRPO's generation

        @staticmethod
        def now() -> float:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            if PROFILE["dir"] and state.global_step == PROFILE["steps"][0] and self.profiler is None:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
            self.begun = self.now()

        def on_step_end(self, args, state, control, **kwargs):
            end = self.now()
            self.steps.append(end - self.begun)
            if self.ended is not None:
                self.intervals.append(end - self.ended)
            self.ended = end
            if self.profiler is not None and state.global_step == PROFILE["steps"][1]:
                self.profiler.__exit__(None, None, None)
                averages = self.profiler.key_averages()
                by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
                text = "\n\n".join(averages.table(sort_by=key, row_limit=30) for key in ("self_cpu_time_total", by))
                Path(PROFILE["dir"]).mkdir(parents=True, exist_ok=True)
                (Path(PROFILE["dir"]) / f"profile-{PROFILE['label']}.txt").write_text(text)
                self.profiler, PROFILE["dir"] = None, None

    original = transformers.Trainer.train

    def train(self, *args, **kwargs):
        clock = StepClock()
        CLOCKS.append(clock)
        self.add_callback(clock)
        return original(self, *args, **kwargs)

    transformers.Trainer.train = train

    import trl

    generate = trl.GRPOTrainer._generate

    def timed_generate(self, *args, **kwargs):
        start = StepClock.now()
        try:
            return generate(self, *args, **kwargs)
        finally:
            if CLOCKS:
                CLOCKS[-1].generating.append((len(CLOCKS[-1].steps), StepClock.now() - start))

    trl.GRPOTrainer._generate = timed_generate


def step_times() -> dict:
    """The last run's median step and interval after its warm-up (WARMUP steps left out, or
    3 in a run of fewer than 2 x WARMUP steps), the steps that counted, its first 3 steps'
    seconds together, and the share of its steps spent generating where it generated."""
    import statistics

    if not CLOCKS or len(CLOCKS[-1].steps) < 5:
        return {}
    clock = CLOCKS[-1]
    warmup = WARMUP if len(clock.steps) >= 2 * WARMUP else 3
    times = {
        "median_step_seconds": round(statistics.median(clock.steps[warmup:]), 4),
        "median_interval_seconds": round(statistics.median(clock.intervals[warmup:]), 4),
        "steady_steps": len(clock.steps) - warmup,
        "first_3_steps_seconds": round(sum(clock.steps[:3]), 3),
    }
    if clock.generating:  # (step index, seconds): the steady steps' share
        generating = sum(seconds for index, seconds in clock.generating if index >= warmup)
        times["generation_share"] = round(generating / sum(clock.steps[warmup:]), 3)
    return times


def model_flops_per_token(model_dir: Path) -> float:
    """6N: the forward and backward FLOPs a trained token costs, N the model's parameters
    (an untied input embedding is a lookup, left out; a tied one is the LM head's matmul)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    if not getattr(config, "tie_word_embeddings", False):
        parameters -= model.get_input_embeddings().weight.numel()
    return 6.0 * parameters


def peak_flops(device: str, given: float | None) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s: --peak-tflops, else PEAK_TFLOPS by name; None
    when unknown (a CPU, an unlisted GPU): no MFU then."""
    import re

    if given:
        return given * 1e12
    return next((tflops * 1e12 for name, tflops in PEAK_TFLOPS if re.search(rf"\b{name}\b", device)), None)


def utilisation(numbers: dict, flops_per_token: float, peak: float | None) -> dict:
    """`numbers` with its steady-state tokens per second (the tokens a step trained on over
    the median interval between step ends: the batch's collation and the logging included)
    and, with a known peak, its model-FLOPs utilisation. 6N a token counts the policy's
    forward and backward only: a DPO reference's forward in the step (TRL's defaults; the
    stage precomputes it) is not counted, a LoRA or QLoRA run computes about 4N (no weight
    gradients for the frozen base) so 6N overstates it, and GRPO's steps include decoding."""
    tokens_per_step = numbers.get("tokens_per_step")
    if not tokens_per_step or not numbers.get("median_interval_seconds"):
        return numbers
    steady = tokens_per_step / numbers["median_interval_seconds"]
    mfu = round(flops_per_token * steady / peak, 4) if peak else None
    return {**numbers, "steady_tokens_per_second": round(steady, 1), "mfu": mfu}


@contextlib.contextmanager
def modelling_restored():
    """Liger's kernels, applied to a model instance, also replace names in its modelling
    module for the whole process (Qwen2's RMSNorm, MLP and rotary embedding): restored after
    a stage's run, so that a bare TRL run after it builds the model as transformers does."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    modules = (modeling_qwen2, modeling_llama)
    saved = [dict(vars(module)) for module in modules]
    try:
        yield
    finally:
        for module, names in zip(modules, saved):
            for name, value in names.items():
                if vars(module).get(name) is not value:
                    setattr(module, name, value)


def reset_peak() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def trainer_numbers(trainer, seconds: float) -> dict:
    """Peak GPU memory and tokens per second of a bare TRL trainer's run."""
    import torch

    history = trainer.state.log_history
    tokens = next((h["num_tokens"] for h in reversed(history) if "num_tokens" in h), None)
    runtime = next((h["train_runtime"] for h in reversed(history) if "train_runtime" in h), seconds)
    steps = trainer.state.global_step
    return {
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "train_tokens_per_second": float(tokens) / runtime if tokens else None,
        "tokens_per_step": float(tokens) / steps if tokens and steps else None,
        "steps": steps,
        "seconds": round(seconds, 1),
        **step_times(),
    }


def stage_numbers(metrics: dict, seconds: float) -> dict:
    tokens, steps = metrics.get("train_tokens"), metrics.get("steps")
    return {
        "peak_gpu_memory_gib": metrics.get("peak_gpu_memory_gib"),
        "train_tokens_per_second": metrics.get("train_tokens_per_second"),
        "tokens_per_step": tokens / steps if tokens and steps else None,
        "steps": steps,
        "seconds": round(seconds, 1),
        **step_times(),
    }


def bare(kind: str, block, model_dir: Path, out: Path, quantized: bool = False, rewards=(), trl_defaults=False) -> dict:
    """TRL's trainer as a user calls it by hand, with the stage's settings: the params block's
    own options (its `trl_args`, the same values the stage gives TRL), the same precision and
    checkpointing, no saving, tracking or checks. `trl_defaults`: TRL's own defaults instead
    (the block's step count only, logged every step)."""
    import pandas as pd
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from rlhf.training.trainer_setup import checkpointing_args

    on_gpu = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    table = {"sft": "sft", "dpo": "prefs", "grpo": "prompts"}[kind.split("-")[0]]
    dataset = Dataset.from_pandas(pd.read_parquet(out / f"data/prepared/{table}.parquet"), preserve_index=False)
    config_cls = {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig}[kind.split("-")[0]]
    own = {"output_dir": str(out / f"bare-{kind}"), "save_strategy": "no", "report_to": [], "bf16": on_gpu,
           "use_cpu": not on_gpu}  # fmt: skip
    if trl_defaults:
        args = config_cls(**own, max_steps=block.max_steps, logging_steps=1)
    else:
        own.update(checkpointing_args(config_cls, False))
        args = config_cls(**{**block.TRL_DEFAULTS, **block.trl_args(), **own})
    loading = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    peft_config = None
    if quantized:
        half = torch.bfloat16 if on_gpu else torch.float32  # the compute dtype, as the stage loads a QLoRA base
        loading = {"dtype": half, "attn_implementation": "sdpa", "device_map": {"": 0 if on_gpu else "cpu"}}
        loading["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=half,
        )  # fmt: skip
        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **loading)
    extra = {}
    if kind == "grpo":
        from rlhf.rewards.functions import build_rewards
        from rlhf.tasks import TaskConfig, get_task

        extra["reward_funcs"] = build_rewards(rewards, get_task(TaskConfig(kind="last_number")))[0]
    trainer_cls = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "grpo": trl.GRPOTrainer}[kind.split("-")[0]]
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=peft_config, **extra)  # fmt: skip
    reset_peak()
    start = time.perf_counter()
    trainer.train()
    return trainer_numbers(trainer, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=WARMUP + 200, help="sft and dpo runs' steps (warm-up included)")
    parser.add_argument("--grpo-steps", type=int, default=30, help="GRPO's steps (each generates: seconds a step)")
    parser.add_argument("--small-batches", action="store_true", help="8 sequences of 264 tokens a step (calls 1-4)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (else PEAK_TFLOPS by name)")
    parser.add_argument("--tiny", action="store_true", help="the micro model on a CPU: the code path, in seconds")
    parser.add_argument("--out", type=Path, help="write gpu_acceptance.json here")
    parser.add_argument("--runs", default="sft,dpo,grpo,sft-qlora", help="which pairs, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="each pair this many times, the order alternating")
    parser.add_argument("--bare-first", action="store_true", help="the bare trainer before the stage in a pair")
    parser.add_argument("--profile", action="store_true", help="profile steps 10-12 of each pair's first runs (--out)")
    args = parser.parse_args()
    runs = set(args.runs.split(","))
    clock_every_training()

    import importlib.util

    import torch
    import yaml

    from benchmarks.real_size import build_model, write_data

    work = Path(tempfile.mkdtemp(prefix="gpu-acceptance-"))
    model_dir = work / "model"
    if args.tiny:
        from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model

        tokenizer = build_tokenizer()
        tokenizer.model_max_length = 1024
        save_model(build_tiny_model("micro", tokenizer, 0, max_length=512), tokenizer, model_dir)
    else:
        build_model(model_dir)
    write_data(work / "raw")
    params = params_for(work, model_dir, args.steps, args.tiny, args.small_batches)
    params["policy"]["grpo"]["max_steps"] = args.grpo_steps
    os.chdir(work)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    import rlhf.models.settings as model_settings
    import stages
    import stages.base
    import stages.policy
    import stages.prepare
    import stages.sft
    from rlhf.models.compute import current
    from rlhf.tasks import get_task

    loaded = stages.load_model_stage()
    tables, _ = stages.prepare.run(loaded["prepare"], get_task(loaded["task"]))
    (work / "data/prepared").mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        if not name.startswith("eval_"):
            frame.to_parquet(work / f"data/prepared/{name}.parquet")
    (work / "models/base").mkdir(parents=True)
    stages.base.run(loaded["base"], work / "models/base")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    flops_per_token, peak = model_flops_per_token(model_dir), peak_flops(device, args.peak_tflops)
    results = {
        "device": device, "placement": str(current()), "steps": args.steps, "grpo_steps": args.grpo_steps,
        "liger": model_settings.liger_kernels(model_settings.current(), current().device),
        "flops_per_token": flops_per_token, "peak_flops": peak, "runs": {},
    }  # fmt: skip

    def fresh(name: str) -> Path:
        """The stage's output folder: `name`, or `name-2`, ... when repeated (the first stays
        where the policy stages read the SFT model)."""
        count = sum(1 for _ in work.glob(f"{name}*"))
        return work / (name if count == 0 else f"{name}-{count + 1}")

    def save() -> None:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpu_acceptance.json").write_text(json.dumps(results, indent=1))

    def measure(name: str, stage_run, bare_run, defaults_run=None) -> None:
        """A pair of runs (`--repeats` pairs, the order alternating), then bare TRL with TRL's
        defaults once where `defaults_run` is given; a failure is recorded and the next pair
        still runs (one call of the device tool is all there is), and what is measured so
        far is written at once."""
        if name not in runs:
            return

        def timed_stage() -> dict:
            shutil.rmtree(work / "checkpoints", ignore_errors=True)  # a repeat trains afresh, not resumes
            reset_peak()
            start = time.perf_counter()
            with modelling_restored():
                metrics, _ = stage_run()
            return stage_numbers(metrics, time.perf_counter() - start)

        for repeat in range(args.repeats):
            label = name if args.repeats == 1 else f"{name}-{repeat + 1}"
            bare_first = args.bare_first != bool(repeat % 2)
            pair = {}
            try:
                runs_here = (("bare_trl", bare_run), ("stage", timed_stage))[:: 1 if bare_first else -1]
                if defaults_run is not None and repeat == 0:
                    runs_here += (("bare_trl_defaults", defaults_run),)
                for who, run in runs_here:
                    if args.profile and args.out and repeat == 0:
                        PROFILE.update(dir=args.out, label=f"{who}-{name}")
                    pair[who] = utilisation(run(), flops_per_token, peak)
                results["runs"][label] = {**pair, "order": "bare first" if bare_first else "stage first"}
                print(f"{label}: " + " | ".join(f"{who} {numbers}" for who, numbers in pair.items()), flush=True)
            except Exception as error:  # noqa: BLE001 - the record says what broke; the others still run
                traceback.print_exc()
                results["runs"][label] = f"failed: {type(error).__name__}: {error}"
            PROFILE["dir"] = None
            save()

    measure(
        "sft",
        lambda: stages.sft.run(loaded["sft"], work / "models/base", work / "data/prepared/sft.parquet", fresh("sft")),
        lambda: bare("sft", loaded["sft"], model_dir, work),
        lambda: bare("sft", loaded["sft"], model_dir, work, trl_defaults=True),
    )
    # The policy stages start from the SFT model the stage just trained.
    (work / "models/sft").symlink_to(work / "sft")
    task = get_task(loaded["task"])
    for method in ("dpo", "grpo"):
        measure(
            method,
            lambda method=method: stages.policy.run(loaded["policy"], task, method, fresh(f"policy-{method}")),
            lambda method=method: bare(method, getattr(loaded["policy"], method), work / "sft", work,
                                       rewards=loaded["policy"].grpo.rewards),
            (lambda: bare("dpo", loaded["policy"].dpo, work / "sft", work, trl_defaults=True))
            if method == "dpo" else None,
        )  # fmt: skip
    if importlib.util.find_spec("bitsandbytes") is not None:
        qlora = loaded["sft"].model_copy(update={"lora": loaded["sft"].lora.model_copy(update=LORA)})
        model_settings.configure(loaded["model"], model_settings.ModelOverride(quantization={"bits": 4}))
        measure(
            "sft-qlora",
            lambda: stages.sft.run(qlora, work / "models/base", work / "data/prepared/sft.parquet", fresh("sft-q")),
            lambda: bare("sft-qlora", qlora, model_dir, work, quantized=True),
        )
    else:
        results["runs"]["sft-qlora"] = "skipped: bitsandbytes does not import here"
    print(json.dumps(results, indent=1))
    save()


if __name__ == "__main__":
    main()
