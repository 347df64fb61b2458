"""Supervised fine-tuning of a causal LM on an SFT table: TRL's `SFTTrainer` with the loss
on the completion only (prompt/completion data) or on the assistant turns only
(conversational data, through the chat template's generation markers), each batch run as
length-sorted sub-batches (rlhf.training.bucketed_sft: the same loss, less padding),
optionally with elastic weight consolidation (rlhf.training.ewc).

Checkpoints go to <checkpoints>/<stage>/<fingerprint>/ every `save_steps`; a killed run
restarted with the same params and inputs resumes from the last one. Stage sft, the
verifier and the self-improvement rounds train through `train_sft`.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlhf.training.params import SFTParams

CURVE_KEYS = ("loss", "mean_token_accuracy", "learning_rate")


def train_sft(
    config: SFTParams,
    base_dir: Path,
    data: Path,
    out_dir: Path,
    checkpoints: Path,
    stage: str = "sft",
    ewc=None,
) -> tuple[dict, list[dict]]:
    """Fine-tune the model in `base_dir` on the SFT table `data`, save the (merged) model
    into `out_dir`; return metrics and the loss curve. `stage` names the checkpoint folder
    under `checkpoints`. `ewc`: (EwcParams, the previous data's SFT table path) for elastic
    weight consolidation towards `base_dir`'s weights, or None."""
    from datasets import Dataset
    from trl import SFTConfig

    from rlhf.data.contracts import read_prepared
    from rlhf.models.compute import is_main
    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
    from rlhf.training.bucketed_sft import LengthBucketedSFTTrainer, tokenize_prompt_completion
    from rlhf.training.trainer_setup import (
        checkpoint_dir,
        discard_checkpoints,
        final_weights,
        fingerprint,
        last_logged,
        log_history_rows,
        tracking_callbacks,
        train_resumable,
        trl_config,
    )

    tokenizer = load_tokenizer(base_dir, config.trust_remote_code)
    model = load_causal_lm(base_dir, config.trust_remote_code, what=str(base_dir), training=True)
    table = read_prepared(data, "sft")
    conversational = "messages" in table.columns
    if conversational or not isinstance(table["prompt"].iloc[0], str):
        dataset = Dataset.from_pandas(table, preserve_index=False)
    else:  # tokenised here in one batched call, to the ids TRL would make row by row
        dataset = tokenize_prompt_completion(tokenizer, table["prompt"].tolist(), table["completion"].tolist())
    only_target = config.loss_on == "completion"
    consolidating = ewc is not None and ewc[0].strength > 0
    key = fingerprint(config, [base_dir, data, *([ewc[1]] if consolidating else [])])
    if consolidating:
        key += "-" + fingerprint(ewc[0], [])[:8]
    args = trl_config(
        SFTConfig,
        config,
        checkpoint_dir(checkpoints, stage, key),
        max_length=config.max_length,
        completion_only_loss=only_target and not conversational,
        assistant_only_loss=only_target and conversational,
        packing=False,
    )
    trainer = LengthBucketedSFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=config.lora.peft_config(),
        buckets=config.length_buckets,
        callbacks=tracking_callbacks(),
    )
    consolidation = None
    if consolidating:
        from rlhf.training.ewc import consolidate

        previous = read_prepared(ewc[1], "sft")
        scale = 1.0 / config.gradient_accumulation_steps
        consolidation = consolidate(trainer.model, tokenizer, previous, ewc[0], config.max_length, scale, config.seed)
    start = time.perf_counter()
    resumed = train_resumable(trainer, stage, key)
    history = trainer.state.log_history
    model, state_dict = final_weights(trainer)
    if is_main():  # the other processes of a multi-process launch trained the same weights
        save_model(model, tokenizer, out_dir, state_dict)
        discard_checkpoints(checkpoints, stage)
    metrics = {
        "train_loss": last_logged(history, "loss"),
        "mean_token_accuracy": last_logged(history, "mean_token_accuracy"),
        "steps": trainer.state.global_step,
        "processes": trainer.args.world_size,
        "train_seconds": time.perf_counter() - start,
        "resumed": bool(resumed),
    }
    if consolidation is not None:
        metrics["ewc_penalty"] = consolidation.penalty()
    return metrics, log_history_rows(history, CURVE_KEYS)
