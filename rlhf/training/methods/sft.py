"""Supervised fine-tuning of a causal LM on an SFT table: TRL's `SFTTrainer` with the loss
on the completion only (prompt/completion data) or on the assistant turns only
(conversational data, through the chat template's generation markers), each batch run as
length-sorted sub-batches (rlhf.training.bucketed_sft: the same loss, less padding),
optionally with elastic weight consolidation (rlhf.training.ewc). When SFT packs its
examples (`packs`: by default on a CUDA GPU, or `trl: {packing: true}`) TRL's own trainer
runs instead: packing removes the padding the sub-batches save.

Checkpoints go to <checkpoints>/<stage>/<fingerprint>/ every `save_steps`; a killed run
restarted with the same params and inputs resumes from the last one. Stage sft, the
verifier and the self-improvement rounds train through `train_sft`.
"""

from __future__ import annotations

import time
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


def train_sft(
    config: Params,
    base_dir: Path,
    data: Path,
    out_dir: Path,
    checkpoints: Path,
    stage: str = "sft",
    ewc=None,
    section: str | None = None,
) -> tuple[dict, list[dict]]:
    """Fine-tune the model in `base_dir` on the SFT table `data`, save the (merged) model
    into `out_dir`; return metrics and the loss curve. `stage` names the checkpoint folder
    under `checkpoints`. `ewc`: (EwcParams, the previous data's SFT table path) for elastic
    weight consolidation towards `base_dir`'s weights, or None. `section`: the params key
    of `config`, named in errors (default: `stage`).

    Before the model loads: rows longer than `max_length` are counted (`truncated_rows`:
    TRL cuts their end, EOS included), rows with no completion token left are left out
    (`dropped_rows`), and conversational rows with `loss_on: completion` need a chat
    template whose assistant turns TRL can mask (`check_assistant_masking`)."""
    import numpy as np
    from trl import SFTConfig, SFTTrainer

    import rlhf.models.settings as model_settings
    from rlhf.data.prepared import prepared_dataset, read_prepared
    from rlhf.models.folders import check_model_dir, resolve_model_dir
    from rlhf.models.loading import empty_causal_lm, load_tokenizer
    from rlhf.training.bucketed_sft import LengthBucketedSFTTrainer, tokenized_rows
    from rlhf.training.trainer_setup import (
        adapters_without_casts,
        checkpoint_dir,
        fingerprint,
        last_logged,
        length_report,
        log_history_rows,
        quantized_lora_problem,
        save_trained,
        tracking_callbacks,
        train_resumable,
        trainer_loading,
        training_resources,
        trl_config,
    )

    section = section or stage
    tokenizer = load_tokenizer(base_dir, config.trust_remote_code)
    dataset = prepared_dataset(data, "sft")  # memory-mapped: each map below is cached with it
    conversational = "messages" in dataset.column_names
    only_target = config.loss_on == "completion"
    if conversational and only_target:
        check_assistant_masking(tokenizer, section, base_dir)
    if conversational or not isinstance(dataset[0]["prompt"], str):
        measured = dataset.map(chat_lengths, batched=True, fn_kwargs={"tokenizer": tokenizer},
                               remove_columns=dataset.column_names, desc="Counting tokens")  # fmt: skip
    else:  # tokenised here in batched calls, to the ids TRL would make row by row
        dataset = measured = dataset.map(tokenized_rows, batched=True, fn_kwargs={"tokenizer": tokenizer},
                                         remove_columns=dataset.column_names, desc="Tokenizing")  # fmt: skip
    columns = measured.with_format("numpy", columns=["prompt_tokens", "full_tokens"])[:]  # arrays, not ints
    prompt_tokens, full_tokens = columns["prompt_tokens"], columns["full_tokens"]
    fits = prompt_tokens < config.max_length
    lost = length_report(prompt_tokens, full_tokens, fits, config.max_length, f"{section}.max_length", data)
    if not fits.all():
        dataset = dataset.select(np.flatnonzero(fits))
    dataset = dataset.remove_columns([c for c in ("prompt_tokens", "full_tokens") if c in dataset.column_names])
    consolidating = ewc is not None and ewc[0].strength > 0
    if consolidating:
        from rlhf.training.ewc import ewc_examples

        previous = read_prepared(ewc[1], "sft", sample=(ewc[0].samples, config.seed))  # EWC's rows only
        examples = ewc_examples(
            tokenizer, previous, ewc[0], config.max_length, config.seed, f"{section}.max_length", ewc[1]
        )
    model_dir = check_model_dir(resolve_model_dir(base_dir), str(base_dir))
    config.lora.check_targets(empty_causal_lm(model_dir, config.trust_remote_code), f"{section}.lora.target_modules")
    settings = model_settings.current().merged(config.model)
    quantized_lora_problem(settings, config, section)
    key = fingerprint(config, [base_dir, data, *([ewc[1]] if consolidating else [])])
    if consolidating:
        key += "-" + fingerprint(ewc[0], [])[:8]
    # Packing removes the padding that length-sorted sub-batches would save: TRL's own trainer.
    packed = packs(config)
    trainer_cls, extra = (SFTTrainer, {}) if packed else (LengthBucketedSFTTrainer, {"buckets": config.length_buckets})
    # The model loads inside the trainer, from its folder, after the arguments (ZeRO-3, FSDP).
    loading, loader_kwargs = trainer_loading(config, config.trust_remote_code, trainer_cls)
    args = trl_config(
        SFTConfig,
        config,
        checkpoint_dir(checkpoints, stage, key),
        key=section,
        model_init_kwargs=loading,
        completion_only_loss=only_target and not conversational,
        assistant_only_loss=only_target and conversational,
        **({"packing": True} if packed and "packing" not in config.trl and "padding_free" not in config.trl else {}),
    )
    trainer = trainer_cls(
        model=str(model_dir),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=config.lora.peft_config(),
        callbacks=tracking_callbacks(),
        **loader_kwargs,
        **extra,
    )
    adapters_without_casts(trainer)
    consolidation = None
    if consolidating:
        from rlhf.training.ewc import consolidate, trainer_loss_scale

        consolidation = consolidate(
            trainer.model,
            examples,
            ewc[0].strength,
            1.0 / config.gradient_accumulation_steps,
            trainer_loss_scale(trainer),
        )
    start = time.perf_counter()
    resumed = train_resumable(trainer, stage, key)
    history = trainer.state.log_history
    penalty = consolidation.penalty() if consolidation is not None else None  # before LoRA is merged away
    save_trained(trainer, tokenizer, out_dir, model_dir)  # its checkpoints stay until the caller publishes it
    metrics = {
        "train_loss": last_logged(history, "loss"),
        "mean_token_accuracy": last_logged(history, "mean_token_accuracy"),
        "steps": trainer.state.global_step,
        "processes": trainer.args.world_size,
        "train_seconds": time.perf_counter() - start,
        "resumed": bool(resumed),
        "packed": bool(packed),
        **lost,
        **training_resources(trainer),
    }
    if consolidation is not None:
        metrics["ewc_penalty"] = penalty
    return metrics, log_history_rows(history, CURVE_KEYS)


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
