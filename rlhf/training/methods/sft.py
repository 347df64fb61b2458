"""Supervised fine-tuning of a causal LM on an SFT table: TRL's `SFTTrainer` with the loss
on the completion only (prompt/completion data) or on the assistant turns only
(conversational data, through the chat template's generation markers), each batch run as
length-sorted sub-batches (rlhf.training.bucketed_sft: the same loss, less padding),
optionally with elastic weight consolidation (rlhf.training.ewc). When SFT packs its
examples (`packs`: by default on a CUDA GPU, or `trl: {packing: true}`) TRL's own trainer
runs instead: packing removes the padding the sub-batches save.

The road is every method's (rlhf.training.trl_training.train_trl: checkpoints under
<checkpoints>/<stage>/<fingerprint>/ every `save_steps`, a killed run restarted with the
same params and inputs resuming from the last one; tracking; the merged save); SFT's own
are its row measurement (`sft_rows`), its trainer and its loss mask. Stage sft, the
verifier and the self-improvement rounds train through `train(job, params, out_dir)`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from rlhf.training.params import LoraParams, TrainingDataError, TrainingParams

NAME = "sft"
KIND = "supervised"  # its own stages: sft, verifier, and the rounds' method sft
DATA = "sft"


class Params(TrainingParams):
    """Supervised fine-tuning (TRL's SFTTrainer): stage sft, the verifier and the
    self-improvement rounds."""

    TRL_CONFIG: ClassVar[str | None] = "SFTConfig"
    TRL_DEFAULTS: ClassVar[dict[str, Any]] = {**TrainingParams.TRL_DEFAULTS, "packing": False}

    max_steps: int | None = Field(1000, gt=0, description="optimizer steps (null: trl.num_train_epochs)")
    per_device_train_batch_size: int = Field(64, gt=0, description="examples per step per device")
    learning_rate: float = Field(3e-3, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per example (longer ones are truncated)")
    loss_on: str = Field("completion", pattern="^(completion|all)$", description="completion only, or every token")
    length_buckets: int = Field(
        4, ge=1, description="run each batch as this many length-sorted sub-batches: same loss, less padding (1 = off)"
    )
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")

    def trl_args(self) -> dict[str, Any]:
        return {**super().trl_args(), "max_length": self.max_length}


SFTParams = Params  # the name the verifier's and the rounds' blocks extend

CURVE_KEYS = ("loss", "mean_token_accuracy", "learning_rate")


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    """Fine-tune the model in `job.start` on the SFT table `job.data` and save the (merged)
    model into `out_dir` (rlhf.training.trl_training.train_trl, as every method); metrics
    and the loss curve. `job.ewc` with `job.sft_data`: elastic weight consolidation towards
    `job.start`'s weights, with the Fisher information of that earlier table (a round's).

    Before the model loads (`sft_rows`): rows longer than `max_length` are counted
    (`truncated_rows`: TRL cuts their end, EOS included), rows with no completion token
    left are left out (`dropped_rows`), and conversational rows with `loss_on: completion`
    need a chat template whose assistant turns TRL can mask (`check_assistant_masking`)."""
    from dataclasses import replace

    from trl import SFTConfig, SFTTrainer

    from rlhf.data.prepared import existing, prepared_columns
    from rlhf.training.bucketed_sft import LengthBucketedSFTTrainer
    from rlhf.training.trl_training import train_trl

    job = replace(job, trust_remote_code=job.trust_remote_code or params.trust_remote_code)  # the block's own flag
    conversational = "messages" in prepared_columns(existing(job.data, job.stage))
    only_target = params.loss_on == "completion"
    # Packing removes the padding that length-sorted sub-batches would save: TRL's own trainer.
    packed = packs(params)
    trainer_cls, extra = (SFTTrainer, {}) if packed else (LengthBucketedSFTTrainer, {"buckets": params.length_buckets})
    trl_args = {
        "completion_only_loss": only_target and not conversational,
        "assistant_only_loss": only_target and conversational,
    }
    if packed and "packing" not in params.trl and "padding_free" not in params.trl:
        trl_args["packing"] = True
    rows = partial(sft_rows, params=params, key=job.key, start=job.start, path=job.data)
    metrics, curve = train_trl(
        job, params, (SFTConfig, trainer_cls), trl_args, out_dir,
        logged=("loss", "mean_token_accuracy"), curve=CURVE_KEYS, rows=rows, **extra,
    )  # fmt: skip
    return metrics | {"packed": bool(packed)}, curve


def sft_rows(dataset, tokenizer, params: Params, key: str, start: Path, path: Path):
    """(the rows SFT trains on, their counts): every row measured as it is trained (text rows
    tokenized here in batched calls, to the ids TRL would make row by row; conversations
    through the chat template), those whose prompt fills `max_length` left out
    (`length_report`), after the masking check of conversational data."""
    import numpy as np

    from rlhf.training.bucketed_sft import tokenized_rows
    from rlhf.training.trainer_setup import length_report

    conversational = "messages" in dataset.column_names
    if conversational and params.loss_on == "completion":
        check_assistant_masking(tokenizer, key, start)
    if conversational or not isinstance(dataset[0]["prompt"], str):
        measured = dataset.map(chat_lengths, batched=True, fn_kwargs={"tokenizer": tokenizer},
                               remove_columns=dataset.column_names, desc="Counting tokens")  # fmt: skip
    else:  # memory-mapped: each map is cached with the table
        dataset = measured = dataset.map(tokenized_rows, batched=True, fn_kwargs={"tokenizer": tokenizer},
                                         remove_columns=dataset.column_names, desc="Tokenizing")  # fmt: skip
    columns = measured.with_format("numpy", columns=["prompt_tokens", "full_tokens"])[:]  # arrays, not ints
    prompt_tokens, full_tokens = columns["prompt_tokens"], columns["full_tokens"]
    fits = prompt_tokens < params.max_length
    lost = length_report(prompt_tokens, full_tokens, fits, params.max_length, f"{key}.max_length", path)
    if not fits.all():
        dataset = dataset.select(np.flatnonzero(fits))
    return dataset.remove_columns([c for c in ("prompt_tokens", "full_tokens") if c in dataset.column_names]), lost


SFTDataError = TrainingDataError  # the SFT data cannot be trained as params ask


def check_assistant_masking(tokenizer, section: str, base_dir: Path) -> None:
    """`loss_on: completion` with conversational rows trains the assistant's turns only,
    through the chat template's `{% generation %}` markers: the template must have them,
    or be one TRL knows how to patch (Llama 3, Qwen, Gemma, Phi-3...). Else fail before the
    model loads, saying what to change (TRL fails after it, without naming the key)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    where = f"the tokenizer of {base_dir}"
    if not tokenizer.chat_template:
        raise SFTDataError(
            f"{section}: the SFT data holds conversations (messages) but {where} has no chat template: add one "
            "with base.chat_template (chatml, a template TRL ships such as llama3, or a .jinja file), or give "
            "prompt/completion text rows"
        )
    if has_generation_markers(tokenizer.chat_template):
        return
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        raise SFTDataError(
            f"{section}.loss_on: completion trains on the assistant's messages only, which needs a chat template "
            f"with {{% generation %}} markers; {where} has none and TRL cannot patch it. Set {section}.loss_on: all "
            "(every token), give the rows as prompt/completion (the loss then falls on the completion), or use a "
            "template with the markers"
        ) from None


def packs(config: Params) -> bool:
    """Whether SFT packs its examples (TRL's `packing`: best-fit-decreasing into rows of
    max_length, padding-free, each example attending only to itself). `trl.packing` (or
    `trl.padding_free`) decides when set. Unset, SFT packs on a CUDA GPU, where a batch's
    padding costs the most and the attention kernels (FlashAttention's variable-length
    path, transformers' block-diagonal masks for SDPA) keep packed examples apart, and runs
    length-sorted sub-batches elsewhere (a CPU: measured faster there, benchmarks/README.md).
    Packing changes what a step holds: `per_device_train_batch_size` rows of up to
    max_length tokens, each holding several examples."""
    from rlhf.models import compute

    if "packing" in config.trl or "padding_free" in config.trl:
        return bool(config.trl.get("packing") or config.trl.get("padding_free"))
    return compute.current().device.startswith("cuda")


def chat_lengths(batch: dict, tokenizer) -> dict:
    """(prompt tokens, prompt + completion tokens) of each conversational row of a batch
    (`messages`, or prompt/completion messages) through the chat template."""
    from rlhf.models.generation import format_prompt

    prompt_tokens, full_tokens = [], []
    rows = batch["messages"] if "messages" in batch else zip(batch["prompt"], batch["completion"])
    for row in rows:
        if "messages" in batch:
            messages = list(row)
            prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages
        else:
            prompt, messages = list(row[0]), list(row[0]) + list(row[1])
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt_tokens.append(len(tokenizer(format_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]))
        full_tokens.append(len(tokenizer(full, add_special_tokens=False)["input_ids"]))
    return {"prompt_tokens": prompt_tokens, "full_tokens": full_tokens}
