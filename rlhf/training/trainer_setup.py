"""What every training stage shares: TRL config construction, checkpoint/resume, and
saving a trained model as a plain model.

TRL configs default to bf16 and gradient checkpointing; on a CPU (and for the tiny
built-in model) both cost more than they save, so they are chosen explicitly here.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rlhf.artifacts import published_path
from rlhf.models.compute import current
from rlhf.params import InputError
from rlhf.training.checkpoints import usable_checkpoint
from rlhf.training.params import TrainingParams


def use_cpu() -> bool:
    """Whether this process trains on the CPU (params `compute.device`)."""
    return current().on_cpu


def precision() -> dict[str, bool]:
    """Mixed-precision flags from params `compute.dtype` (none on the CPU)."""
    return {"bf16": False, "fp16": False} if use_cpu() else current().training_precision()


def trl_config(config_cls, params: TrainingParams, output_dir: Path, trust_remote_code: bool = False, **extra: Any):
    """A TRL `*Config` from our params, with CPU-safe precision and checkpointing.
    `trust_remote_code` goes to the configs that have it: the trainers that load a frozen
    reference (or a reward model) from the policy's path load custom code only with it."""
    import dataclasses

    if trust_remote_code and "trust_remote_code" in {f.name for f in dataclasses.fields(config_cls)}:
        extra["trust_remote_code"] = True
    return config_cls(
        output_dir=str(output_dir),
        max_steps=params.max_steps,
        per_device_train_batch_size=params.per_device_train_batch_size,
        gradient_accumulation_steps=params.gradient_accumulation_steps,
        learning_rate=params.learning_rate,
        lr_scheduler_type=params.lr_scheduler_type,
        warmup_steps=params.warmup_ratio,
        weight_decay=params.weight_decay,
        max_grad_norm=params.max_grad_norm,
        logging_steps=params.logging_steps,
        save_strategy="steps",
        save_steps=params.save_steps,
        save_total_limit=1,
        seed=params.seed,
        data_seed=params.seed,
        use_cpu=use_cpu(),
        **precision(),
        activation_checkpointing=params.gradient_checkpointing,
        # The curves go to MLflow through MLflowMetrics (synchronous writes), not through
        # transformers' callback (asynchronous writes that a run's end waits on).
        report_to="none",
        dataloader_num_workers=0,
        **extra,
    )


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


def tracking_callbacks() -> list[TrainerCallback]:
    return [MLflowMetrics()]


def fingerprint(config: Any, inputs: list[str | Path], context: Any = None) -> str:
    """A key for checkpoints: the resolved config, the identity (size, mtime) of every input
    file, and `context` (other settings the run's steps depend on, e.g. the task a reward
    reads answers with). A restarted run with the same key resumes; any change starts afresh."""
    digest = hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode())
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


def merged_model(model):
    """The plain model behind a trainer's model: a peft adapter is merged into its base."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model


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


def final_weights(trainer) -> tuple[Any, dict | None]:
    """What to save after training: (the plain model, LoRA merged; None), or under a
    sharding strategy (the unwrapped model; its full state dict, gathered from every
    process by accelerate's `get_state_dict`). Every process of a launch calls it; rank 0
    saves (`save_model(model, tokenizer, path, state_dict)`)."""
    if not sharded_weights(trainer):
        return merged_model(trainer.model), None
    return trainer.accelerator.unwrap_model(trainer.model), trainer.accelerator.get_state_dict(trainer.model)


def train_resumable(trainer, stage: str, key: str) -> str | None:
    """Train, resuming from the stage's last checkpoint for this fingerprint if one exists.
    Returns the checkpoint resumed from (None for a fresh start)."""
    from transformers import PreTrainedModel

    if sharded_weights(trainer) and not isinstance(trainer.model, PreTrainedModel):
        raise ValueError(
            f"{stage}: compute.accelerate_config shards the weights (FSDP or DeepSpeed ZeRO-3), which the pipeline "
            f"saves for plain Hugging Face models only, not for a {type(trainer.model).__name__} (a LoRA adapter, "
            "or the likelihood reward model): use configs/accelerate/ddp.yaml or deepspeed_zero2.yaml for it"
        )
    resume = last_checkpoint(Path(trainer.args.output_dir), stage)
    if resume:
        print(f"{stage}: resuming from {resume}")
    trainer.train(resume_from_checkpoint=resume)
    return resume


def log_history_rows(history: list[dict], keys: tuple[str, ...]) -> list[dict]:
    return [{"step": h["step"], **{k: h[k] for k in keys if k in h}} for h in history if any(k in h for k in keys)]


def last_logged(history: list[dict], key: str) -> float | None:
    values = [h[key] for h in history if key in h]
    return float(values[-1]) if values else None


class TrainingDataError(InputError, ValueError):
    """The training data cannot be trained as params ask (no row fits max_length, a chat
    template TRL cannot mask)."""


def length_report(
    lengths: list[tuple[int, int]], fits: list[bool], max_length: int, key: str, path: Path, room: int = 1
) -> dict:
    """{truncated_rows, dropped_rows} of a table against `max_length`, from each row's
    (prompt tokens, prompt + completion tokens) and whether it is kept (`fits`: its prompt
    leaves `room` completion tokens), printed when not 0; no row left is an error naming
    `key`. SFT, the offline policy methods and PPO report their rows with it."""
    path = published_path(path)  # a round's training table is read from its staging folder
    dropped = len(fits) - sum(fits)
    truncated = sum(1 for (_, full), keep in zip(lengths, fits) if keep and full > max_length)
    if not any(fits):
        shortest = min(prompt for prompt, _ in lengths)
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
            f"(the longest row: {max(full for _, full in lengths)} tokens)"
        )
    return {"truncated_rows": truncated, "dropped_rows": dropped}
