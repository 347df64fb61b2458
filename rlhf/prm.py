"""The process reward model (PRM): a verifier that scores every step of a solution.

A token-classification model with two labels, 0 = bad step and 1 = good step, started from
a causal LM (for Llama the new head is `score`). Labels follow Math-Shepherd (Wang et al.,
2024): a step is good while the solution is still on the way to the right answer; the first
wrong step and every step after it are bad.

Inputs are laid out as TRL's former `PRMTrainer` laid them out, each part tokenized on its
own (no special tokens) and the ids concatenated::

    [BOS] prompt | step_1 sep | step_2 sep | ... | step_k sep
                           ^             ^                 ^   label of step i on the LAST
                                                               token of its separator

Every other position is -100 (ignored by the loss). Because the model is causal, the score
of step i depends only on the prompt and steps 1..i, so the same layout scores a prefix of
k steps as k scores: what Best-of-N, MCTS and a step-level policy reward need.

Training wraps transformers' `Trainer` (TRL 1.x has no PRM trainer); the loss is
cross-entropy over the labelled positions. Rows longer than `max_length` are cut after the
last whole step that fits (their labels stay valid: a step's label depends only on the
steps before it); a row whose first step does not fit is dropped. Both are counted.

`ProcessRewardModel` loads a trained PRM and scores steps (P(good) per step) or whole
completions (steps aggregated by min, product or last).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification, Trainer, TrainingArguments

from rlhf.generation import format_prompt
from rlhf.modeling import check_model_dir, load_tokenizer, resolve_model_dir, save_model
from rlhf.task import STEP_SEPARATOR, split_steps
from rlhf.training import LoraParams, TrainingParams, trl_config

BAD, GOOD = 0, 1
IGNORE = -100
PRM_FILE = "prm.json"
AGGREGATIONS = ("min", "prod", "last")


# ----------------------------------------------------------------------------- inputs


def special_prefix(tokenizer) -> list[int]:
    """[BOS] when the tokenizer puts one before plain text by default (as the causal LM saw
    text in training), else nothing. Conversational prompts get theirs from the chat template."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("x")["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    return [bos] if bos is not None and len(ids) > len(plain) and ids[0] == bos else []


def encode_steps(
    tokenizer,
    prompt,
    steps: Sequence[str],
    labels: Sequence[bool] | None = None,
    separator: str = STEP_SEPARATOR,
    prefix: list[int] | None = None,
) -> dict[str, list[int]]:
    """input_ids and token labels of one row. Without `labels` (scoring), each step's
    position carries GOOD as a placeholder: what matters is where the labels are."""
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(labels)} labels; give one label per step")
    if prefix is None:
        prefix = special_prefix(tokenizer) if isinstance(prompt, str) else []
    input_ids = prefix + tokenizer(format_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    token_labels = [IGNORE] * len(input_ids)
    separator_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if not separator_ids:
        raise ValueError(f"the step separator {separator!r} tokenizes to nothing; choose a visible separator")
    for index, step in enumerate(steps):
        step_ids = tokenizer(step, add_special_tokens=False)["input_ids"] + separator_ids
        label = GOOD if labels is None else (GOOD if labels[index] else BAD)
        input_ids += step_ids
        token_labels += [IGNORE] * (len(step_ids) - 1) + [label]
    return {"input_ids": input_ids, "labels": token_labels}


def step_positions(token_labels: Sequence[int]) -> list[int]:
    return [i for i, label in enumerate(token_labels) if label != IGNORE]


def truncate_to_steps(row: dict[str, list[int]], max_length: int) -> dict[str, list[int]] | None:
    """The row cut after its last whole step within `max_length` tokens; None if not even
    the first step fits."""
    if len(row["input_ids"]) <= max_length:
        return row
    fitting = [i for i in step_positions(row["labels"]) if i < max_length]
    if not fitting:
        return None
    end = fitting[-1] + 1
    return {"input_ids": row["input_ids"][:end], "labels": row["labels"][:end]}


def build_dataset(tokenizer, rows, separator: str = STEP_SEPARATOR, max_length: int | None = None) -> Dataset:
    """Tokenized training rows from a validated prm table (prompt, completions, labels).
    Prints how many rows were cut to fit and how many were dropped."""
    prefix = special_prefix(tokenizer)
    encoded, cut, dropped = [], 0, 0
    for prompt, steps, labels in zip(rows["prompt"], rows["completions"], rows["labels"]):
        row = encode_steps(tokenizer, prompt, steps, labels, separator, prefix if isinstance(prompt, str) else [])
        if max_length is not None:
            fitted = truncate_to_steps(row, max_length)
            if fitted is None:
                dropped += 1
                continue
            cut += fitted is not row
            row = fitted
        encoded.append(row)
    if cut or dropped:
        print(f"prm: {cut} row(s) cut to the whole steps within max_length={max_length}, {dropped} dropped")
    if not encoded:
        raise ValueError(f"every prm row is longer than max_length={max_length} before its first step ends; raise it")
    return Dataset.from_dict({key: [row[key] for row in encoded] for key in ("input_ids", "labels")})


# ----------------------------------------------------------------------------- model and training


def load_prm_model(path: str | Path, trust_remote_code: bool = False, what: str = "process reward model"):
    """A two-label token classifier from a model directory (a causal LM gets a new head)."""
    path = check_model_dir(resolve_model_dir(path), what)
    return AutoModelForTokenClassification.from_pretrained(
        str(path),
        trust_remote_code=trust_remote_code,
        dtype=torch.float32,
        use_safetensors=True,
        num_labels=2,
        id2label={BAD: "bad", GOOD: "good"},
        label2id={"bad": BAD, "good": GOOD},
    )


def prm_trainer(
    params: TrainingParams,
    model,
    tokenizer,
    train: Dataset,
    output_dir: str | Path,
    lora: LoraParams | None = None,
    run_name: str = "prm",
) -> Trainer:
    """transformers' Trainer over tokenized PRM rows: token-level cross-entropy on the
    labelled positions (the model's own loss), checkpoints in `output_dir`."""
    args = trl_config(TrainingArguments, params, Path(output_dir), run_name=run_name)
    peft_config = lora.peft_config("TOKEN_CLS") if lora is not None else None
    if peft_config is not None:
        from peft import get_peft_model

        # The new head is trained whole (peft's modules_to_save for TOKEN_CLS); "all-linear"
        # would also put an adapter on it, which peft refuses.
        peft_config.exclude_modules = ["score", "classifier"]
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
    )


def save_prm(model, tokenizer, path: str | Path, separator: str = STEP_SEPARATOR) -> None:
    """The model, its tokenizer and the step separator it was trained with."""
    save_model(model, tokenizer, path)
    (Path(path) / PRM_FILE).write_text(json.dumps({"kind": "classifier", "step_separator": separator}) + "\n")


# ----------------------------------------------------------------------------- scoring


def aggregate(step_scores: Sequence[float], how: str = "min") -> float:
    """One score for a solution from its step scores: the weakest step (`min`), the chance
    that every step is good if steps were independent (`prod`), or the last step's (`last`,
    which under Math-Shepherd labels already says whether the whole chain is good)."""
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {how!r}; expected one of {AGGREGATIONS}")
    if not step_scores:
        raise ValueError("no step scores to aggregate")
    if how == "min":
        return float(min(step_scores))
    if how == "prod":
        return float(math.prod(step_scores))
    return float(step_scores[-1])


def split_completion(completion: str, separator: str = STEP_SEPARATOR) -> list[str]:
    """Steps of a completion: the built-in task's own splitter, or a split on `separator`."""
    if separator == STEP_SEPARATOR:
        return split_steps(completion)
    return [step for step in completion.strip().split(separator) if step.strip()]


class ProcessRewardModel:
    """A trained PRM: P(good) for every step of a solution."""

    def __init__(self, model, tokenizer, separator: str = STEP_SEPARATOR):
        self.model = model
        self.tokenizer = tokenizer
        self.separator = separator

    @classmethod
    def load(cls, path: str | Path, trust_remote_code: bool = False):
        """The PRM saved in `path`: this class for a classifier PRM, a
        `rlhf.likelihood_prm.LikelihoodPRM` for a likelihood one (same scoring interface)."""
        path = resolve_model_dir(path)
        settings = Path(path) / PRM_FILE
        if not settings.is_file():
            raise FileNotFoundError(f"{path} has no {PRM_FILE}: it is not a process reward model written by stage prm")
        settings = json.loads(settings.read_text())
        if settings.get("kind") == "likelihood":
            from rlhf.likelihood_prm import LikelihoodPRM

            return LikelihoodPRM.load(path, settings, trust_remote_code)
        separator = settings["step_separator"]
        model = load_prm_model(path, trust_remote_code)
        return cls(model, load_tokenizer(path, trust_remote_code), separator)

    @torch.inference_mode()
    def score_steps(self, prompts: Sequence, steps: Sequence[Sequence[str]], batch_size: int = 64) -> list[list[float]]:
        """P(good) of every step, for each (prompt, steps) row; a row of k steps gets k scores."""
        if len(prompts) != len(steps):
            raise ValueError(f"{len(prompts)} prompts but {len(steps)} step lists")
        self.model.eval()
        prefix = special_prefix(self.tokenizer)
        rows = [
            encode_steps(self.tokenizer, p, s, None, self.separator, prefix if isinstance(p, str) else [])
            for p, s in zip(prompts, steps)
        ]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        scores: list[list[float]] = [[] for _ in rows]
        # Longest first, in batches of similar length: less padding.
        order = sorted((i for i in range(len(rows)) if steps[i]), key=lambda i: -len(rows[i]["input_ids"]))
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            width = len(rows[batch[0]]["input_ids"])
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, i in enumerate(batch):
                ids = rows[i]["input_ids"]
                input_ids[j, : len(ids)] = torch.tensor(ids)
                attention_mask[j, : len(ids)] = 1
            logits = self.model(
                input_ids=input_ids.to(self.model.device), attention_mask=attention_mask.to(self.model.device)
            ).logits
            good = logits.float().softmax(-1)[..., GOOD].cpu()
            for j, i in enumerate(batch):
                scores[i] = good[j, step_positions(rows[i]["labels"])].tolist()
        return scores

    def score_completions(
        self, prompts: Sequence, completions: Sequence[str], how: str = "min", batch_size: int = 64
    ) -> list[float]:
        """One score per completion: its steps' P(good) aggregated by `how`. A completion
        with no steps scores 0.0 (there is nothing to verify as good)."""
        steps = [split_completion(c, self.separator) for c in completions]
        step_scores = self.score_steps(prompts, steps, batch_size)
        return [aggregate(s, how) if s else 0.0 for s in step_scores]


# ----------------------------------------------------------------------------- metrics


def f1(predicted: Sequence[bool], actual: Sequence[bool]) -> float:
    """F1 of the positive (True) class; 0.0 when it is neither predicted nor present."""
    tp = sum(p and a for p, a in zip(predicted, actual))
    fp = sum(p and not a for p, a in zip(predicted, actual))
    fn = sum(a and not p for p, a in zip(predicted, actual))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def prm_metrics(
    step_scores: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], threshold: float = 0.5
) -> dict:
    """Held-out quality of a PRM. A step is predicted good when P(good) > threshold.

    * step_accuracy: predicted == label over every step;
    * f1_bad (the headline F1: finding wrong steps is what a verifier is for, and bad steps
      are the minority) and f1_good;
    * first_error_accuracy: over flawed solutions, the first step predicted bad is exactly
      the first bad step;
    * outcome_accuracy_<how>: aggregated score > threshold agrees with "every step good".
    """
    predicted = [[s > threshold for s in row] for row in step_scores]
    flat_predicted = [p for row in predicted for p in row]
    flat_actual = [bool(a) for row in labels for a in row]
    flawed = [(p, a) for p, a in zip(predicted, labels) if not all(a)]
    first_bad = [p.index(False) if False in p else -1 for p, _ in flawed]
    metrics = {
        "step_accuracy": sum(p == a for p, a in zip(flat_predicted, flat_actual)) / len(flat_actual),
        "f1_bad": f1([not p for p in flat_predicted], [not a for a in flat_actual]),
        "f1_good": f1(flat_predicted, flat_actual),
        "first_error_accuracy": (
            sum(f == list(a).index(False) for f, (_, a) in zip(first_bad, flawed)) / len(flawed) if flawed else None
        ),
        "bad_step_fraction": flat_actual.count(False) / len(flat_actual),
        "eval_solutions": len(labels),
        "eval_steps": len(flat_actual),
    }
    for how in AGGREGATIONS:
        outcome = [(aggregate(s, how) > threshold) == all(a) for s, a in zip(step_scores, labels)]
        metrics[f"outcome_accuracy_{how}"] = sum(outcome) / len(outcome)
    return metrics
