"""Reading a user's data into frames, a batch at a time: a JSONL, JSON, Parquet or CSV file,
a ``datasets.save_to_disk`` folder, or a Hugging Face Hub dataset named ``owner/name``. Every
problem of the file itself (a bad JSON line, text that is not UTF-8, a missing split) is one
`DataValidationError` naming the file and the line or record; what the rows must hold is
rlhf.data.contracts'.

Written here for files rather than taken from `datasets.load_dataset`: that converts a whole
file to an Arrow cache before its first row can be checked, and its JSON reader stops at
the first bad line, where a user needs every bad line named in one error; `datasets` still
reads saved and Hub datasets (memory-mapped Arrow).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from rlhf.params import InputError

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
