"""The TRL training that stage `policy@<method>` and the self-improvement rounds share
(stages/policy.py, stages/improve.py): a model trained with one of TRL's trainers, resumable
from checkpoints, tracked in MLflow, saved merged; EWC towards its start; the content-keyed
cache of reference log-probs; DPO's TRL arguments. It reads no params: its callers pass
their own blocks (`policy.<method>`, `improve.*.rpo`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlhf.training.params import DPOParams, TrainingParams
from stages import CHECKPOINTS_DIR, DATA_DIR, REF_LOGPS_CACHE, SFT_DIR

SFT_DATA = DATA_DIR / "sft.parquet"  # EWC's previous data (params `ewc`), what SFT learned
OFFLINE_LOGGED = ("loss", "rewards/margins", "rewards/accuracies")


def train_trl(
    trust_remote_code: bool,
    params: TrainingParams,
    data: Path,
    trl_classes: tuple,
    trl_args: dict,
    out_dir: Path,
    stage: str,
    logged: tuple[str, ...] = OFFLINE_LOGGED,
    inputs: tuple[Path, ...] = (),
    on_trainer: Callable | None = None,
    start: Path = SFT_DIR,
    length_key: str | None = None,
    forced_bos: bool = False,
    context: dict | None = None,
    shuffle_rows: bool = False,
    **trainer_kwargs,
) -> tuple[dict, list[dict]]:
    """Train the model in `start` (the SFT model unless given; a method with a reference
    model takes a frozen copy of it) with one of TRL's trainers, `trl_classes` = (its config
    class, its trainer class), on `data`; save the (merged) result into `out_dir`. Returns
    metrics (the last logged value of each of `logged`) and the curve of those values.
    `inputs` are further files the result depends on (reward models), for the checkpoint
    fingerprint; `on_trainer(trainer)` runs once the trainer is built. `length_key` (the
    params key of `params.max_length`, for the offline methods) drops the rows whose prompt
    alone fills max_length (`fitting_rows`) and reports how many. `forced_bos`: the trainer
    puts a BOS before every prompt that lacks one (TRL's CPO and ORPO); it is kept to where
    the tokenizer puts one (`without_forced_bos`). `context`: what else the run's steps
    depend on (the task its rewards read answers with), for the fingerprint. `shuffle_rows`:
    the table in an order drawn from `params.seed`, for a trainer that reads it in file
    order (KTO: its KL term pairs each row with its neighbour in the batch, and a table
    derived from pairs holds each prompt's chosen and rejected side by side)."""
    from datasets import Dataset

    from rlhf.data.contracts import read_prepared
    from rlhf.models.compute import is_main
    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
    from rlhf.training.trainer_setup import (
        checkpoint_dir,
        final_weights,
        fingerprint,
        last_logged,
        log_history_rows,
        tracking_callbacks,
        train_resumable,
        trl_config,
    )

    tokenizer = load_tokenizer(start, trust_remote_code)
    table, counts = read_prepared(data, stage), {}
    if length_key is not None:
        table, counts = fitting_rows(table, tokenizer, params.max_length, length_key, data)
    if shuffle_rows:
        table = seeded_order(table, params.seed)
    max_length_key = length_key or f"policy.{stage.split('@')[-1]}.max_length"  # names the section in messages
    ewc_data = sft_ewc_examples(tokenizer, params, max_length_key)
    trainer_tokenizer = tokenizer
    if forced_bos:
        trainer_tokenizer, table = without_forced_bos(tokenizer, table)
    model = load_causal_lm(start, trust_remote_code, what=start.as_posix(), training=True)
    refuses_head = trl_classes[1].__name__ in ("DPOTrainer", "KTOTrainer")  # they raise on an adapted lm_head
    lora_key = max_length_key.rsplit(".", 1)[0] + ".lora.target_modules"
    params.lora.check_targets(model, lora_key, output_layer=not refuses_head)
    dataset = Dataset.from_pandas(table, preserve_index=False)
    key = fingerprint(
        params,
        [start, data, *inputs, *([SFT_DATA] if params.ewc.strength else [])],
        {**(context or {}), "trust": trust_remote_code},
    )
    config_cls, trainer_cls = trl_classes
    args = trl_config(config_cls, params, checkpoint_dir(CHECKPOINTS_DIR, stage, key), trust_remote_code, **trl_args)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=trainer_tokenizer,
        peft_config=params.lora.peft_config(),
        callbacks=tracking_callbacks(),
        **trainer_kwargs,
    )
    if on_trainer is not None:
        on_trainer(trainer)
    ewc = consolidate_on_sft(trainer.model, ewc_data, params, params.gradient_accumulation_steps, trainer)
    resumed = train_resumable(trainer, stage, key)
    history = trainer.state.log_history
    penalty = ewc.penalty() if ewc is not None else None  # before LoRA is merged away
    model, state_dict = final_weights(trainer)
    if is_main():  # the other processes of a multi-process launch trained the same weights
        save_model(model, tokenizer, out_dir, state_dict)
    metrics = {
        "train_loss": last_logged(history, "loss"),
        **{name.replace("/", "_"): last_logged(history, name) for name in logged if name != "loss"},
        "steps": trainer.state.global_step,
        "processes": trainer.args.world_size,
        "resumed": bool(resumed),
    }
    if ewc is not None:
        metrics["ewc_penalty"] = penalty
    metrics |= counts
    if hasattr(trainer, "ref_cache_hit"):
        metrics["ref_logps_cache_hit"] = trainer.ref_cache_hit
    return metrics, log_history_rows(history, logged)


def fitting_rows(table, tokenizer, max_length: int, key: str, path: Path, room: int = 1):
    """(`table` without the rows whose prompt, tokenized as it is trained and sampled, leaves
    fewer than `room` of `max_length` tokens for the completion, and the counts:
    `dropped_rows`, `truncated_rows` (kept rows whose longest response TRL cuts at
    max_length), and for pairs `indistinct_pairs`: those whose chosen and rejected are the
    same tokens once cut, so that they carry no preference). TRL's DPO and KTO drop rows
    whose prompt fills max_length without a count and cut the others silently, CPO (SimPO)
    and ORPO cut their completions to nothing, whose mean log-prob is then 0/0 and turns
    every weight into NaN, and PPO's rollouts (room: max_new_tokens) would cut the prompt's
    start. None fitting is an error naming `key` (`length_report`, as SFT's). A response
    given as messages is counted by its contents (its template's tokens left out)."""
    from rlhf.models.generation import format_prompt
    from rlhf.rewards.functions import completion_text
    from rlhf.training.trainer_setup import length_report

    def tokens(text) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    lengths = [len(tokens(format_prompt(tokenizer, p))) for p in table["prompt"]]
    responses = [c for c in ("chosen", "rejected", "completion") if c in table]
    answers = {c: [tokens(completion_text(r)) for r in table[c]] for c in responses}
    full = [n + max((len(answers[c][i]) + 1 for c in responses), default=0) for i, n in enumerate(lengths)]
    keep = [n + room <= max_length for n in lengths]
    counts = length_report(list(zip(lengths, full)), keep, max_length, key, path, room)
    if "chosen" in answers and "rejected" in answers:
        counts["indistinct_pairs"] = sum(
            kept and chosen[: max_length - n] == rejected[: max_length - n]
            for kept, n, chosen, rejected in zip(keep, lengths, answers["chosen"], answers["rejected"])
        )
        if counts["indistinct_pairs"]:
            print(
                f"{key} {max_length}: {counts['indistinct_pairs']} pairs of {path} have chosen and rejected alike up "
                f"to where max_length cuts them: they carry no preference; raise {key}"
            )
    return table[keep].reset_index(drop=True), counts


def seeded_order(table, seed: int):
    """`table`'s rows in an order drawn from `seed` (the same for the same seed)."""
    return table.sample(frac=1.0, random_state=seed).reset_index(drop=True)


def without_forced_bos(tokenizer, table):
    """(a tokenizer for TRL's CPO and ORPO trainers, `table` for them). Those trainers put a
    BOS before every prompt that does not start with one, whatever the tokenizer's default;
    the pipeline samples and scores a prompt as the tokenizer's default (and DPO, KTO and
    SFT) reads it (`format_prompt`). So they get a copy of the tokenizer without a BOS
    token, and plain-text prompts carry the BOS in their text when the tokenizer puts one
    before text (Llama-style). Conversations are rendered to text here, by the tokenizer's
    own template (TRL's `maybe_apply_chat_template`, as the trainers would): rendered by
    the copy, a template's `{{ bos_token }}` (Llama 3, Gemma, Mistral) would write nothing,
    and the trained prompt would lack the BOS that sampling puts there."""
    import copy

    import pandas as pd
    from trl.data_utils import maybe_apply_chat_template

    from rlhf.models.generation import text_start

    chat = len(table) and not isinstance(table["prompt"].iloc[0], str)
    if chat:  # the template writes whatever BOS it wants: nothing more is put before it
        table = pd.DataFrame([maybe_apply_chat_template(row, tokenizer) for row in table.to_dict("records")])
    start = "" if chat else text_start(tokenizer)
    trainer_tokenizer = copy.deepcopy(tokenizer)
    trainer_tokenizer.bos_token = None
    if start:
        table = table.assign(prompt=[start + p if isinstance(p, str) else p for p in table["prompt"]])
    return trainer_tokenizer, table


def sft_ewc_examples(tokenizer, params, key: str):
    """The SFT data's examples for EWC (`rlhf.training.ewc.ewc_examples`, at
    `params.max_length`, named `key` in its messages), or None when `ewc.strength` is 0.
    Before the model loads: a max_length no row fits fails here."""
    if not params.ewc.strength:
        return None
    from rlhf.data.contracts import read_prepared
    from rlhf.training.ewc import ewc_examples

    table = read_prepared(SFT_DATA, "sft")
    return ewc_examples(tokenizer, table, params.ewc, params.max_length, params.seed, key, SFT_DATA)


def consolidate_on_sft(model, examples, params, accumulation: int = 1, trainer=None):
    """EWC towards the weights `model` starts from (the SFT model's, unless a round trains
    on), with the Fisher information of the SFT data's `examples` (`sft_ewc_examples`);
    None when there are none (`ewc.strength` 0). `trainer`: the transformers Trainer that
    trains `model`, whose fp16 loss scale the pull is scaled by."""
    if examples is None:
        return None
    from rlhf.training.ewc import consolidate, trainer_loss_scale

    return consolidate(model, examples, params.ewc.strength, 1.0 / accumulation, trainer_loss_scale(trainer))


def reference_trainer(config_cls, trainer_cls, params, trl_args: dict) -> tuple:
    """(config class, trainer class) for a method with a reference model (DPO, KTO): with
    `precompute_ref_log_probs` the trainer keeps its reference log-probs in the
    content-keyed cache (rlhf.training.ref_logprobs). Sets the flag in `trl_args`."""
    from rlhf.training.ref_logprobs import with_reference_cache

    trl_args["precompute_ref_log_probs"] = params.precompute_ref_log_probs
    if params.precompute_ref_log_probs:
        return config_cls, with_reference_cache(trainer_cls, REF_LOGPS_CACHE)
    return config_cls, trainer_cls


def dpo_trainer(params: DPOParams) -> tuple[tuple, dict]:
    """((config class, trainer class), TRL arguments) of DPO with `params`: its loss types,
    and TRL's NLL loss on the chosen response weighted `sft_weight` (RPO) when that is > 0."""
    from trl import DPOConfig, DPOTrainer

    loss_types = [params.loss_type] if isinstance(params.loss_type, str) else list(params.loss_type)
    trl_args = {
        "loss_type": loss_types + (["sft"] if params.sft_weight else []),
        "loss_weights": [1.0] * len(loss_types) + ([params.sft_weight] if params.sft_weight else []),
        "beta": params.beta,
        "label_smoothing": params.label_smoothing,
        "max_length": params.max_length,
    }
    return reference_trainer(DPOConfig, DPOTrainer, params, trl_args), trl_args
