"""The prepared tables (data/prepared/*.parquet): written one batch at a time, read back as
memory-mapped datasets.

Writing. `TableWriter` appends validated batches to one Parquet file (a row group each) with
the schema of its first batch, so a table of any size is never held whole; it keeps what
the stage needs afterwards without reading the table again: its rows, the format of its
first row (text or messages) and, when asked, a 64-bit key of each row's prompt (the
held-out split picks whole prompts by them: 8 bytes a row, not the table).

Reading. `prepared_dataset` loads a table with datasets' Parquet loader: the rows are
converted once into an Arrow file in the datasets cache and then memory-mapped, so a stage
holds the pages it reads, not the table, and the dataset's fingerprint is the same while
the file is (same path, same modification time): every `map` over it, TRL's tokenisation
included, and TRL's precomputed reference log-probs are found in the cache on the next run.
`prepared_batches` streams a table's rows as frames (the derivations, small readers), and
`read_prepared` reads the columns or rows a reader asks for (an eval suite), a batch at a
time (`readers.BATCH_ROWS` rows).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from rlhf.data import readers
from rlhf.data.contracts import DataValidationError, plain_messages, prompt_key, value_format


def prompt_hash(prompt) -> int:
    """A 64-bit key of a prompt (text or conversation, however it was read: `prompt_key`)."""
    return int.from_bytes(hashlib.blake2b(prompt_key(prompt).encode(), digest_size=8).digest(), "little")


def row_prompts(frame: pd.DataFrame) -> list:
    """Each row's prompt: its `prompt`, or a conversation's turns before the last. A
    long-context row (a `context` column) is the context and the prompt as one text."""
    if "context" in frame.columns:
        from rlhf.tasks.long_context import joined

        return [joined(c, str(p)) for c, p in zip(frame["context"], frame["prompt"])]
    if "prompt" in frame.columns:
        return list(frame["prompt"])
    if "messages" in frame.columns:
        return [list(m)[:-1] for m in frame["messages"]]
    return []


class TableWriter:
    """One prepared table, written batch by batch (module docstring). `origin` names where
    its rows come from, in errors; `keyed`: keep each row's prompt key (`keys`)."""

    def __init__(self, path: Path, origin: str = "", keyed: bool = False):
        self.path, self.origin, self.keyed = Path(path), origin, keyed
        self.rows = 0
        self.columns: list[str] | None = None
        self.first_format: str | None = None  # of the first row's prompt (or conversation)
        self.keys: list[np.ndarray] = []
        self._schema = None
        self._writer = None

    def write(self, frame: pd.DataFrame, origin: str | None = None) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.columns is None:
            self.columns = list(frame.columns)
        if not len(frame):
            return
        if self._schema is None:
            schema = pa.Table.from_pandas(frame, preserve_index=False).schema
            # A column with no value in the first batch (an optional answer) holds text.
            fields = [pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f for f in schema]
            self._schema = pa.schema(fields, metadata=schema.metadata)
            column = "messages" if "messages" in frame.columns else "prompt"
            if column in frame.columns:
                self.first_format = value_format(frame[column].iloc[0])
        try:
            table = pa.Table.from_pandas(frame[self.columns], schema=self._schema, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as error:
            where = origin or self.origin
            raise DataValidationError(
                where,
                [f"its rows cannot be written to {self.path.name} beside the rows before them ({error}); give every "
                 "file of one table in the same format"],
            ) from error  # fmt: skip
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, self._schema)
        self._writer.write_table(table)
        if self.keyed:
            self.keys.append(np.fromiter((prompt_hash(p) for p in row_prompts(frame)), np.uint64, len(frame)))
        self.rows += len(frame)

    def close(self, columns: tuple[str, ...] = ()) -> None:
        """Finish the file; a table with no rows is written with `columns` (or those seen)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        elif not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            names = self.columns or list(columns)
            pd.DataFrame({c: pd.Series([], dtype=object) for c in names}).to_parquet(self.path, index=False)

    def all_keys(self) -> np.ndarray:
        return np.concatenate(self.keys) if self.keys else np.zeros(0, np.uint64)


def prepared_dataset(path: str | Path, stage: str):
    """A prepared table as a memory-mapped `datasets.Dataset` (module docstring), or the
    error that says how to provide it. Conversations read as lists of message dicts."""
    from datasets import Dataset

    path = existing(path, stage)
    import pyarrow.dataset as pds

    with open(path, "rb"):  # opened by Python as well, so that audit hooks see the read
        pass
    # Without pre-buffering: pyarrow's default reads ahead and keeps what it read, so that
    # converting a 1.7 GB table peaked at 1.9 GB (benchmarks/README.md, data at size).
    options = pds.ParquetFragmentScanOptions(pre_buffer=False)
    return Dataset.from_parquet(str(path), split="train", fragment_scan_options=options)


def missing_prepared(path: Path, stage: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{stage} needs {path}, which prepare did not write: with prepare.source=files, add "
        f"prepare.files.{path.stem}: {{path: ...}} to params.yaml (or use prepare.source: builtin)"
    )


def existing(path: str | Path, stage: str) -> Path:
    """`path` of a prepared table, or the error that says how to provide it."""
    path = Path(path)
    if not path.exists():
        raise missing_prepared(path, stage)
    return path


def prepared_batches(path: str | Path, columns: list[str] | None = None, batch_rows: int | None = None) -> Iterator:
    """A prepared table's rows as frames of at most `batch_rows` (conversations as lists of
    message dicts, as `read_prepared` gives them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(path, "rb") as file:  # opened by Python: audit hooks see the read
        parquet = pq.ParquetFile(file, pre_buffer=False)  # pre-buffered reads keep every row group read
        if not parquet.metadata.num_rows:
            return
        for batch in parquet.iter_batches(batch_size=batch_rows or readers.BATCH_ROWS, columns=columns):
            yield plain_messages(pa.Table.from_batches([batch]).to_pandas(integer_object_nulls=True))


def sampled_rows(path: Path, n: int, seed: int) -> pd.DataFrame:
    """`read_prepared`'s `sample`: pandas draws the row positions with
    `RandomState(seed).choice(rows, n, replace=False)`; the same positions are kept from
    each batch as it passes."""
    import numpy as np

    rows = prepared_rows(path, "sample")
    if rows <= n:
        return read_prepared(path, "sample")
    positions = np.random.RandomState(seed).choice(rows, size=n, replace=False)
    wanted, kept, start = np.sort(positions), [], 0
    for frame in prepared_batches(path):
        inside = wanted[(wanted >= start) & (wanted < start + len(frame))]
        if len(inside):
            kept.append(frame.iloc[inside - start].set_axis(inside))
        start += len(frame)
    return pd.concat(kept).loc[positions]


def prepared_rows(path: str | Path, stage: str) -> int:
    """The rows of a prepared table (read from its footer), or the error that says how to
    provide it."""
    import pyarrow.parquet as pq

    with open(existing(path, stage), "rb") as file:
        return pq.ParquetFile(file).metadata.num_rows


def prepared_columns(path: str | Path) -> list[str]:
    """The column names of a prepared table (read from its footer)."""
    import pyarrow.parquet as pq

    with open(path, "rb") as file:
        return pq.ParquetFile(file).schema_arrow.names


def read_prepared(
    path: str | Path,
    stage: str,
    columns: list[str] | None = None,
    limit: int | None = None,
    sample: tuple[int, int] | None = None,
) -> pd.DataFrame:
    """A table written by `prepare`, or an error that says how to provide it. With
    `columns` (those the table has) or `limit` (its first rows), only those are read, a
    batch at a time: a suite's other columns and rows never reach memory. `sample` (n,
    seed): the rows `table.sample(n, random_state=seed)` of the whole table would give, in
    its order (the whole table when it has at most n), read a batch at a time."""
    path = existing(path, stage)
    if sample is not None:
        return sampled_rows(path, *sample)
    if columns is not None or limit is not None:
        kept = None if columns is None else [c for c in prepared_columns(path) if c in columns]
        frames, rows = [], 0
        for frame in prepared_batches(path, kept):
            frames.append(frame)
            rows += len(frame)
            if limit is not None and rows >= limit:
                break
        if not frames:
            with open(path, "rb") as file:
                return pd.read_parquet(file, columns=kept)
        table = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        return table.head(limit) if limit is not None else table
    # Opened here, not by pyarrow, so that Python's audit hooks see the read (the
    # end-to-end test checks every file a stage reads against its DVC deps).
    with open(path, "rb") as file:
        table = pd.read_parquet(file)
    return plain_messages(table)
