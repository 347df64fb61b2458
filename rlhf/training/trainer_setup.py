"""What every training stage shares: TRL config construction, checkpoint/resume, and
saving a trained model as a plain model.

TRL configs default to bf16 and gradient checkpointing; on a CPU (and for the tiny
built-in model) both cost more than they save, so they are chosen explicitly here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rlhf.atomic import published_path
from rlhf.models.compute import current
from rlhf.models.settings import kernels_key
from rlhf.params import InputError
from rlhf.training.checkpoints import usable_checkpoint
from rlhf.training.params import TrainingDataError, TrainingParams  # noqa: F401 (TrainingDataError: re-exported)


def use_cpu() -> bool:
    """Whether this process trains on the CPU (params `compute.device`)."""
    return current().on_cpu


def precision() -> dict[str, bool]:
    """Mixed-precision flags from params `compute.dtype`. On the CPU only bfloat16, and only
    when asked for (`auto` is float32 there): torch's CPU autocast has no float16, and
    bfloat16 pays off only on CPUs with bf16 instructions (AVX512-BF16, AMX)."""
    if use_cpu():
        return {"bf16": current().dtype == "bfloat16", "fp16": False}
    return current().training_precision()


class TrainingConfigError(InputError, ValueError):
    """TRL's config refused the options a params block gives it (its `trl:` values)."""


def checkpointing_args(config_cls, enabled: bool) -> dict[str, bool]:
    """Activation (gradient) checkpointing on or off, under the name the installed
    transformers reads: `activation_checkpointing` from 5.23, `gradient_checkpointing`
    before (TRL's configs turn it on by default, so it is always given)."""
    import dataclasses

    names = {field.name for field in dataclasses.fields(config_cls)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": enabled}


def trl_config(
    config_cls,
    params: TrainingParams,
    output_dir: Path,
    trust_remote_code: bool = False,
    key: str | None = None,
    defaults: dict[str, Any] | None = None,
    settings=None,
    **extra: Any,
):
    """A TRL `*Config` (or transformers' TrainingArguments) from a params block: the
    pipeline's defaults (the block's `TRL_DEFAULTS`, then `defaults`), which the block's
    `trl:` mapping may change, then the block's own keys (`params.trl_args()`), the
    caller's `extra` and what the pipeline owns: the checkpoint folder, precision from
    params `compute`, checkpointing from params `model`, no reporting (curves go through
    MLflowMetrics). `trust_remote_code` goes to the configs that have it: the trainers that
    load a frozen reference (or a reward model) from the policy's path load custom code only
    with it. A value TRL refuses fails naming `key` (the block's params key). `settings`: how
    the model loads, resolved by the caller (`loading_settings`), else resolved here."""
    import dataclasses

    if trust_remote_code and "trust_remote_code" in {f.name for f in dataclasses.fields(config_cls)}:
        extra["trust_remote_code"] = True
    settings = settings or loading_settings(params)
    arguments = {
        **params.TRL_DEFAULTS,
        "dataloader_num_workers": 0,
        **kernel_args(settings, kernels_key(getattr(params, "model", None), key)),
        **(defaults or {}),
        **params.trl,
        **params.trl_args(),
        **extra,
        "output_dir": str(output_dir),
        "use_cpu": use_cpu(),
        **precision(),
        **checkpointing_args(config_cls, settings.gradient_checkpointing),
        # The curves go to MLflow through MLflowMetrics (synchronous writes), not through
        # transformers' callback (asynchronous writes that a run's end waits on).
        "report_to": "none",
    }
    if arguments.get("use_liger_kernel"):  # a `trl:` mapping may ask for Liger too: its layer kernels only
        arguments["liger_kernel_config"] = {**(arguments.get("liger_kernel_config") or {}), **NO_FUSED_CROSS_ENTROPY}
    try:
        return config_cls(**arguments)
    except (TypeError, ValueError) as error:
        if key is None or not params.trl:
            raise
        raise TrainingConfigError(
            f"{key}.trl: TRL's {config_cls.__name__} refused these options ({error}); fix {key}.trl"
        ) from error


# Liger's fused linear cross-entropy replaces the model's forward: never on (kernel_args).
NO_FUSED_CROSS_ENTROPY = {"fused_linear_cross_entropy": False}


def kernel_args(settings, key: str = "model") -> dict[str, Any]:
    """TrainingArguments' Liger keys where params `model.kernels` applies Liger's kernels on
    this process's device (rlhf.models.settings.liger_kernels): its layer kernels only. Its
    fused linear cross-entropy replaces the model's forward, where TRL's trainers patch their
    chunked LM head and where a reward model has a classifier's head, so it stays off (TRL
    turns it off for its own trainers; transformers' Trainer, which trains the reward models,
    would not; `trl_config` keeps it off when a block's `trl:` asks for Liger itself). `key`:
    the params key named when the device cannot run them."""
    from rlhf.models.settings import liger_kernels

    if not liger_kernels(settings, current().device, key=key):
        return {}
    return {"use_liger_kernel": True, "liger_kernel_config": dict(NO_FUSED_CROSS_ENTROPY)}


# TRL's trainers that take a `quantization_config` of their own (CPO and ORPO read it from
# model_init_kwargs).
QUANTIZATION_ARGUMENT = ("SFTTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer", "RewardTrainer")


def loading_settings(params):
    """How a training block's model loads: params `model` (this process's, set by the stage)
    with the block's own `model:` keys over it. A training run resolves it once."""
    import rlhf.models.settings as model_settings

    return model_settings.current().merged(getattr(params, "model", None))


def trainer_loading(params: TrainingParams, trust_remote_code: bool, trainer_cls, settings=None) -> tuple[dict, dict]:
    """(the config's `model_init_kwargs`, the trainer's own keyword arguments) that make a
    TRL trainer load the model it is given as a path the way params `model` (with the
    block's own `model:` keys) says: the dtype (a name: the config is saved), attention,
    quantization (the trainer's `quantization_config` argument where it has one), and no
    device map unless quantized: the trainer places the model (TRL's "auto" would split it
    over the GPUs of one process). `settings`: as `trl_config`'s."""
    from rlhf.models.loading import init_kwargs

    settings = settings or loading_settings(params)
    adapters = getattr(getattr(params, "lora", None), "enabled", False)
    loading = init_kwargs(settings, training=True, adapters=adapters, trust_remote_code=trust_remote_code)
    loading["dtype"] = str(loading["dtype"]).removeprefix("torch.")
    loading.setdefault("device_map", None)
    quantization = loading.pop("quantization_config", None)
    if quantization is None:
        return loading, {}
    if any(cls.__name__ in QUANTIZATION_ARGUMENT for cls in trainer_cls.__mro__):
        return loading, {"quantization_config": quantization}
    return {**loading, "quantization_config": quantization}, {}


class MLflowMetrics(TrainerCallback):
    """The Trainer's logs (loss, learning rate, TRL's rewards ...) to the active MLflow run,
    from the main process, synchronously (rlhf.tracking.runs.log_metrics). Nothing is
    logged without an active run. After a write fails (the store is away or locked past its
    timeout), the callback stops writing and keeps the rows, so training waits on a broken
    store once; at the end of training it tries them once more and warns with the steps
    and names it could not log (the stage's curve CSV has them all). Every trainer of the
    project takes it (`callbacks=tracking_callbacks()`)."""

    def __init__(self):
        self.unlogged: list[tuple[int, dict[str, float]]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        import mlflow
        import torch

        from rlhf.tracking.runs import log_metrics

        if not state.is_world_process_zero or not logs or mlflow.active_run() is None:
            return
        metrics = {}
        for key, value in logs.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, int | float) and not isinstance(value, bool):
                metrics[re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", key)] = float(value)
        if not metrics:
            return
        if self.unlogged or not log_metrics(metrics, step=state.global_step):
            self.unlogged.append((state.global_step, metrics))

    def on_train_end(self, args, state, control, **kwargs):
        import mlflow

        from rlhf.tracking.runs import log_metrics, logger

        if not self.unlogged or mlflow.active_run() is None:
            return
        while self.unlogged and log_metrics(self.unlogged[0][1], step=self.unlogged[0][0]):
            self.unlogged.pop(0)
        if self.unlogged:
            steps = [step for step, _ in self.unlogged]
            names = sorted({name for _, metrics in self.unlogged for name in metrics})
            logger.warning(
                "MLflow did not log %d rows of training metrics (steps %d-%d: %s); the stage's curve file has them",
                len(steps), steps[0], steps[-1], ", ".join(names),
            )  # fmt: skip


TRACKING_ENV = "RLHF_TRACKING"  # "off": train without MLflow (a machine without it, benchmarks)


def tracking_callbacks() -> list[TrainerCallback]:
    """The trainers' callbacks: the curves to MLflow, unless RLHF_TRACKING=off (then MLflow
    is never imported: a GPU machine without it runs the stages' training as it is)."""
    import os

    return [] if os.environ.get(TRACKING_ENV, "").lower() == "off" else [MLflowMetrics()]


def fingerprint(config: Any, inputs: list[str | Path], context: Any = None, settings=None) -> str:
    """A key for checkpoints: the resolved config, how the model loads (params `model`), the
    identity (size, mtime) of every input file, and `context` (other settings the run's steps
    depend on, e.g. the task a reward reads answers with). A restarted run with the same key
    resumes; any change starts afresh. `settings`: as `trl_config`'s."""
    digest = hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode())
    loading = settings or loading_settings(config)
    digest.update(json.dumps(loading.model_dump(mode="json"), sort_keys=True).encode())
    if context is not None:
        digest.update(json.dumps(context, sort_keys=True, default=str).encode())
    for root in inputs:
        root = Path(root)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            stat = path.stat()
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def checkpoint_dir(root: Path, stage: str, key: str) -> Path:
    """Where a stage keeps its checkpoints under `root`: the caller keeps `root` outside DVC's
    outputs (DVC deletes those before a stage runs); one folder per fingerprint."""
    return Path(root) / stage.replace("@", "-") / key


def last_checkpoint(directory: Path, label: str = "resume") -> str | None:
    """The newest whole Trainer checkpoint in `directory` (damaged ones are discarded)."""
    found = usable_checkpoint(directory, "checkpoint", label)
    return str(found) if found else None


def discard_checkpoints(root: Path, stage: str) -> None:
    shutil.rmtree(Path(root) / stage.replace("@", "-"), ignore_errors=True)


ADAPTER_DIR = "adapter"  # a LoRA run's adapter, inside the (merged) model's folder


def merged_model(model):
    """The plain model behind a trainer's model: a peft adapter is merged into its base."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model


def plain_model(model, base_dir: str | Path, trust_remote_code: bool = False, auto_class=None, **kwargs):
    """`merged_model`, except over a quantized base (QLoRA): peft would merge the adapter
    into the 4-bit weights and quantize the sum again, so that updates smaller than a
    quantization step round away. There the adapter is saved and merged into the base
    loaded again unquantized from `base_dir` (`merge_adapter`; `auto_class` and `kwargs`
    load it as it was trained), as `save_trained` does for the policies."""
    if not (hasattr(model, "peft_config") and quantized(model)):
        return merged_model(model)
    import tempfile

    from rlhf.models.loading import merge_adapter

    with tempfile.TemporaryDirectory() as adapter:
        model.save_pretrained(adapter, safe_serialization=True)
        plain = merge_adapter(base_dir, adapter, trust_remote_code, auto_class, **kwargs)
    if getattr(plain.config, "pad_token_id", None) is None:  # a classifier scores padded batches
        plain.config.pad_token_id = model.config.pad_token_id
    return plain


def sharded_weights(trainer) -> bool:
    """Whether the launch's accelerate strategy gives each process a slice of the weights
    (FSDP, DeepSpeed ZeRO-3) instead of a whole copy (DDP, ZeRO-1/2)."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.deepspeed_config["zero_optimization"]["stage"] == 3
    return False


def final_weights(trainer, base_dir: str | Path | None = None, **base) -> tuple[Any, dict | None]:
    """What to save after training: (the plain model, LoRA merged; None), or under a
    sharding strategy (the unwrapped model; its full state dict, gathered from every
    process by accelerate's `get_state_dict`). Every process of a launch calls it; rank 0
    saves (`save_model(model, tokenizer, path, state_dict)`). `base_dir` (and `base`, how
    to load it): where the model was loaded from, for a QLoRA merge (`plain_model`)."""
    if not sharded_weights(trainer):
        if base_dir is not None:
            return plain_model(trainer.model, base_dir, **base), None
        return merged_model(trainer.model), None
    return trainer.accelerator.unwrap_model(trainer.model), trainer.accelerator.get_state_dict(trainer.model)


def adapters_without_casts(trainer) -> None:
    """Under mixed precision, let LoRA adapters read their input as autocast gives it. peft
    casts each adapter's input to the adapter's float32 before its matmul, and autocast casts
    it back to the compute dtype, so every adapted layer keeps one more copy of its input for
    the backward pass (seven per transformer block with `all-linear`). Without the cast the
    adapter's matmul saves the very input its base layer saves; the matmul runs in the
    compute dtype either way. Only inside `compute_loss`, which the Trainer runs under
    autocast (GRPO's and RLOO's generation, outside it, keeps peft's casts)."""
    if not (trainer.args.bf16 or trainer.args.fp16) or not hasattr(trainer.model, "peft_config"):
        return
    from peft.helpers import disable_input_dtype_casting

    compute_loss = trainer.compute_loss

    def without_casts(model, inputs, *args, **kwargs):
        with disable_input_dtype_casting(model):
            return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = without_casts


def trainable_in_compute_dtype(trainer) -> None:
    """Undo TRL's cast of a quantized model's trainable parameters to bfloat16 where no
    half-precision autocast runs (a CPU computing in float32). TRL's RewardTrainer casts
    them all, as QLoRA's paper stores adapters, which peft's LoRA layers survive (they cast
    their input) but a fully trained head does not (a sequence classifier's `score`, kept by
    peft's modules_to_save): its matmul would meet a float32 input with bfloat16 weights."""
    if trainer.args.bf16 or trainer.args.fp16 or not quantized(trainer.model):
        return
    dtype = current().torch_dtype
    for parameter in trainer.model.parameters():
        if parameter.requires_grad and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)


def quantized(model) -> bool:
    """Whether `model` (or the base under its adapter) holds bitsandbytes-quantized weights."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)) or bool(
        getattr(getattr(model, "base_model", None), "is_loaded_in_4bit", False)
    )


def save_trained(trainer, tokenizer, out_dir: Path, base_dir: Path) -> None:
    """Save what `trainer` trained into `out_dir` as a plain model every stage and plain
    transformers load: with LoRA, the adapter too (`out_dir/adapter`, peft's format, which
    loads back onto `base_dir`) and the adapter merged into the base. A quantized base
    (QLoRA) is not merged in its 4-bit form: the base is loaded again in the compute dtype
    and the saved adapter merged into it, as QLoRA's users do. Every process of a launch
    calls it (a sharded gather needs them all); rank 0 writes."""
    from rlhf.models.compute import is_main
    from rlhf.models.loading import check_finite, merge_adapter, save_model

    model = trainer.model
    adapters = hasattr(model, "peft_config") and not sharded_weights(trainer)
    if adapters:  # what training changed: the adapter (the base is as it loaded)
        check_finite({n: p for n, p in model.named_parameters() if p.requires_grad}, str(out_dir))
    if adapters and is_main():
        model.save_pretrained(str(Path(out_dir) / ADAPTER_DIR), safe_serialization=True)
    if adapters and quantized(model):
        if is_main():
            save_model(merge_adapter(base_dir, Path(out_dir) / ADAPTER_DIR), tokenizer, out_dir, checked=True)
        return
    weights, state_dict = final_weights(trainer)
    if is_main():  # the other processes of a multi-process launch trained the same weights
        save_model(weights, tokenizer, out_dir, state_dict, checked=adapters)


class NoFinalCheckpoint(TrainerCallback):
    """No checkpoint at the last step: transformers saves one there (weights, optimizer and
    scheduler states: 12 bytes a parameter under full fine-tuning, 6 GB for a 0.5 B model)
    that the stage deletes once it has published the model it saves next. On an H200 that
    save took as long as 30 training steps of Qwen2.5-0.5B's shape (benchmarks/README.md,
    GPU acceptance). A crash while the model is being published resumes from the last
    periodic checkpoint instead. Runs after transformers' own flow callback, so it has the
    last word on `should_save`."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            control.should_save = False

    on_epoch_end = on_step_end


# TRL's fused LM head (trl.trainer.utils, pinned TRL) projects onto the vocabulary this many
# rows at a time; its default is 32,768.
CPU_LM_HEAD_CHUNK = 8192


@contextlib.contextmanager
def cpu_lm_head_chunks(trainer):
    """While training on a CPU, TRL's fused LM head in chunks of CPU_LM_HEAD_CHUNK vocabulary
    rows (restored after). The head accumulates every product in float32; on a GPU it
    multiplies bf16 into float32 directly, on a CPU it converts each chunk of a bf16 head and
    its logits tile to float32 first (`_addmm_fp32`): 0.18 GB of transient copies a chunk of
    32,768 rows on Qwen2.5-0.5B's shape at 2 x 256 tokens, at the start of the backward
    pass, where memory peaks. Smaller chunks hold a quarter of that; the sums are the same
    float32 sums in another order."""
    import trl.trainer.utils as trl_utils

    default = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None)
    if trainer.args.device.type != "cpu" or default is None:
        yield
        return
    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = min(default, CPU_LM_HEAD_CHUNK)
    try:
        yield
    finally:
        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = default


def train_resumable(trainer, stage: str, key: str) -> str | None:
    """Train, resuming from the stage's last checkpoint for this fingerprint if one exists,
    without a checkpoint at the last step (`NoFinalCheckpoint`), the LM head in smaller
    chunks on a CPU (`cpu_lm_head_chunks`). Returns the checkpoint resumed from (None for a
    fresh start)."""
    from transformers import PreTrainedModel

    if sharded_weights(trainer) and not isinstance(trainer.model, PreTrainedModel):
        raise ValueError(
            f"{stage}: compute.accelerate_config shards the weights (FSDP or DeepSpeed ZeRO-3), which the pipeline "
            f"saves for plain Hugging Face models only, not for a {type(trainer.model).__name__} (a LoRA adapter, "
            "or the likelihood reward model): use configs/accelerate/ddp.yaml or deepspeed_zero2.yaml for it"
        )
    resume = last_checkpoint(Path(trainer.args.output_dir), stage)
    trainer.add_callback(NoFinalCheckpoint)
    if resume:
        print(f"{stage}: resuming from {resume}")
    with cpu_lm_head_chunks(trainer):
        trainer.train(resume_from_checkpoint=resume)
    return resume


def training_resources(trainer) -> dict:
    """What a run took beyond its steps: on a GPU its peak memory (GiB, since the process's
    last reset of the peak), and the tokens it trained on per second where the trainer
    counts them (TRL's `num_tokens`), with their count."""
    import torch

    measured = {}
    if torch.cuda.is_available():
        measured["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    history = trainer.state.log_history
    tokens = next((h["num_tokens"] for h in reversed(history) if "num_tokens" in h), None)
    tokens = tokens or getattr(trainer.state, "num_input_tokens_seen", 0)
    seconds = next((h["train_runtime"] for h in reversed(history) if "train_runtime" in h), None)
    if tokens and seconds:
        measured["train_tokens"] = float(tokens)
        measured["train_tokens_per_second"] = float(tokens) / seconds
    return measured


def quantized_lora_problem(settings, params, key: str) -> None:
    """A quantized base trains through adapters only (QLoRA): refused before the model loads."""
    from rlhf.params import ParamsError

    if settings.quantization is not None and not params.lora.enabled:
        raise ParamsError(
            "params.yaml",
            [
                f"{key}.lora.enabled: the model loads {settings.quantization.bits}-bit (model.quantization), and "
                "quantized weights train only through adapters (QLoRA): set lora.enabled: true, or "
                f"{key}.model.quantization: false"
            ],
        )


def log_history_rows(history: list[dict], keys: tuple[str, ...]) -> list[dict]:
    return [{"step": h["step"], **{k: h[k] for k in keys if k in h}} for h in history if any(k in h for k in keys)]


def last_logged(history: list[dict], key: str) -> float | None:
    values = [h[key] for h in history if key in h]
    return float(values[-1]) if values else None


def length_report(prompt_tokens, full_tokens, fits, max_length: int, key: str, path: Path, room: int = 1) -> dict:
    """{truncated_rows, dropped_rows} of a table against `max_length`, from each row's prompt
    tokens and prompt + completion tokens (sequences or numpy arrays: a large table's are
    arrays, 8 bytes a row) and whether it is kept (`fits`: its prompt leaves `room`
    completion tokens), printed when not 0; no row left is an error naming `key`. SFT, the
    offline policy methods and PPO report their rows with it."""
    import numpy as np

    prompt_tokens, full_tokens = np.asarray(prompt_tokens), np.asarray(full_tokens)
    fits = np.asarray(fits, dtype=bool)
    path = published_path(path)  # a round's training table is read from its staging folder
    dropped = int(len(fits) - fits.sum())
    truncated = int((fits & (full_tokens > max_length)).sum())
    if not fits.any():
        shortest = int(prompt_tokens.min())
        left = "no completion token" if room == 1 else f"fewer than the {room} tokens of a completion"
        raise TrainingDataError(
            f"{key} {max_length}: every prompt of {path} fills it (the shortest: {shortest} tokens), leaving {left} "
            f"to train on; raise {key} to at least {shortest + room}"
        )
    counted = [f"{truncated} are cut at the end (their last tokens and EOS are not trained)"] if truncated else []
    fills = "fills it" if room == 1 else f"leaves fewer than {room} tokens of it"
    counted += [f"{dropped} have a prompt that {fills} and are left out"] if dropped else []
    if counted:
        print(
            f"{key} {max_length}: of {len(fits)} rows of {path}, {' and '.join(counted)}; raise {key} to keep them "
            f"(the longest row: {int(full_tokens.max())} tokens)"
        )
    return {"truncated_rows": truncated, "dropped_rows": dropped}
