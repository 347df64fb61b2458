"""The TRL training every TRL-backed method shares (rlhf/training/methods/, SFT included): a
model trained with one of TRL's trainers, resumable from checkpoints, tracked in MLflow,
saved merged; EWC towards its start. A method adds its own trainer and hooks: its rows
(SFT's measurement), its rewards (rlhf.training.online), its reference log-probs' cache
(rlhf.training.ref_logprobs).

The model goes to the trainer as its folder's path with `model_init_kwargs` (params
`model`: dtype, attention, quantization), as TRL loads it: after the training arguments,
so that DeepSpeed ZeRO-3 partitions the weights as they load and FSDP receives them on the
CPU; a reference model is built the same way; a quantized base gets TRL's (peft's) k-bit
preparation. Nothing here loads the whole model before the trainer does: the LoRA target
check reads an empty (meta-device) model.

It reads no params file and knows no pipeline folder: its callers (stages policy@<method>,
rl@<method>, sft, verifier, improve@<name>) describe the job (`TrainingJob`) and pass their own blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.training.params import EwcParams, TrainingParams

OFFLINE_LOGGED = ("loss", "rewards/margins", "rewards/accuracies")


@dataclass(frozen=True)
class TrainingJob:
    """What a stage tells a method about one training run."""

    stage: str  # the DVC stage (policy@dpo, rl@grpo, round-r1): names the checkpoint folder
    key: str  # the params key of the method's block (policy.dpo, improve.rounds.r1.rpo): named in messages
    start: Path  # the model trained (and, for a method with one, the frozen reference)
    data: Path  # the prepared table the method reads (its data contract)
    checkpoints: Path  # checkpoints go under <checkpoints>/<stage>/<fingerprint>/
    trust_remote_code: bool = False
    sft_data: Path | None = None  # EWC's previous data: what SFT learned
    ref_cache: Path | None = None  # the content-keyed reference log-probs (DPO, KTO)
    reward_dirs: dict = field(default_factory=dict)  # folders of model-based rewards with no `path`
    task: object = None  # the task rewards read answers with (rlhf.tasks.Task)
    # EWC towards `start` with the Fisher information of `sft_data`, for a block that has no
    # `ewc` of its own (a round's SFT: its settings hold it); a block's own `ewc` otherwise.
    ewc: EwcParams | None = None
    # How the model loads (params `model` with the block's own `model:` keys), resolved once by
    # the stage; None: from this process's settings and the block (`loading_settings`).
    model: object = None


def train_trl(
    job: TrainingJob,
    params: TrainingParams,
    trl_classes: tuple,
    trl_args: dict | None = None,
    out_dir: Path | None = None,
    logged: tuple[str, ...] = OFFLINE_LOGGED,
    inputs: tuple[Path, ...] = (),
    on_trainer: Callable | None = None,
    fit_rows: bool = True,
    forced_bos: bool = False,
    context: dict | None = None,
    shuffle_rows: bool = False,
    rows: Callable | None = None,
    curve: tuple[str, ...] | None = None,
    **trainer_kwargs,
) -> tuple[dict, list[dict]]:
    """Train the model in `job.start` with one of TRL's trainers, `trl_classes` = (its config
    class, its trainer class), on `job.data`; save the (merged) result into `out_dir`.
    Returns metrics (the last logged value of each of `logged`) and the curve of those
    values. `trl_args`: the caller's further config arguments. `inputs` are further files the
    result depends on (reward models), for the checkpoint fingerprint; `on_trainer(trainer)`
    runs once the trainer is built. `fit_rows` (the offline methods) drops the rows whose
    prompt alone fills max_length (`fitting_rows`) and reports how many. `forced_bos`: the
    trainer puts a BOS before every prompt that lacks one (TRL's CPO and ORPO); it is kept
    to where the tokenizer puts one (`without_forced_bos`). `context`: what else the run's
    steps depend on (the task its rewards read answers with), for the fingerprint.
    `shuffle_rows`: the table in an order drawn from `params.seed`, for a trainer that
    reads it in file order (KTO: its KL term pairs each row with its neighbour in the batch,
    and a table derived from pairs holds each prompt's chosen and rejected side by side).
    `rows(dataset, tokenizer)`: the method's own (rows kept, their counts), in place of
    `fit_rows` (SFT's, which measures conversations by their template). `curve`: the logged
    values the curve holds (default: `logged`)."""
    from rlhf.data.prepared import prepared_dataset
    from rlhf.models.compute import world_size
    from rlhf.models.folders import check_model_dir, resolve_model_dir
    from rlhf.models.loading import empty_causal_lm, load_tokenizer
    from rlhf.training.params import precompute_reference
    from rlhf.training.trainer_setup import (
        adapters_without_casts,
        checkpoint_dir,
        fingerprint,
        last_logged,
        loading_settings,
        log_history_rows,
        quantized_lora_problem,
        save_trained,
        tracking_callbacks,
        train_resumable,
        trainer_loading,
        training_resources,
        trl_config,
    )

    start = job.start
    model_dir = check_model_dir(resolve_model_dir(start), start.as_posix())
    tokenizer = load_tokenizer(start, job.trust_remote_code)
    dataset, counts = prepared_dataset(job.data, job.stage), {}
    if rows is not None:
        dataset, counts = rows(dataset, tokenizer)
    elif fit_rows:
        dataset, counts = fitting_rows(dataset, tokenizer, params.max_length, f"{job.key}.max_length", job.data)
    if shuffle_rows:
        dataset = seeded_order(dataset, params.seed)
    ewc_params = job.ewc if job.ewc is not None else getattr(params, "ewc", None)
    consolidating = ewc_params is not None and ewc_params.strength > 0
    ewc_data = (
        sft_ewc_examples(tokenizer, params, f"{job.key}.max_length", job.sft_data, ewc_params)
        if consolidating
        else None
    )
    trainer_tokenizer = tokenizer
    if forced_bos:
        trainer_tokenizer, dataset = without_forced_bos(tokenizer, dataset)
    config_cls, trainer_cls = trl_classes
    refuses_head = trainer_cls.__name__ in ("DPOTrainer", "KTOTrainer")  # they raise on an adapted lm_head
    params.lora.check_targets(empty_causal_lm(model_dir, job.trust_remote_code), f"{job.key}.lora.target_modules",
                              output_layer=not refuses_head)  # fmt: skip
    settings = job.model or loading_settings(params)  # how the model loads: once for the run
    quantized_lora_problem(settings, params, job.key)
    key = fingerprint(
        params,
        [start, job.data, *inputs, *([job.sft_data] if consolidating else [])],
        {**(context or {}), "trust": job.trust_remote_code, **({"ewc": job.ewc.model_dump()} if job.ewc else {})},
        settings,
    )
    loading, loader_kwargs = trainer_loading(params, job.trust_remote_code, trainer_cls, settings)
    trainer_kwargs |= loader_kwargs
    if getattr(params, "precompute_ref_log_probs", None) == "auto":
        precompute = precompute_reference(params, len(dataset), world_size())
        trl_args = {**(trl_args or {}), "precompute_ref_log_probs": precompute}
        counts["reference_precomputed"] = precompute
        if not precompute:
            print(f"{job.stage}: reference log-probs per batch: the run draws under half of the {len(dataset)} rows")
    args = trl_config(
        config_cls, params, checkpoint_dir(job.checkpoints, job.stage, key), job.trust_remote_code, job.key,
        model_init_kwargs=loading, settings=settings, **(trl_args or {}),
    )  # fmt: skip
    trainer = trainer_cls(
        model=str(model_dir),
        args=args,
        train_dataset=dataset,
        processing_class=trainer_tokenizer,
        peft_config=params.lora.peft_config(),
        callbacks=tracking_callbacks(),
        **trainer_kwargs,
    )
    adapters_without_casts(trainer)
    if on_trainer is not None:
        on_trainer(trainer)
    ewc = consolidate_on_sft(trainer.model, ewc_data, params, params.gradient_accumulation_steps, trainer, ewc_params)
    started = time.perf_counter()
    resumed = train_resumable(trainer, job.stage, key)
    history = trainer.state.log_history
    penalty = ewc.penalty() if ewc is not None else None  # before LoRA is merged away
    save_trained(trainer, tokenizer, out_dir, model_dir)
    metrics = {
        "train_loss": last_logged(history, "loss"),
        **{name.replace("/", "_"): last_logged(history, name) for name in logged if name != "loss"},
        "steps": trainer.state.global_step,
        "processes": trainer.args.world_size,
        "train_seconds": time.perf_counter() - started,
        "resumed": bool(resumed),
        **training_resources(trainer),
    }
    if ewc is not None:
        metrics["ewc_penalty"] = penalty
    metrics |= counts
    if hasattr(trainer, "ref_cache_hit"):
        metrics["ref_logps_cache_hit"] = trainer.ref_cache_hit
    return metrics, log_history_rows(history, curve or logged)


def fitting_rows(dataset, tokenizer, max_length: int, key: str, path: Path, room: int = 1):
    """(`dataset` without the rows whose prompt, tokenized as it is trained and sampled, leaves
    fewer than `room` of `max_length` tokens for the completion, and the counts:
    `dropped_rows`, `truncated_rows` (kept rows whose longest response TRL cuts at
    max_length), and for pairs `indistinct_pairs`: those whose chosen and rejected are the
    same tokens once cut, so that they carry no preference). TRL's DPO and KTO drop rows
    whose prompt fills max_length without a count and cut the others silently, CPO (SimPO)
    and ORPO cut their completions to nothing, whose mean log-prob is then 0/0 and turns
    every weight into NaN, and PPO's rollouts (room: max_new_tokens) would cut the prompt's
    start. None fitting is an error naming `key` (`length_report`, as SFT's). A response
    given as messages is counted by its contents (its template's tokens left out).

    The lengths are a batched `map` over the (memory-mapped) dataset: cached with it, so a
    rerun on the same table and tokenizer reads them back; only they are held."""
    import numpy as np

    from rlhf.training.trainer_setup import length_report

    pairs = {"chosen", "rejected"} <= set(dataset.column_names)
    measured = dataset.map(
        row_lengths,
        batched=True,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
        remove_columns=dataset.column_names,
        desc="Counting tokens",
    )
    counted = ["prompt_tokens", "full_tokens", *(["indistinct"] if pairs else [])]
    columns = measured.with_format("numpy", columns=counted)[:]  # arrays, not a Python int a row
    prompt_tokens, full_tokens = columns["prompt_tokens"], columns["full_tokens"]
    keep = prompt_tokens + room <= max_length
    counts = length_report(prompt_tokens, full_tokens, keep, max_length, key, path, room)
    if pairs:
        counts["indistinct_pairs"] = int(np.sum(keep & columns["indistinct"].astype(bool)))
        if counts["indistinct_pairs"]:
            print(
                f"{key} {max_length}: {counts['indistinct_pairs']} pairs of {path} have chosen and rejected alike up "
                f"to where max_length cuts them: they carry no preference; raise {key}"
            )
    if keep.all():
        return dataset, counts
    return dataset.select(np.flatnonzero(keep)), counts


def row_lengths(batch: dict, tokenizer, max_length: int) -> dict:
    """`fitting_rows`' counts of a batch of rows: prompt tokens (as sampled: `format_prompt`),
    prompt + longest response (+1 for EOS), and whether chosen and rejected are the same
    tokens where max_length cuts them."""
    from rlhf.data.contracts import completion_text
    from rlhf.models.generation import format_prompt

    def tokens(texts: list) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    prompts = tokens([format_prompt(tokenizer, p) for p in batch["prompt"]])
    lengths = [len(p) for p in prompts]
    responses = [c for c in ("chosen", "rejected", "completion") if c in batch]
    answers = {c: tokens([completion_text(r) for r in batch[c]]) for c in responses}
    full = [n + max((len(answers[c][i]) + 1 for c in responses), default=0) for i, n in enumerate(lengths)]
    out = {"prompt_tokens": lengths, "full_tokens": full}
    if "chosen" in answers and "rejected" in answers:
        out["indistinct"] = [
            chosen[: max_length - n] == rejected[: max_length - n]
            for n, chosen, rejected in zip(lengths, answers["chosen"], answers["rejected"])
        ]
    return out


def seeded_order(dataset, seed: int):
    """`dataset`'s rows in an order drawn from `seed` (the same for the same seed)."""
    return dataset.shuffle(seed=seed)


def without_forced_bos(tokenizer, dataset):
    """(a tokenizer for TRL's CPO and ORPO trainers, `dataset` for them). Those trainers put a
    BOS before every prompt that does not start with one, whatever the tokenizer's default;
    the pipeline samples and scores a prompt as the tokenizer's default (and DPO, KTO and
    SFT) reads it (`format_prompt`). So they get a copy of the tokenizer without a BOS
    token, and plain-text prompts carry the BOS in their text when the tokenizer puts one
    before text (Llama-style). Conversations are rendered to text here, by the tokenizer's
    own template (TRL's `maybe_apply_chat_template`, as the trainers would): rendered by
    the copy, a template's `{{ bos_token }}` (Llama 3, Gemma, Mistral) would write nothing,
    and the trained prompt would lack the BOS that sampling puts there."""
    import copy

    from trl.data_utils import maybe_apply_chat_template

    from rlhf.models.generation import text_start

    chat = len(dataset) and not isinstance(dataset[0]["prompt"], str)
    if chat:  # the template writes whatever BOS it wants: nothing more is put before it
        dataset = dataset.map(
            maybe_apply_chat_template, fn_kwargs={"processing_class": tokenizer}, desc="Chat template"
        )
    start = "" if chat else text_start(tokenizer)
    trainer_tokenizer = copy.deepcopy(tokenizer)
    trainer_tokenizer.bos_token = None
    if start:
        dataset = dataset.map(prefixed_prompt, fn_kwargs={"start": start}, desc="BOS in the prompt text")
    return trainer_tokenizer, dataset


def prefixed_prompt(row: dict, start: str) -> dict:
    return {"prompt": start + row["prompt"] if isinstance(row["prompt"], str) else row["prompt"]}


def sft_ewc_examples(tokenizer, params, key: str, sft_data: Path | None, ewc: EwcParams | None = None):
    """The SFT data's examples for EWC (`rlhf.training.ewc.ewc_examples`, at
    `params.max_length`, named `key` in its messages), or None when `ewc.strength` is 0
    (`ewc`: the block's own `params.ewc` unless given). Before the model loads: a max_length
    no row fits fails here."""
    ewc = ewc or params.ewc
    if not ewc.strength:
        return None
    from rlhf.data.prepared import read_prepared
    from rlhf.training.ewc import ewc_examples

    table = read_prepared(sft_data, "sft", sample=(ewc.samples, params.seed))  # EWC's rows only
    return ewc_examples(tokenizer, table, ewc, params.max_length, params.seed, key, sft_data)


def consolidate_on_sft(model, examples, params, accumulation: int = 1, trainer=None, ewc: EwcParams | None = None):
    """EWC towards the weights `model` starts from (the SFT model's, unless a round trains
    on), with the Fisher information of the SFT data's `examples` (`sft_ewc_examples`);
    None when there are none (`ewc.strength` 0). `trainer`: the transformers Trainer that
    trains `model`, whose fp16 loss scale the pull is scaled by."""
    if examples is None:
        return None
    from rlhf.training.ewc import consolidate, trainer_loss_scale

    return consolidate(model, examples, (ewc or params.ewc).strength, 1.0 / accumulation, trainer_loss_scale(trainer))
