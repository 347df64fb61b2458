"""Data contracts, loaders for user files, and validation before any compute.

The contracts follow TRL's dataset conventions, standard (text) or conversational (lists
of ``{"role", "content"}`` messages):

=========== ==========================================================
kind        columns
=========== ==========================================================
sft         prompt, completion — or messages (a whole conversation)
preference  prompt, chosen, rejected
unpaired    prompt, completion, label (bool: desirable)
prm         prompt, completions (list of steps), labels (list of bool)
prompts     prompt, answer (optional, for verifiable rewards)
=========== ==========================================================

User files may be JSONL, JSON, Parquet, CSV or a ``datasets.save_to_disk`` folder; their
column names are mapped onto the contract's in params. Validation reads every row and
raises one `DataValidationError` naming the file, the row (1-based record number) and the
field of every problem found, not only the first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

CONTRACTS: dict[str, dict[str, tuple[str, ...]]] = {
    # kind: {"required": ..., "optional": ...}
    "sft": {"required": ("prompt", "completion"), "optional": ()},
    "preference": {"required": ("prompt", "chosen", "rejected"), "optional": ()},
    "unpaired": {"required": ("prompt", "completion", "label"), "optional": ()},
    "prm": {"required": ("prompt", "completions", "labels"), "optional": ()},
    # difficulty: any label (e.g. the number of operands, a level); evaluate reports per value.
    "prompts": {"required": ("prompt",), "optional": ("answer", "difficulty")},
}
FORMATS = (".jsonl", ".json", ".parquet", ".csv")
MAX_LISTED_PROBLEMS = 25


class DataValidationError(ValueError):
    """A data file does not meet its contract. The message lists every problem found."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.path = str(path)
        self.problems = problems
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown)
        lines = [f"{path}: {len(problems)} problem(s) found:"] + [f"  {p}" for p in shown]
        if more:
            lines.append(f"  ... and {more} more")
        super().__init__("\n".join(lines))


def read_table(path: str | Path) -> pd.DataFrame:
    """Rows of a JSONL, JSON, Parquet or CSV file, or of a `datasets.save_to_disk` folder."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist; check the path in params.yaml (prepare.files)")
    if path.is_dir():
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise DataValidationError(
                path, ["a folder must be a `datasets.Dataset.save_to_disk` folder (no dataset_info.json found)"]
            )
        from datasets import DatasetDict, load_from_disk

        dataset = load_from_disk(str(path))
        if isinstance(dataset, DatasetDict):
            if "train" not in dataset:
                raise DataValidationError(path, [f"a DatasetDict needs a 'train' split; found {sorted(dataset)}"])
            dataset = dataset["train"]
        return dataset.to_pandas()
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            return pd.read_json(path, lines=True, dtype=False)
        if suffix == ".json":
            records = json.loads(path.read_text())
            if isinstance(records, dict):
                records = records.get("data", records)
            if not isinstance(records, list):
                raise DataValidationError(path, ["a .json file must hold a list of records (or {'data': [...]})"])
            return pd.DataFrame.from_records(records)
        if suffix == ".parquet":
            return pd.read_parquet(path)
        if suffix == ".csv":
            return pd.read_csv(path, dtype=str, keep_default_na=False)
    except DataValidationError:
        raise
    except ValueError as error:
        raise DataValidationError(path, [f"cannot be parsed as {suffix}: {error}"]) from error
    raise DataValidationError(
        path, [f"unsupported file type {suffix!r}; use one of {', '.join(FORMATS)} or a save_to_disk folder"]
    )


def load_contract(path: str | Path, kind: str, columns: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Read `path`, rename its columns onto the `kind` contract, validate every row.

    `columns` maps contract names to the file's names, e.g. ``{"prompt": "question"}``.
    Returns only the contract's columns, with list and bool fields normalised."""
    frame = read_table(path)
    return validate_contract(frame, kind, path, columns)


def validate_contract(
    frame: pd.DataFrame, kind: str, path: str | Path, columns: Mapping[str, str] | None = None
) -> pd.DataFrame:
    if kind not in CONTRACTS:
        raise ValueError(f"unknown data contract {kind!r}; expected one of {sorted(CONTRACTS)}")
    columns = dict(columns or {})
    contract = CONTRACTS[kind]
    if kind == "sft" and "messages" in frame.columns and "messages" not in columns.values():
        columns.setdefault("messages", "messages")
    problems: list[str] = []
    for target, source in columns.items():
        if source not in frame.columns:
            problems.append(
                f"column mapping {target!r} -> {source!r}: no column {source!r} (columns: {list(frame.columns)})"
            )
    frame = frame.rename(columns={source: target for target, source in columns.items() if source != target})
    if kind == "sft" and "messages" in frame.columns and "prompt" not in frame.columns:
        wanted: tuple[str, ...] = ("messages",)
    else:
        wanted = contract["required"]
    missing = [c for c in wanted if c not in frame.columns]
    if missing:
        problems.append(
            f"missing column(s) {missing} for a {kind} file (columns: {list(frame.columns)}); "
            "rename them or map them in params.yaml (prepare.files.<name>.columns)"
        )
    if problems:
        raise DataValidationError(path, problems)
    if len(frame) == 0:
        raise DataValidationError(path, ["the file has no rows"])

    keep = list(wanted) + [c for c in contract["optional"] if c in frame.columns]
    frame = frame[keep].reset_index(drop=True)
    checkers = {
        "prompt": _check_text_or_messages,
        "completion": _check_text_or_messages,
        "chosen": _check_text_or_messages,
        "rejected": _check_text_or_messages,
        "messages": _check_messages,
        "label": _check_bool,
        "completions": _check_str_list,
        "labels": _check_bool_list,
        "answer": _check_answer,
        "difficulty": _check_answer,
    }
    normalised: dict[str, list] = {c: [] for c in keep}
    for index, row in enumerate(frame.itertuples(index=False)):
        record = dict(zip(keep, row))
        row_ok = True
        for field in keep:
            value, problem = checkers[field](record[field])
            if problem:
                problems.append(f"row {index + 1}: {field!r} {problem}")
                row_ok = False
            normalised[field].append(value)
        if kind == "prm" and row_ok and len(normalised["completions"][-1]) != len(normalised["labels"][-1]):
            problems.append(
                f"row {index + 1}: 'completions' has {len(normalised['completions'][-1])} steps but "
                f"'labels' has {len(normalised['labels'][-1])}; give one label per step"
            )
    if problems:
        raise DataValidationError(path, problems)
    # object columns keep the normalised Python values: pandas >= 3 would otherwise infer a
    # string dtype and turn a missing answer (None) into NaN.
    return pd.DataFrame({c: pd.Series(values, dtype=object) for c, values in normalised.items()})


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


def _check_text_or_messages(value):
    if _is_missing(value):
        return value, "is missing"
    if isinstance(value, str):
        return value, "is empty" if not value.strip() else None
    return _check_messages(value)


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
        normalised.append({"role": str(message["role"]), "content": message["content"]})
    return normalised, None


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


def _check_answer(value):
    if _is_missing(value):
        return None, None
    text = str(value).strip()
    return text, "is empty" if not text else None


def read_prepared(path: str | Path, stage: str) -> pd.DataFrame:
    """A table written by `prepare`, or an error that says how to provide it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{stage} needs {path}, which prepare did not write: with prepare.source=files, add "
            f"prepare.files.{path.stem}: {{path: ...}} to params.yaml (or use prepare.source: builtin)"
        )
    # Opened here, not by pyarrow, so that Python's audit hooks see the read (the
    # end-to-end test checks every file a stage reads against its DVC deps).
    with open(path, "rb") as file:
        return pd.read_parquet(file)
