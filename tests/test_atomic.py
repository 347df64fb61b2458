"""Staging folders: a killed writer's half-built output is swept by the next write of the
same output; a live writer's is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

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
