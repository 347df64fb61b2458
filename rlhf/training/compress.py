"""Training a context compressor (rlhf.models.compressor) on long-context rows.

transformers' `Trainer` (checkpoints, resume, the schedule, MLflow through the pipeline's
callback) over rows of (context, prompt, completion), minimizing the compressor's `loss`:
the completion's log-likelihood as the served model reads the context's slots and the
prompt. Only the encoder's LoRA adapter, the memory embeddings and the slot map train; the
served model's own weights stay as they are (the decoder is the model itself). The trainer
saves and resumes through the compressor's own `save_pretrained` and `load_trained`: a
`ContextCompressor` is no `PreTrainedModel`, and its checkpoint is its adapter, not the
served model's weights.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Trainer, TrainingArguments


def rows_columns(batch: list[dict]) -> dict[str, list]:
    """The Trainer's batch: each column's values as a list (text and conversations)."""
    return {key: [row[key] for row in batch] for key in batch[0]}


class CompressorTrainer(Trainer):
    """transformers' Trainer for a `ContextCompressor` (the module docstring)."""

    recite: float = 0.0  # the weight of writing the relevant sentences from the slots (compress.recite)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = model.loss(
            self.processing_class, inputs["context"], inputs["prompt"], inputs["completion"],
            inputs.get("relevant"), self.recite,
        )  # fmt: skip
        return (loss, None) if return_outputs else loss

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        self.model.save_pretrained(output_dir or self.args.output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        (model or self.model).load_trained(resume_from_checkpoint)


def with_crops(rows, crops: list[int], seed: int):
    """`rows` (context, prompt, completion, relevant) and, for each N in `crops`, each row
    again with its context cut to its relevant sentences and N sentences around them
    (rlhf.tasks.long_context.cropped), shuffled with `seed`: short contexts teach the
    encoder what to keep at a fraction of a whole context's cost, the whole ones teach the
    model to find it among many chunks."""
    import random

    import pandas as pd

    from rlhf.tasks.long_context import cropped

    rng = random.Random(seed)
    parts = [rows] + [
        rows.assign(context=[cropped(c, r, n, rng) for c, r in zip(rows["context"], rows["relevant"])]) for n in crops
    ]
    return pd.concat(parts, ignore_index=True).sample(frac=1.0, random_state=seed).reset_index(drop=True)


def train_compressor(params, model, tokenizer, rows, tokens: int, served_path: Path, checkpoints: Path, window: int):
    """A compressor of `tokens` slots per chunk for `model`, trained on `rows` with `params`
    (stages.compress.Config) (a frame of
    context, prompt, completion); checkpoints in `checkpoints` (a killed run resumes). Returns
    (the compressor, the Trainer's log history)."""
    from datasets import Dataset

    from rlhf.models.compressor import ContextCompressor
    from rlhf.training.trainer_setup import tracking_callbacks, train_resumable, trl_config

    compressor = ContextCompressor.new(
        model, tokens, params.chunk_tokens, str(served_path), params.lora_r, params.lora_alpha, params.seed, window,
        query_aware=params.query_aware, adapter_reads=params.adapter_reads, slot_positions=params.slot_positions,
        select=params.select, chunk_by=params.chunk_by,
    )  # fmt: skip
    args = trl_config(
        TrainingArguments,
        params,
        checkpoints,
        key="compress",
        run_name=f"compress-{tokens}",
        remove_unused_columns=False,
    )
    if params.crops:  # stages.compress.run refuses crops and recite without a `relevant` column
        rows = with_crops(rows, params.crops, params.seed)
    columns = ["context", "prompt", "completion"] + (["relevant"] if params.recite > 0 or params.select else [])
    data = Dataset.from_pandas(rows[columns].reset_index(drop=True))
    trainer = CompressorTrainer(
        model=compressor,
        args=args,
        train_dataset=data,
        data_collator=rows_columns,
        processing_class=tokenizer,
        callbacks=tracking_callbacks(),
    )
    trainer.recite = params.recite
    train_resumable(trainer, "compress", f"k{tokens}")
    return compressor, trainer.state.log_history
