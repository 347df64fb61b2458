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

Training (rlhf.training.prm_trainer) wraps transformers' `Trainer` (TRL 1.x has no PRM
trainer); the loss is cross-entropy over the labelled positions. Rows longer than `max_length` are cut after the
last whole step that fits (their labels stay valid: a step's label depends only on the
steps before it); a row whose first step does not fit is dropped. Both are counted.

`ClassifierPRM` loads a trained PRM and scores steps (P(good) per step) or whole
completions (steps aggregated by min, product or last).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from datasets import Dataset, Features, List, Value
from transformers import AutoModelForTokenClassification

from rlhf.models.folders import PRM_FILE, UnusableModelError, check_model_dir, resolve_model_dir
from rlhf.models.generation import format_prompt
from rlhf.models.loading import init_kwargs, load_tokenizer, missing_classifier_type, save_model
from rlhf.rewards.steps import DEFAULT_SEPARATOR, StepScorer, locate_steps

BAD, GOOD = 0, 1
IGNORE = -100
HEAD_NAMES = ("score", "classifier")  # the token-classification head, by architecture
KEPT, CUT, DROPPED = 0, 1, 2  # what max_length did to a training row


# ----------------------------------------------------------------------------- inputs


def encode_steps(
    tokenizer,
    prompt,
    steps: Sequence[str],
    labels: Sequence[bool] | None = None,
    separator: str = DEFAULT_SEPARATOR,
) -> dict[str, list[int]]:
    """input_ids and token labels of one row (the prompt as the LM saw it in training:
    `format_prompt`). Without `labels` (scoring), each step's position carries GOOD as a
    placeholder: what matters is where the labels are."""
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(labels)} labels; give one label per step")
    prompt_text = format_prompt(tokenizer, prompt)
    separator_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if not separator_ids:
        raise ValueError(f"the step separator {separator!r} tokenizes to nothing; choose a visible separator")
    step_labels = [GOOD if labels is None or labels[i] else BAD for i in range(len(steps))]
    located = locate_steps(tokenizer, prompt_text, steps, separator, closed=True) if steps else None
    if located is not None:  # the completion as one text; each label on its separator's last token
        input_ids, spans = located
        token_labels = [IGNORE] * len(input_ids)
        for (_, _, closing), label in zip(spans, step_labels):
            token_labels[closing] = label
        if len({closing for _, _, closing in spans}) == len(spans):
            return {"input_ids": input_ids, "labels": token_labels}
    input_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    token_labels = [IGNORE] * len(input_ids)
    for index, step in enumerate(steps):
        step_ids = tokenizer(step, add_special_tokens=False)["input_ids"] + separator_ids
        input_ids += step_ids
        token_labels += [IGNORE] * (len(step_ids) - 1) + [step_labels[index]]
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


def build_dataset(tokenizer, rows, separator: str = DEFAULT_SEPARATOR, max_length: int | None = None) -> Dataset:
    """Tokenized training rows from a validated prm table (prompt, completions, labels): a
    `datasets.Dataset` (a prepared table, memory-mapped: the tokens are cached with it and
    found there on the next run) or columns (a frame or a mapping). Prints how many rows
    were cut to fit and how many were dropped."""
    if not isinstance(rows, Dataset):
        rows = Dataset.from_pandas(pd.DataFrame(dict(rows)), preserve_index=False)

    def encode(batch: dict) -> dict:
        out: dict[str, list] = {"input_ids": [], "labels": [], "fit": []}
        for prompt, steps, labels in zip(batch["prompt"], batch["completions"], batch["labels"]):
            row, fit = encode_steps(tokenizer, prompt, steps, labels, separator), KEPT
            if max_length is not None:
                fitted = truncate_to_steps(row, max_length)
                fit = DROPPED if fitted is None else KEPT if fitted is row else CUT
                row = fitted or {"input_ids": [], "labels": []}
            for key, value in (*row.items(), ("fit", fit)):
                out[key].append(value)
        return out

    ids = List(Value("int64"))  # declared: a batch of dropped rows alone has no type to infer
    encoded = rows.map(
        encode, batched=True, remove_columns=rows.column_names, desc="prm: tokenising the steps",
        features=Features({"input_ids": ids, "labels": ids, "fit": Value("int8")}),
    )  # fmt: skip
    fits = encoded.data.column("fit").to_numpy()
    cut, dropped = int((fits == CUT).sum()), int((fits == DROPPED).sum())
    if cut or dropped:
        print(f"prm: {cut} row(s) cut to the whole steps within max_length={max_length}, {dropped} dropped")
    if dropped == len(encoded):
        raise ValueError(f"every prm row is longer than max_length={max_length} before its first step ends; raise it")
    if dropped:
        encoded = encoded.filter(lambda fit: fit != DROPPED, input_columns="fit", batched=False)
    return encoded.remove_columns("fit")


# ----------------------------------------------------------------------------- model and training


def load_prm_model(
    path: str | Path,
    trust_remote_code: bool = False,
    what: str = "process reward model",
    training: bool = False,
    adapters: bool = False,
):
    """A two-label token classifier from a model directory (a causal LM gets a new head):
    to score steps, in the compute dtype (params `model`, as a reward model is served); to
    train (`training`), as a model trained in full (float32 master weights unless params
    `model` asks for half precision), or with LoRA `adapters` as their frozen base in the
    compute dtype, the new head float32 (it trains whole)."""
    from rlhf.models.compute import current, sharded_launch

    path = check_model_dir(resolve_model_dir(path), what)
    unsupported = missing_classifier_type(path, trust_remote_code)
    if unsupported:
        raise UnusableModelError(
            f"{what} {path}: prm.kind classifier puts a token-classification head on the model, and transformers "
            f"has none for model type {unsupported!r}; set prm.kind: likelihood (it scores steps with the LM itself)"
        )
    # Never quantized: its new head trains in full (the params check says so), and scoring
    # reads the model it trained.
    kwargs = init_kwargs(training=training, adapters=adapters, trust_remote_code=trust_remote_code)
    kwargs.pop("quantization_config", None)
    kwargs.pop("device_map", None)
    model = AutoModelForTokenClassification.from_pretrained(
        str(path), num_labels=2, id2label={BAD: "bad", GOOD: "good"}, label2id={"bad": BAD, "good": GOOD}, **kwargs
    )
    # Under LoRA with mixed precision (the compute dtype half, autocast on), the new head
    # trains in float32: a half-precision step would round away on it. Without autocast
    # (pure half precision, `model.dtype`) it stays in the base's dtype, which it must meet.
    if training and adapters and current().dtype in ("bfloat16", "float16"):
        for name in HEAD_NAMES:
            if isinstance(getattr(model, name, None), torch.nn.Module):
                getattr(model, name).float()
    if training and sharded_launch():  # FSDP / ZeRO-3: accelerate shards it
        return model
    return model.to(current().device)


def save_prm(
    model, tokenizer, path: str | Path, separator: str = DEFAULT_SEPARATOR, state_dict: dict | None = None
) -> None:
    """The model (or `state_dict`: `save_model`), its tokenizer and the step separator it was trained with."""
    save_model(model, tokenizer, path, state_dict)
    (Path(path) / PRM_FILE).write_text(json.dumps({"kind": "classifier", "step_separator": separator}) + "\n")


# ----------------------------------------------------------------------------- scoring


class ClassifierPRM(StepScorer):
    """A trained classifier PRM: P(good) for every step of a solution."""

    def __init__(self, model, tokenizer, separator: str = DEFAULT_SEPARATOR):
        self.model = model
        self.tokenizer = tokenizer
        self.separator = separator

    @classmethod
    def load(cls, path: str | Path, settings: dict, trust_remote_code: bool = False) -> ClassifierPRM:
        model = load_prm_model(path, trust_remote_code).eval()
        return cls(model, load_tokenizer(path, trust_remote_code), settings["step_separator"])

    @torch.inference_mode()
    def score_steps(
        self, prompts: Sequence, steps: Sequence[Sequence[str]], batch_size: int = 64, finished=None
    ) -> list[list[float]]:
        """P(good) of every step, for each (prompt, steps) row; a row of k steps gets k scores.
        A label sits on a step's own last token, so a partial path scores as a whole one
        (`finished` is taken for the interface's sake)."""
        if len(prompts) != len(steps):
            raise ValueError(f"{len(prompts)} prompts but {len(steps)} step lists")
        self.model.eval()
        rows = [encode_steps(self.tokenizer, p, s, None, self.separator) for p, s in zip(prompts, steps)]
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
