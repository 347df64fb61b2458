"""dvc.lock as this process reads it: parsed once per version of the file.

A stage asks the lock several questions (the hash of each model it scores, its own entry
for the MLflow tag, whether it was started by hand); the file lists every stage's code
deps and is about 50 KB in a project, so PyYAML's pure-Python parser took 0.15 s a read.
It is parsed with libyaml where PyYAML has it, and again only when the file changes.
"""

from __future__ import annotations

from pathlib import Path

_CACHE: dict[Path, tuple[tuple[int, int, int], dict]] = {}


def lock_stages(lock_path: str | Path = "dvc.lock") -> dict | None:
    """The `stages` mapping of the lock file (stage address -> entry), or None without the file."""
    import yaml

    path = Path(lock_path).resolve()
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    cached = _CACHE.get(path)
    if cached is None or cached[0] != version:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(path.read_text(), Loader=loader) or {}
        cached = _CACHE[path] = (version, data.get("stages") or {})
    return cached[1]


def output_hash(path: str | Path, lock_path: str | Path = "dvc.lock") -> str | None:
    """DVC's hash of a stage output (its md5; ``<md5>.dir`` for a folder) as dvc.lock
    records it: which version of a model produced a number. None without a lock or a stage
    that outputs `path` (a stage run outside `dvc repro`)."""
    wanted = Path(path).as_posix()
    for entry in (lock_stages(lock_path) or {}).values():
        for out in entry.get("outs") or []:
            if out.get("path") == wanted:
                return out.get("md5") or out.get("hash")
    return None
