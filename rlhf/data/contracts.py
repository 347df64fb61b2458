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

from rlhf.params import InputError

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
# Problems kept in full (each names file, row and field); past it a file's problems are
# counted, so that a large file of bad rows does not fill the memory with messages.
MAX_KEPT_PROBLEMS = 10_000
# Rows read, validated and written at a time: a file of any size is held one batch at a time
# (of JSON Lines, also at most BATCH_BYTES of text: rows of long conversations).
BATCH_ROWS = 10_000
BATCH_BYTES = 8_000_000
SHOWN_CHARS = 60  # of a bad JSON line, in an error
HH_ASSISTANT_TURN = "\n\nAssistant:"  # where an HH-RLHF prompt ends


class DataValidationError(InputError, ValueError):
    """A data file does not meet its contract. The message lists every problem found."""

    def __init__(self, path: str | Path, problems: list[str], unlisted: int = 0):
        self.path = str(path)
        self.problems = problems
        self.unlisted = unlisted  # problems found but not kept (a large file: see MAX_KEPT_PROBLEMS)
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown) + unlisted
        lines = [f"{path}: {len(problems) + unlisted} problem(s) found:"] + [f"  {p}" for p in shown]
        if more:
            lines.append(f"  ... and {more} more")
        super().__init__("\n".join(lines))


def read_batches(
    path: str | Path, *, split: str | None = None, config: str | None = None, batch_rows: int | None = None
) -> Iterator[pd.DataFrame]:
    """The rows of a JSONL, JSON, Parquet or CSV file, of a `datasets.save_to_disk` folder, or
    of the Hugging Face Hub dataset `path` names (``owner/name``) when no such local path
    exists, `batch_rows` at a time: JSONL, CSV and Parquet are read as they are iterated,
    a saved or Hub dataset through its memory-mapped Arrow files; a JSON file (one array)
    is parsed whole, so a large dataset is better given as JSON Lines.

    `split` picks the split of a Hub dataset or of a saved DatasetDict (default ``train``);
    a file or a saved Dataset has none, and naming one for it is an error (it would read
    the whole file as that split). `config` names a Hub dataset's configuration (e.g.
    ``"main"`` for ``openai/gsm8k``). Problems of the file as a whole fail before the
    first batch; bad JSON lines fail after the last batch read before them, naming all.
    `batch_rows`: default BATCH_ROWS."""
    batch_rows = batch_rows or BATCH_ROWS
    local = Path(path)
    if not local.exists():
        if looks_like_hub_dataset(str(path)):
            yield from _arrow_batches(_hub_dataset(str(path), split or "train", config), batch_rows, str(path))
            return
        raise DataValidationError(
            path,
            ["does not exist; check the path in params.yaml (prepare.files), or name a Hugging Face dataset as "
             "owner/name"],
        )  # fmt: skip
    if config is not None:
        raise DataValidationError(
            local, [f"config {config!r}: a local file or folder has no configurations (a Hub dataset has); remove it"]
        )
    if local.is_dir():
        yield from _arrow_batches(_saved_dataset(local, split), batch_rows, local)
        return
    if split is not None:
        raise DataValidationError(
            local, [f"split {split!r}: a file has no splits (a Hub dataset or a saved DatasetDict has); remove it"]
        )
    suffix = local.suffix.lower()
    readers = {".jsonl": _jsonl_batches, ".json": _json_batches, ".parquet": _parquet_batches, ".csv": _csv_batches}
    if suffix not in readers:
        raise DataValidationError(
            local, [f"unsupported file type {suffix!r}; use one of {', '.join(FORMATS)} or a save_to_disk folder"]
        )
    try:
        yield from readers[suffix](local, batch_rows)
    except DataValidationError:
        raise
    except UnicodeDecodeError as error:
        byte = error.object[error.start : error.start + 1].hex()
        raise DataValidationError(
            local, [f"is not UTF-8 text (byte 0x{byte} is not UTF-8: {error.reason}); save the file as UTF-8"]
        ) from error
    except ValueError as error:  # pandas' and pyarrow's parse errors (ArrowInvalid is a ValueError)
        raise DataValidationError(local, [f"cannot be parsed as {suffix}: {error}"]) from error


def read_table(path: str | Path, *, split: str | None = None, config: str | None = None) -> pd.DataFrame:
    """All rows of `path` in one frame (`read_batches`): for files known to be small."""
    frames = list(read_batches(path, split=split, config=config))
    if not frames:
        raise DataValidationError(path, ["the file has no rows"])
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


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


# ----------------------------------------------------------------------------- readers


def _shown(text: str) -> str:
    text = text.strip()
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _records_frame(path: Path, records: list, first: int = 0) -> pd.DataFrame:
    """JSON records as a frame of object columns, so that values stay as parsed (an int
    answer beside a null one is not turned into 8.0), and a missing key reads as None."""
    problems = [
        f"record {first + i + 1}: expected a JSON object {{...}}, got {type(record).__name__}"
        for i, record in enumerate(records)
        if not isinstance(record, dict)
    ]
    if problems:
        raise DataValidationError(path, problems)
    columns = list(dict.fromkeys(key for record in records for key in record))
    return pd.DataFrame({c: pd.Series([r.get(c) for r in records], dtype=object) for c in columns})


def _jsonl_batches(path: Path, batch_rows: int) -> Iterator[pd.DataFrame]:
    """One JSON object per line; blank lines are skipped, and every bad line is reported
    with its 1-based number and start (pandas' reader names neither). After a bad line no
    more batches are yielded (the record numbers would no longer be the file's), but the
    rest of the file is read for its bad lines."""
    records, problems, unlisted, size = [], [], 0, 0
    with open(path, encoding="utf-8-sig") as file:  # a byte-order mark (Windows editors) is dropped
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # so that a cut-short line errs on its own column
            except json.JSONDecodeError as error:
                problem = f"line {number}: invalid JSON ({error.msg} at column {error.colno}): {_shown(line)}"
            else:
                if isinstance(record, dict):
                    if not problems and not unlisted:
                        records.append(record)
                        size += len(line)
                        if len(records) == batch_rows or size >= BATCH_BYTES:
                            yield _records_frame(path, records)
                            records, size = [], 0
                    continue
                problem = f"line {number}: expected a JSON object {{...}}, got {type(record).__name__}"
            if len(problems) < MAX_KEPT_PROBLEMS:
                problems.append(problem)
            else:
                unlisted += 1
    if problems:
        raise DataValidationError(path, problems, unlisted)
    if records:
        yield _records_frame(path, records)


def _json_batches(path: Path, batch_rows: int) -> Iterator[pd.DataFrame]:
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        hint = "; one object per line is JSON Lines: name the file .jsonl" if error.msg == "Extra data" else ""
        near = text[max(0, error.pos - SHOWN_CHARS // 2) : error.pos + SHOWN_CHARS // 2]
        raise DataValidationError(
            path, [f"line {error.lineno} column {error.colno}: invalid JSON ({error.msg}) near {near!r}{hint}"]
        ) from error
    del text
    if isinstance(data, dict):
        data = data.get("data", data)
    if not isinstance(data, list):
        raise DataValidationError(path, ["a .json file must hold a list of records (or {'data': [...]})"])
    for start in range(0, len(data), batch_rows):
        yield _records_frame(path, data[start : start + batch_rows], start)


def _parquet_batches(path: Path, batch_rows: int) -> Iterator[pd.DataFrame]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(path, "rb") as file:  # opened by Python: audit hooks see the read (read_prepared)
        # Not pre-buffered: pyarrow's default keeps every row group it has read until the end.
        for batch in pq.ParquetFile(file, pre_buffer=False).iter_batches(batch_size=batch_rows):
            yield _arrow_frame(pa.Table.from_batches([batch]))


def _csv_batches(path: Path, batch_rows: int) -> Iterator[pd.DataFrame]:
    # An empty cell is a missing value, as JSON's null (not "" text).
    with pd.read_csv(path, dtype=str, keep_default_na=False, chunksize=batch_rows) as chunks:
        for chunk in chunks:
            yield chunk.replace({"": None}).reset_index(drop=True)


def _arrow_batches(dataset, batch_rows: int, path) -> Iterator[pd.DataFrame]:
    """A `datasets.Dataset` (memory-mapped Arrow files) in batches; `path` names it in errors."""
    try:
        for table in dataset.with_format("arrow").iter(batch_size=batch_rows):
            yield _arrow_frame(table)
    except (OSError, ValueError) as error:  # a data file missing or cut short (pyarrow's errors are ValueErrors)
        raise DataValidationError(path, [f"cannot be read ({error}); save it again with `save_to_disk`"]) from error


def _arrow_frame(table) -> pd.DataFrame:
    """An Arrow table (a Parquet file, a `datasets` split) as a frame. An integer column with
    an empty cell keeps its integers as Python ints: pandas' default makes it float64, which
    turns 8 into 8.0 and loses the last digits of an answer above 2**53."""
    return table.to_pandas(integer_object_nulls=True)


def _saved_dataset(path: Path, split: str | None):
    if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        raise DataValidationError(
            path, ["a folder must be a `datasets.Dataset.save_to_disk` folder (no dataset_info.json found)"]
        )
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(path))
        if isinstance(dataset, DatasetDict):
            split = split or "train"
            if split not in dataset:
                raise DataValidationError(path, [f"no split {split!r} in this DatasetDict; found {sorted(dataset)}"])
            dataset = dataset[split]
        elif split is not None:
            raise DataValidationError(
                path, [f"split {split!r}: this saved Dataset has no splits (a saved DatasetDict has); remove it"]
            )
        dataset.with_format("arrow")[:1]  # a data file missing or cut short fails here, named
    except DataValidationError:
        raise
    except (OSError, ValueError) as error:  # a data file missing or cut short (pyarrow's errors are ValueErrors)
        raise DataValidationError(
            path, [f"cannot be read as a save_to_disk folder ({error}); save it again with `save_to_disk`"]
        ) from error
    return dataset


def looks_like_hub_dataset(name: str) -> bool:
    """``owner/name`` with no data-file suffix, whose ``owner`` is not a local folder (then
    ``data/prefs`` is a mistyped local path, not a dataset)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") != 1 or Path(name).suffix.lower() in FORMATS or Path(name).parent.is_dir():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_dataset(name: str, split: str, config: str | None):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    what = f"Hugging Face dataset {name!r}" + (f" (config {config!r})" if config else "") + f", split {split!r}"
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except ConnectionError as error:  # offline mode included (OfflineModeIsEnabled)
        offline = " (HF_HUB_OFFLINE is set)" if datasets.config.HF_HUB_OFFLINE else ""
        raise DataValidationError(
            name,
            [
                f"no local path {name!r}, and the {what} is not cached and the Hub cannot be reached{offline}: "
                "download it while online (it is cached), or save it with `datasets.Dataset.save_to_disk` or "
                "to a JSONL file and give that path; unset HF_HUB_OFFLINE/HF_DATASETS_OFFLINE when online"
            ],
        ) from error
    except DatasetNotFoundError as error:
        raise DataValidationError(name, [f"no local path {name!r}, and no {what} on the Hub: {error}"]) from error
    except (ValueError, FileNotFoundError) as error:  # an unknown config or split: datasets lists the valid ones
        raise DataValidationError(name, [f"cannot load the {what}: {error}"]) from error
    return dataset


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
