"""Long-context suites: what a model reads of a context, with and without a compressor.

A suite with a `context` column (rlhf.data.contracts: the context is read before the
`prompt`; `relevant`, when given, is the part of it the prompt needs) is scored in up to
three readings, each a suite of its own in the eval report:

* `<suite>`: the context and the prompt as one text (rlhf.tasks.long_context.joined), the
  context cut from its start so that the prompt and the generation budget fit the model's
  `window` (what a model without a compressor can do with a context longer than its
  window: read its end);
* `<suite>/relevant`: the relevant sentences and the prompt (the oracle: what the model
  scores when nothing it needs is lost and nothing else is there);
* `<suite>/compressed-<ratio>x`: the whole context through a context compressor
  (rlhf.models.compressor), read by the model it serves as slots before the prompt.
"""

from __future__ import annotations

import pandas as pd
from pydantic import Field

from rlhf.params import StageConfig

RELEVANT = "/relevant"


class Compress(StageConfig):
    """Long-context suites (a `context` column) read through stage compress's compressors
    too (evaluate, infer)."""

    enabled: bool = Field(False, description="score long-context suites with compressed contexts too")
    tokens: list[int] | None = Field(
        None, description="the compressors (slots per chunk) to read with; null: every one"
    )


def compress_problems(reading: Compress, section: str, run, candidate: str | None = None) -> list[str]:
    """Why `section`.compress cannot read with stage compress's compressors, from params
    alone (before any stage runs): none trained, other slot counts, another model served."""
    if not reading.enabled:
        return []
    trained = run.params["compress"]
    if not trained.enabled:
        return [f"{section}.compress.enabled: stage compress trains no compressor (compress.enabled is false)"]
    problems = []
    missing = sorted(set(reading.tokens or []) - set(trained.tokens))
    if missing:
        problems.append(f"{section}.compress.tokens: {missing} not among compress.tokens {trained.tokens}")
    if candidate is not None and candidate != trained.serve:
        problems.append(
            f"{section}.compress.enabled: the compressors serve models/{trained.serve} (compress.serve), not "
            f"{section}.candidate {candidate}: slots made for one model mean nothing to another"
        )
    return problems


def window_budget(model, window: int | None, max_new_tokens: int) -> int:
    """The prompt tokens a model reads when it must leave room for `max_new_tokens`:
    `window` (null: the model's max_position_embeddings) less the generation budget."""
    window = window or getattr(model.config, "max_position_embeddings", None)
    if window is None:
        raise ValueError("the model's config names no max_position_embeddings: set the stage's window")
    return window - max_new_tokens


def is_long_context(suite: pd.DataFrame) -> bool:
    return "context" in suite.columns


def compressed_name(suite: str, ratio: float) -> str:
    return f"{suite}/compressed-{ratio:g}x"


def with_text(prompt, text: str):
    """`prompt` (text, or a conversation whose last user turn is the question) with its
    question replaced by `text`."""
    if isinstance(prompt, str):
        return text
    turns = [dict(turn) for turn in prompt]
    last = max(i for i, turn in enumerate(turns) if turn.get("role") == "user")
    turns[last]["content"] = text
    return turns


def cut_to_window(tokenizer, context: str, prompt, budget: int):
    """The prompt with as much of the end of `context` before it as fits in `budget` tokens
    (as formatted for the model: rlhf.models.generation.format_prompt)."""
    from rlhf.models.compressor import question_text
    from rlhf.models.generation import format_prompt
    from rlhf.tasks.long_context import joined

    question = question_text(prompt)

    def length(text: str) -> int:
        return len(tokenizer(format_prompt(tokenizer, with_text(prompt, text)), add_special_tokens=False)["input_ids"])

    room = budget - length(joined("", question))
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    keep = max(0, min(len(ids), room))
    while True:
        text = joined(tokenizer.decode(ids[len(ids) - keep :]) if keep else "", question)
        if keep == 0 or length(text) <= budget:  # a word's tokens may merge anew: trim until it fits
            return with_text(prompt, text)
        keep -= 1


def readings(suite: pd.DataFrame, tokenizer, budget: int) -> dict[str, pd.DataFrame]:
    """The suite as the model reads it (the context cut to `budget` tokens), and the
    relevant-only reading when the suite has `relevant`: {name suffix: frame}."""
    from rlhf.models.compressor import question_text
    from rlhf.tasks.long_context import joined

    cut = [cut_to_window(tokenizer, c, p, budget) for c, p in zip(suite["context"], suite["prompt"])]
    out = {"": suite.assign(prompt=pd.Series(cut, dtype=object, index=suite.index))}
    if "relevant" in suite.columns:
        relevant = [with_text(p, joined(r, question_text(p))) for r, p in zip(suite["relevant"], suite["prompt"])]
        out[RELEVANT] = suite.assign(prompt=pd.Series(relevant, dtype=object, index=suite.index))
    return out


def evaluate_compressed(config, task, compressor, tokenizer, suite: pd.DataFrame) -> tuple[dict, dict, list[str]]:
    """(metrics, per-problem outcomes, completions) of the model a compressor serves,
    reading each context as slots: accuracy and format with intervals, length, and the
    compression reached (context tokens per slot)."""
    from rlhf.evaluation.metrics import distinct_n
    from rlhf.evaluation.suites import answer_difficulty, summarise

    contexts, prompts = suite["context"].tolist(), suite["prompt"].tolist()
    texts = compressor.generate(tokenizer, contexts, prompts, config.max_new_tokens, config.batch_size)
    answers = [a if pd.notna(a) else None for a in suite["answer"]] if "answer" in suite else [None] * len(prompts)
    outcomes = {
        "accuracy": [float(task.is_correct(t, a)) for t, a in zip(texts, answers) if a is not None]
        if task.checks_answers
        else [],
        "format_rate": [float(task.is_well_formatted(t)) for t in texts] if task.has_format else [],
    }
    tokens = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in contexts]
    slots = compressor.context_slots(tokenizer, contexts)
    metrics = {
        **summarise(config, outcomes, answer_difficulty(suite)),
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
        "mean_length": sum(len(t) for t in texts) / len(texts),
        "context_tokens": sum(tokens) / len(tokens),
        "slots": sum(slots) / len(slots),
    }
    return metrics, outcomes, texts
