"""Training the classifier PRM (rlhf.rewards.prm_classifier lays out its rows and loads
it): transformers' `Trainer` over tokenized PRM rows (TRL 1.x has no PRM trainer), with a
loss over the labelled positions that data-parallel processes share as one process would.
Here, not beside the model's layout in rewards/, so that rewards/ imports nothing from
training/ (training reads rewards, not the other way round)."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from transformers import DataCollatorForTokenClassification, Trainer, TrainingArguments

from rlhf.rewards.prm_classifier import HEAD_NAMES, IGNORE
from rlhf.training.params import LoraParams, TrainingParams
from rlhf.training.trainer_setup import tracking_callbacks, trl_config


def prm_training_args(params: TrainingParams, output_dir: str | Path, run_name: str = "prm") -> TrainingArguments:
    """The Trainer's arguments (checkpoints in `output_dir`): made before the model loads, as
    TRL's trainers make theirs, so that DeepSpeed ZeRO-3 partitions the weights as they load."""
    return trl_config(TrainingArguments, params, Path(output_dir), key="prm", run_name=run_name)


def prm_trainer(
    args: TrainingArguments,
    model,
    tokenizer,
    train: Dataset,
    lora: LoraParams | None = None,
) -> Trainer:
    """transformers' Trainer over tokenized PRM rows: token-level cross-entropy on the
    labelled positions (the model's own loss), with `args` (`prm_training_args`)."""
    peft_config = lora.peft_config("TOKEN_CLS") if lora is not None else None
    if peft_config is not None:
        from peft import get_peft_model

        # The new head is trained whole (peft's modules_to_save for TOKEN_CLS); "all-linear"
        # would also put an adapter on it, which peft refuses.
        peft_config.exclude_modules = list(HEAD_NAMES)
        model = get_peft_model(model, peft_config)
    # Right padding keeps every real token at the position it has at scoring time (Llama
    # numbers positions from the first slot, padding or not).
    tokenizer.padding_side = "right"
    return Trainer(
        model=model,
        args=args,
        train_dataset=train,
        data_collator=DataCollatorForTokenClassification(tokenizer, label_pad_token_id=IGNORE),
        processing_class=tokenizer,
        callbacks=tracking_callbacks(),
        compute_loss_func=labelled_token_loss,
    )


def labelled_token_loss(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy summed over the labelled positions, divided by the labelled positions
    of the whole optimizer step (every process, every accumulation step: the Trainer's
    `num_items_in_batch`), so that data-parallel processes train what one process trains.

    transformers' token-classification models take `**kwargs` but do not pass
    `num_items_in_batch` on to their loss; the Trainer, seeing the kwargs, scales the loss by
    the number of processes all the same, and 2 processes trained at twice the step."""
    logits = outputs["logits"].float()
    labels = labels.to(logits.device).view(-1)
    total = torch.nn.functional.cross_entropy(
        logits.view(-1, logits.size(-1)), labels, ignore_index=IGNORE, reduction="sum"
    )
    count = num_items_in_batch if num_items_in_batch is not None else (labels != IGNORE).sum().clamp(min=1)
    return total / count
