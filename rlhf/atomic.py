"""Atomic writes: a killed stage never leaves half an output (and the JSON, CSV and hash helpers
the stages write with).

Every output is built under a temporary sibling path and renamed into place. A rename on
one filesystem is atomic, so a reader (DVC, the next stage, a person) sees either the old
artifact or the new one. Under a multi-process launch (rlhf.cli.launch) only rank 0
publishes: the other ranks' temporary paths are discarded, never renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _publishes() -> bool:
    """Rank 0 (or the only process) publishes outputs; torchrun / accelerate set RANK."""
    return os.environ.get("RANK", "0") == "0"


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


_STAGING_PART = re.compile(r"^\.(.+)\.tmp-\d+-[0-9a-f]{8}$")
_STAGING_PID = re.compile(r"\.tmp-(\d+)-[0-9a-f]{8}$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_staging(path: Path) -> list[Path]:
    """Remove the staging siblings of `path` (`.name.tmp-<pid>-<id>`) whose writer is dead: a
    killed stage's half-built output, which nothing else removes. A live writer's (another
    rank, another stage at work) stays. Returns what was removed."""
    removed = []
    if not path.parent.is_dir():
        return removed
    for sibling in path.parent.glob(f".{glob_escape(path.name)}.tmp-*"):
        match = _STAGING_PID.search(sibling.name)
        if match and not _alive(int(match.group(1))):
            if sibling.is_dir() and not sibling.is_symlink():
                shutil.rmtree(sibling, ignore_errors=True)
            else:
                sibling.unlink(missing_ok=True)
            removed.append(sibling)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def published_path(path: str | Path) -> Path:
    """Where a file written inside a staging folder (`atomic_dir`, `atomic_file`) will be
    once published: what a message names (the staging folder is gone when it is read)."""
    return Path(*[m.group(1) if (m := _STAGING_PART.match(part)) else part for part in Path(path).parts])


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `path` whole.

    On an exception the temporary directory is removed and `path` is left untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_staging(path)
    tmp = _tmp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _publishes():
        replace_path(tmp, path)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_path(src: Path, dst: Path) -> None:
    """Move `src` onto `dst`, replacing what is there (file or directory)."""
    if dst.is_dir() and not dst.is_symlink():
        # A directory cannot be renamed over a non-empty one: park the old one first, so
        # the window in which `dst` is missing is one rename long.
        old = _tmp_sibling(dst)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_staging(path)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if _publishes():
        os.replace(tmp, path)
    else:
        tmp.unlink(missing_ok=True)


def file_md5(path: str | Path) -> str:
    """The md5 of a file's bytes: what DVC records for a file dep or out."""
    digest = hashlib.md5()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: str | Path, data) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Rows as a CSV (training curves that `dvc plots show` renders)."""
    import pandas as pd  # here, not at the top: params validation imports this module

    with atomic_file(path) as tmp:
        pd.DataFrame(rows).to_csv(tmp, index=False)
