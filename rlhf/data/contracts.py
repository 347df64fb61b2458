"""Data contracts, loaders for user files, and validation before any compute.

The contracts follow TRL's dataset conventions, standard (text) or conversational (lists
of ``{"role", "content"}`` messages):

=========== ==========================================================
kind        columns
=========== ==========================================================
sft         prompt, completion — or messages (a whole conversation)
preference  prompt, chosen, rejected — or chosen, rejected (implicit prompt)
unpaired    prompt, completion, label (bool: desirable)
prm         prompt, completions (list of steps), labels (list of bool)
prompts     prompt, answer (optional, for verifiable rewards)
=========== ==========================================================

A preference file without a prompt column (the HH-RLHF layout) holds the prompt as the
shared prefix of chosen and rejected; it is split off with TRL's `extract_prompt` (see
`split_implicit_prompt` for how text is cut). A pair whose chosen and rejected are
identical is a problem.

Data may be a JSONL, JSON, Parquet or CSV file, a ``datasets.save_to_disk`` folder, or a
Hugging Face Hub dataset named ``owner/name`` (``split`` and ``config`` pick which part);
column names are mapped onto the contract's in params. Validation reads every row and
raises one `DataValidationError` naming the file, the row (1-based record number; JSON
syntax errors name the line) and the field of every problem found, not only the first.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pandas as pd

from rlhf.data.readers import MAX_KEPT_PROBLEMS, DataValidationError, read_batches

CONTRACTS: dict[str, dict[str, tuple[str, ...]]] = {
    # kind: {"required": ..., "optional": ...}
    "sft": {"required": ("prompt", "completion"), "optional": ()},
    "preference": {"required": ("prompt", "chosen", "rejected"), "optional": ()},
    "unpaired": {"required": ("prompt", "completion", "label"), "optional": ()},
    "prm": {"required": ("prompt", "completions", "labels"), "optional": ()},
    # difficulty: any label (e.g. the number of operands, a level); evaluate reports per value.
    # context, relevant: a long-context suite (the context read before the prompt; the
    # sentences of it the prompt needs), what stage compress's compressor is scored on.
    "prompts": {"required": ("prompt",), "optional": ("answer", "difficulty", "context", "relevant")},
    # A long context, the prompt read after it, and the answer: stage compress's training rows.
    "context": {"required": ("context", "prompt", "completion"), "optional": ("relevant",)},
}
HH_ASSISTANT_TURN = "\n\nAssistant:"  # where an HH-RLHF prompt ends


def load_contract(
    path: str | Path,
    kind: str,
    columns: Mapping[str, str] | None = None,
    *,
    split: str | None = None,
    config: str | None = None,
) -> pd.DataFrame:
    """Read `path` (see `read_batches`), rename its columns onto the `kind` contract, validate
    every row, and return all of them in one frame (`contract_batches` holds one batch at a
    time: for files of any size).

    `columns` maps contract names to the file's names, e.g. ``{"prompt": "question"}``.
    Returns only the contract's columns, with list and bool fields normalised (and, for a
    preference file without a prompt, the prompt split off chosen and rejected)."""
    frames = list(contract_batches(path, kind, columns, split=split, config=config))
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def contract_batches(
    path: str | Path,
    kind: str,
    columns: Mapping[str, str] | None = None,
    *,
    split: str | None = None,
    config: str | None = None,
    batch_rows: int | None = None,
    checks: Callable[[pd.DataFrame, int], list[str]] | None = None,
) -> Iterator[pd.DataFrame]:
    """The rows of `path` mapped onto the `kind` contract and validated, one batch at a time
    (`read_batches`). A batch with a problem is not yielded; reading goes on to the end, and
    then one `DataValidationError` names every problem of the file (row numbers count from
    the file's first row). `checks(batch, first_row)`: further problems of a valid batch
    (the caller's, e.g. answers its task cannot read), each starting ``row N:``."""
    reader = ContractReader(kind, path, columns)
    try:
        for frame in read_batches(path, split=split, config=config, batch_rows=batch_rows):
            first_row = reader.rows
            batch = reader.batch(frame)
            if batch is not None and checks is not None:
                found = checks(batch, first_row)
                reader.add_problems(found)
                if found:
                    batch = None
            if batch is not None and not reader.problems:
                yield batch
    except DataValidationError as error:  # the file's own problems (bad JSON lines) after those of its rows
        reader.add_problems(error.problems)
    reader.finish()


# ----------------------------------------------------------------------------- validation


def mapped_columns(frame: pd.DataFrame, columns: Mapping[str, str]) -> pd.DataFrame:
    """`frame` with each mapped field (`columns`: field -> the file's column) read from its
    column. A column of the file named like a field mapped from another column gives way to
    it (renaming beside it made two columns of one name, whose values then shifted into the
    wrong fields); the file's other columns stay."""
    mapped = {target: frame[source] for target, source in columns.items() if source in frame.columns}
    sources = set(columns.values())
    rest = {c: frame[c] for c in frame.columns if c not in sources and c not in mapped}
    return pd.DataFrame({**mapped, **rest}, index=frame.index)


def validate_contract(
    frame: pd.DataFrame, kind: str, path: str | Path, columns: Mapping[str, str] | None = None
) -> pd.DataFrame:
    """`frame` (a whole file's rows) mapped onto the `kind` contract and validated: the
    normalised rows, or one `DataValidationError` naming every problem."""
    reader = ContractReader(kind, path, columns)
    batch = reader.batch(frame)
    reader.finish()
    return batch


CHECKERS = {  # field -> its check (defined below, under "field checks")
    "prompt": lambda v: _check_text_or_messages(v),
    "completion": lambda v: _check_text_or_messages(v),
    "chosen": lambda v: _check_text_or_messages(v),
    "rejected": lambda v: _check_text_or_messages(v),
    "messages": lambda v: _check_conversation(v),
    "label": lambda v: _check_bool(v),
    "completions": lambda v: _check_str_list(v),
    "labels": lambda v: _check_bool_list(v),
    "answer": lambda v: _check_answer(v),
    "difficulty": lambda v: _check_answer(v),
    "context": lambda v: _check_plain_text(v),
    "relevant": lambda v: _check_plain_text(v),
}


class ContractReader:
    """Validates one file's rows against the `kind` contract, batch after batch: the column
    mapping and layout are read off the first batch (every later batch is read the same
    way), a row's number counts from the file's first row, and the file holds one format
    (text or messages) across batches. Problems accumulate (`MAX_KEPT_PROBLEMS` kept, the
    rest counted); `finish` raises them all."""

    def __init__(self, kind: str, path: str | Path, columns: Mapping[str, str] | None = None):
        if kind not in CONTRACTS:
            raise ValueError(f"unknown data contract {kind!r}; expected one of {sorted(CONTRACTS)}")
        self.kind, self.path, self.columns = kind, path, dict(columns or {})
        self.rows = 0  # read so far
        self.problems: list[str] = []
        self.unlisted = 0
        self.layout: tuple | None = None  # (columns mapped, drop the repeated prompt, implicit prompt, keep)
        self.file_format: tuple[str, int] | None = None  # (format of the first good row, its number)
        self.broken = False  # the file's columns do not fit: no row can be read

    def add_problems(self, problems: list[str]) -> None:
        room = MAX_KEPT_PROBLEMS - len(self.problems)
        self.problems += problems[: max(room, 0)]
        self.unlisted += max(len(problems) - max(room, 0), 0)

    def finish(self) -> None:
        if not self.problems and not self.unlisted and not self.rows:
            self.problems.append("the file has no rows")
        if self.problems or self.unlisted:
            raise DataValidationError(self.path, self.problems, self.unlisted)

    def _layout(self, frame: pd.DataFrame) -> tuple | None:
        kind, contract, columns = self.kind, CONTRACTS[self.kind], self.columns
        if kind == "sft" and "messages" in frame.columns and "messages" not in columns.values():
            columns.setdefault("messages", "messages")
        problems: list[str] = []
        fields = [*contract["required"], *contract["optional"], *(["messages"] if kind == "sft" else [])]
        for target, source in columns.items():
            if target not in fields:
                problems.append(
                    f"column mapping {target!r} -> {source!r}: {target!r} is not a field of a {kind} file "
                    f"(fields: {list(dict.fromkeys(fields))})"
                )
            if source not in frame.columns:
                problems.append(
                    f"column mapping {target!r} -> {source!r}: no column {source!r} (columns: {list(frame.columns)})"
                )
        mapped = mapped_columns(frame, columns)
        drop_prompt = kind == "preference" and repeated_prompt(mapped)
        if drop_prompt:  # the conversations hold it: split off below, as TRL does
            mapped = mapped.drop(columns=["prompt"])
        implicit = kind == "preference" and "prompt" not in mapped.columns and {"chosen", "rejected"} <= set(mapped)
        # Conversations: a `messages` column, and no prompt/completion pair beside it (UltraChat
        # keeps its first user turn as `prompt` too: the conversation holds it).
        if kind == "sft" and "messages" in mapped.columns and not {"prompt", "completion"} <= set(mapped.columns):
            wanted: tuple[str, ...] = ("messages",)
        elif implicit:
            wanted = ("chosen", "rejected")
        else:
            wanted = contract["required"]
        missing = [c for c in wanted if c not in mapped.columns]
        if missing:
            problems.append(
                f"missing column(s) {missing} for a {kind} file (columns: {list(mapped.columns)}); "
                "rename them or map them in params.yaml (prepare.files.<name>.columns)"
            )
        if problems:
            self.add_problems(problems)
            return None
        keep = list(wanted) + [c for c in contract["optional"] if c in mapped.columns]
        return drop_prompt, implicit, keep

    def batch(self, frame: pd.DataFrame) -> pd.DataFrame | None:
        """The batch's rows normalised, or None when it (or the file) has a problem."""
        if self.broken or not len(frame):
            return None
        first_row = self.rows
        self.rows += len(frame)
        if self.layout is None:
            self.layout = self._layout(frame)
            if self.layout is None:
                self.broken = True
                return None
        drop_prompt, implicit_prompt, keep = self.layout
        frame = mapped_columns(frame, self.columns)
        if drop_prompt and "prompt" in frame.columns:
            frame = frame.drop(columns=["prompt"])
        for column in keep:  # a field no row of this batch has (JSON Lines): missing in each row
            if column not in frame.columns:
                frame[column] = pd.Series([None] * len(frame), dtype=object, index=frame.index)
        frame = frame[keep].reset_index(drop=True)
        for column in ("answer", "difficulty"):
            if column in frame and str(frame[column].dtype) in ("float16", "float32"):
                frame[column] = short_floats(frame[column])
        kind = self.kind
        problems: list[str] = []
        normalised: dict[str, list] = {c: [] for c in keep}
        prompts: list = []  # split off chosen and rejected, when the prompt is implicit
        checkers = [CHECKERS[field] for field in keep]
        for index, row in enumerate(frame.itertuples(index=False), start=first_row + 1):
            row_ok = True
            for field, checker, raw in zip(keep, checkers, row):
                value, problem = checker(raw)
                if problem:
                    problems.append(f"row {index}: {field!r} {problem}")
                    row_ok = False
                normalised[field].append(value)
            if row_ok:
                formats = _row_format(normalised, keep)
                problem = _format_problem(formats, self.file_format)
                if problem:
                    problems.append(f"row {index}: {problem}")
                    row_ok = False
                elif self.file_format is None and formats:
                    self.file_format = (next(iter(formats.values())), index)
            if kind == "prm" and row_ok and len(normalised["completions"][-1]) != len(normalised["labels"][-1]):
                problems.append(
                    f"row {index}: 'completions' has {len(normalised['completions'][-1])} steps but "
                    f"'labels' has {len(normalised['labels'][-1])}; give one label per step"
                )
            if kind == "preference" and row_ok:
                chosen, rejected = normalised["chosen"][-1], normalised["rejected"][-1]
                problem = _pair_problem(chosen, rejected)
                if not problem and implicit_prompt:
                    split, problem = split_implicit_prompt(chosen, rejected)
                    if split:
                        prompts.append(split["prompt"])
                        normalised["chosen"][-1], normalised["rejected"][-1] = split["chosen"], split["rejected"]
                if problem:
                    problems.append(f"row {index}: {problem}")
        if problems:
            self.add_problems(problems)
            return None
        if implicit_prompt:
            normalised = {"prompt": prompts, **normalised}
        # object columns keep the normalised Python values: pandas >= 3 would otherwise infer a
        # string dtype and turn a missing answer (None) into NaN.
        return pd.DataFrame({c: pd.Series(values, dtype=object) for c, values in normalised.items()})


TEXT_FIELDS = ("prompt", "completion", "chosen", "rejected", "messages")


def completion_text(completion) -> str:
    """The text of a completion: a string, or the text content of conversational messages
    (a message without text, such as a tool call, adds none)."""
    if isinstance(completion, str):
        return completion
    return "".join(_message_text(message.get("content")) for message in completion)


def _message_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: their text ones
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return ""


def value_format(value) -> str:
    """ "text" for a string, "messages" for a conversation (TRL's standard and
    conversational formats)."""
    return "text" if isinstance(value, str) else "messages"


def _row_format(normalised: dict, fields) -> dict[str, str]:
    """The format of each text field of the row just checked (its last values)."""
    return {f: value_format(normalised[f][-1]) for f in fields if f in TEXT_FIELDS}


def _format_problem(row: dict[str, str], first: tuple[str, int] | None) -> str | None:
    """Why a row's text fields do not share one format, or differ from the file's first
    row: TRL reads a dataset's format from its first row and applies the chat template to
    all fields or none, so a mixed file would fail (or train wrongly) mid-stage."""
    formats = set(row.values())
    if len(formats) > 1:
        shown = ", ".join(f"{field!r} is {fmt}" for field, fmt in row.items())
        return f"{shown}; a row's fields must all be text or all be messages"
    if first is not None and formats and formats != {first[0]}:
        return (
            f"its fields are {formats.pop()} but row {first[1]}'s are {first[0]}; a file holds one format "
            "(all text or all messages): convert the rows, or split them into two files"
        )
    return None


def _pair_problem(chosen, rejected) -> str | None:
    if chosen == rejected:
        return "chosen and rejected are identical"
    return None


def repeated_prompt(frame: pd.DataFrame) -> bool:
    """Whether a preference table's text `prompt` sits beside chosen and rejected
    conversations that begin with the user's turn (HuggingFaceH4/ultrafeedback_binarized's
    layout): the conversations then hold the prompt, which TRL's `maybe_extract_prompt`
    splits off them; the text beside them is a copy."""
    if not {"prompt", "chosen", "rejected"} <= set(frame.columns) or not len(frame):
        return False
    first = frame.iloc[0]
    chosen = _as_list(first["chosen"])  # None for text; JSON text (a CSV cell) as its list
    return (
        isinstance(first["prompt"], str)
        and bool(chosen)
        and isinstance(chosen[0], Mapping)
        and chosen[0].get("role") != "assistant"
    )


def split_implicit_prompt(chosen, rejected) -> tuple[dict | None, str | None]:
    """({"prompt", "chosen", "rejected"}, None), or (None, problem): the prompt that an
    implicit-prompt pair shares, split off both by TRL's `extract_prompt`.

    Messages are split by whole message, as TRL does; both replies must then start with an
    assistant turn. For text, TRL takes the common prefix character by character, which
    cuts inside a word ("...Assistant: It is bl" + "ue." / "and.") and, when one reply
    begins with the other, drops its last shared character. So the text prompt is cut back
    to the end of the last HH-RLHF turn marker ``"\\n\\nAssistant:"`` if the prefix holds one,
    otherwise to a word boundary (trailing spaces go to the replies, as in TRL). Without a
    marker, words both replies open with stay in the prompt: give a prompt column then."""
    from trl.data_utils import extract_prompt  # imports torch: only for implicit-prompt files

    prompt = extract_prompt({"chosen": chosen, "rejected": rejected})["prompt"]
    if isinstance(prompt, str):
        end = len(prompt)
        turn = prompt.rfind(HH_ASSISTANT_TURN)
        if turn >= 0:
            prompt = prompt[: turn + len(HH_ASSISTANT_TURN)]
        elif re.search(r"\w$", prompt) and (re.match(r"\w", chosen[end:]) or re.match(r"\w", rejected[end:])):
            prompt = re.sub(r"\w+$", "", prompt).rstrip(" ")
        if not prompt.strip():
            return None, "chosen and rejected share no prompt (no common prefix); add a prompt column"
    elif not prompt:
        return None, "chosen and rejected share no prompt (no common first message); add a prompt column"
    chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]
    if not isinstance(prompt, str):
        roles = [reply[0]["role"] for reply in (chosen, rejected) if reply[0]["role"] != "assistant"]
        if roles:
            return None, f"chosen and rejected differ before the reply (at a {roles[0]!r} message); add a prompt column"
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}, None


# ----------------------------------------------------------------------------- field checks
# Each returns (normalised value, problem or None).


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _as_list(value):
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    if hasattr(value, "tolist"):
        return value.tolist()
    return value if isinstance(value, list) else None


def _text_problem(text: str) -> str | None:
    """Why a string cannot be written as UTF-8 (a lone surrogate: JSON's "\\ud800" escape
    reads as one, and Parquet then fails on it), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"is not valid Unicode text (a lone surrogate {text[error.start]!r} at character {error.start + 1}, "
            "e.g. a JSON \\ud800 escape without its pair); fix or drop the character"
        )
    return None


def _check_plain_text(value):
    """A long context (or its relevant part): text, read as text whatever the prompt's format."""
    if _is_missing(value):
        return value, "is missing"
    if not isinstance(value, str):
        return value, f"should be text, got {type(value).__name__}"
    return value, "is empty" if not value.strip() else None


def _check_text_or_messages(value):
    if _is_missing(value):
        return value, "is missing"
    if isinstance(value, str) and not _written_messages(value):
        return value, "is empty" if not value.strip() else _text_problem(value)
    return _check_messages(value)


def _written_messages(text: str) -> bool:
    """Whether `text` is a conversation written as JSON (a CSV cell can hold nothing else):
    a list of {'role', 'content'} objects."""
    if not text.lstrip().startswith("[{"):
        return False
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


# The roles chat templates know (OpenAI's, and the function-calling ones some templates add).
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def _check_messages(value):
    messages = _as_list(value)
    if messages is None:
        return value, "must be a string or a list of {'role', 'content'} messages"
    if not messages:
        return messages, "is an empty list of messages"
    normalised = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            return messages, f"message {i} must be a {{'role', 'content'}} mapping, got {message!r:.60}"
        if not isinstance(message["content"], str):
            return messages, f"message {i} content must be a string"
        if problem := _text_problem(message["content"]):
            return messages, f"message {i} content {problem}"
        role = str(message["role"])
        if role not in ROLES:  # a chat template renders none of it, or fails on it
            hint = f" (ShareGPT's {role!r} is {SHAREGPT_ROLES[role]!r}: rename it)" if role in SHAREGPT_ROLES else ""
            return messages, f"message {i} role {role!r} is not one of {', '.join(ROLES)}{hint}"
        normalised.append({"role": role, "content": message["content"]})
    return normalised, None


def _check_conversation(value):
    """An SFT conversation: messages with an assistant turn (the turns SFT trains on)."""
    messages, problem = _check_messages(value)
    if problem is None and not any(m["role"] == "assistant" for m in messages):
        problem = "has no assistant turn: SFT trains on the assistant's turns"
    return messages, problem


_TRUE = {"true", "1", "yes", "desirable"}
_FALSE = {"false", "0", "no", "undesirable"}


def _check_bool(value):
    if isinstance(value, bool):
        return value, None
    if isinstance(value, int | float) and not _is_missing(value) and value in (0, 1):
        return bool(value), None
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE, None
    return value, f"must be a boolean (true/false), got {value!r:.40}"


def _check_str_list(value):
    items = _as_list(value)
    if items is None:
        return value, "must be a list of step strings"
    if not items:
        return items, "is an empty list; give at least one step"
    bad = [i for i, item in enumerate(items) if not isinstance(item, str) or not item.strip()]
    if bad:
        return items, f"has empty or non-string step(s) at {bad}"
    for i, item in enumerate(items):
        if problem := _text_problem(item):
            return items, f"step {i} {problem}"
    return list(items), None


def _check_bool_list(value):
    items = _as_list(value)
    if items is None:
        return value, "must be a list of booleans, one per step"
    out = []
    for i, item in enumerate(items):
        normalised, problem = _check_bool(item)
        if problem:
            return items, f"item {i} {problem}"
        out.append(normalised)
    return out, None


def short_floats(column: pd.Series) -> pd.Series:
    """A float32 (float16) column as the shortest text that reads back as each value: read
    as Python floats they became 0.10000000149011612 for 0.1, an answer nothing matches."""
    import numpy as np

    return pd.Series(
        [None if v != v else np.format_float_positional(v, unique=True, trim="-") for v in column.to_numpy()],
        index=column.index,
        dtype=object,
    )


def _check_answer(value):
    """An answer (or difficulty label) as text. A whole number read as a float is written as
    the integer: Parquet, `datasets` and the Hub give an integer column with an empty cell
    as floats, and `3.0` would not match an answer `3` (nor difficulty `8` a test's 8)."""
    if _is_missing(value):
        return None, None
    if isinstance(value, bool) or not isinstance(value, str | numbers.Real):  # str() would write "['a', 'b']"
        kind = "a list" if _as_list(value) is not None else type(value).__name__
        return value, f"must be a string or a number, got {kind}; give one answer per row"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    return text, "is empty" if not text else _text_problem(text)


MESSAGE_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages")


def prompt_key(prompt) -> str:
    """One string per prompt, the same for a text and for a conversation however it was read
    (Parquet's arrays of message dicts or Python lists): what tells two prompts apart."""
    if isinstance(prompt, str):
        return prompt
    items = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    return json.dumps([{k: m[k] for k in sorted(m)} for m in items], default=str, ensure_ascii=False)


def plain_messages(table: pd.DataFrame) -> pd.DataFrame:
    """Conversational columns as Python lists of message dicts: Parquet gives numpy arrays,
    which neither JSON reports nor `list + list` code take."""
    for column in MESSAGE_COLUMNS:
        if column in table and len(table) and not isinstance(table[column].iloc[0], str):
            table[column] = pd.Series(
                [
                    [dict(m) for m in v] if hasattr(v, "__len__") and not isinstance(v, str) else v
                    for v in table[column]
                ],
                index=table.index,
                dtype=object,
            )
    return table


def as_conversation(frame: pd.DataFrame) -> pd.DataFrame:
    """Text rows as conversations (prepare.files.<name>.chat): a text prompt becomes one user
    turn, a text response (completion, chosen, rejected) one assistant turn, in TRL's
    conversational format; rows that are conversations already are left as they are."""

    def turn(role: str):
        return lambda value: [{"role": role, "content": value}] if isinstance(value, str) else value

    roles = {"prompt": "user", "completion": "assistant", "chosen": "assistant", "rejected": "assistant"}
    return frame.assign(**{c: frame[c].map(turn(role)) for c, role in roles.items() if c in frame.columns})
