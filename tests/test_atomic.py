"""Staging folders: a killed writer's half-built output is swept by the next write of the
same output; a live writer's is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.atomic import atomic_dir, atomic_file


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_killed_writers_staging_is_swept_and_a_live_ones_kept(tmp_path):
    out = tmp_path / "models/sft"
    out.parent.mkdir(parents=True)
    killed = out.with_name(f".sft.tmp-{dead_pid()}-0123abcd")
    (killed / "half").mkdir(parents=True)
    (killed / "half/model.safetensors").write_bytes(b"\0" * 100)
    live = out.with_name(f".sft.tmp-{os.getppid()}-89abcdef")  # the test runner's parent: alive
    live.mkdir()
    other = out.with_name(f".sft-other.tmp-{dead_pid()}-0123abcd")  # another output's: not this one's
    other.mkdir()
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert (out / "config.json").is_file()
    assert not killed.exists() and live.exists() and other.exists()

    report = tmp_path / "metrics.json"
    stale = report.with_name(f".metrics.json.tmp-{dead_pid()}-fedcba98")
    stale.write_text("{")
    with atomic_file(report) as tmp:
        tmp.write_text("{}")
    assert not stale.exists() and report.read_text() == "{}"


@pytest.mark.slow  # seconds (a DVC repo, stage processes or training): out of the quick tier
def test_a_stage_output_is_stored_once_and_an_atomic_rewrite_leaves_the_cache_whole(tmp_path):
    """The project's DVC cache type links an output to its cache object (a model is on disk
    once, not twice): after `dvc repro` the output and the object are one file, read-only.
    Replacing the output the way the stages write (a new file renamed over it) leaves the
    cached copy as it was, and `dvc status` sees the change."""
    import hashlib

    from tests.conftest import project_cache_type, run

    assert project_cache_type().split(",")[0] == "hardlink"
    run(["git", "init", "-q"], tmp_path)
    run([sys.executable, "-m", "dvc", "init", "-q"], tmp_path)
    run([sys.executable, "-m", "dvc", "config", "cache.type", project_cache_type()], tmp_path)
    write = "import os; os.makedirs('model', exist_ok=True); open('model/weights.bin', 'wb').write(b'w' * 65536)"
    (tmp_path / "dvc.yaml").write_text(
        f'stages:\n  train:\n    cmd: {sys.executable} -c "{write}"\n    outs:\n      - model\n'
    )
    run([sys.executable, "-m", "dvc", "repro", "-q"], tmp_path)
    weights = tmp_path / "model/weights.bin"
    digest = hashlib.md5(weights.read_bytes()).hexdigest()
    cached = tmp_path / ".dvc/cache/files/md5" / digest[:2] / digest[2:]
    assert cached.is_file()
    assert os.stat(weights).st_ino == os.stat(cached).st_ino, "one file on disk, not two"
    assert not os.stat(weights).st_mode & 0o222, "read-only: an in-place write fails, never reaching the cache"
    with atomic_file(weights) as tmp:
        tmp.write_bytes(b"x" * 65536)
    assert hashlib.md5(cached.read_bytes()).hexdigest() == digest, "the cached object is untouched"
    status = run([sys.executable, "-m", "dvc", "status"], tmp_path).stdout
    assert "modified" in status and "model" in status
