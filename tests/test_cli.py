"""The `rlhf` command: its subcommands, and `rlhf status` on a project."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def rlhf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_help_lists_every_subcommand_and_an_unknown_one_is_refused():
    from rlhf.cli import COMMANDS

    out = rlhf("--help")
    assert out.returncode == 0
    for name in ("run", "check", "status", "rollback", "label", "generate", "recipes"):
        assert f"\n  {name} " in out.stdout and name in COMMANDS
    wrong = rlhf("trian")
    assert wrong.returncode == 2 and "unknown command 'trian'" in wrong.stderr


@pytest.mark.slow  # three CLI processes, one importing Prefect
def test_a_subcommand_takes_its_modules_options():
    out = rlhf("rollback", "--help")
    assert out.returncode == 0 and "usage: rlhf rollback" in out.stdout and "--unpin" in out.stdout
    assert "qwen2.5-0.5b-gsm8k" in rlhf("recipes", "list").stdout
    # The flow and the params check run as programs of their own (rlhf never imports them).
    run = rlhf("run", "--help")
    assert run.returncode == 0 and "usage: rlhf run" in run.stdout and "--deploy" in run.stdout, run.stderr


def test_help_only_helps(tmp_path):
    """`rlhf check --help` ran the check and wrote reports/params.ok; `rlhf launch --help`
    tried to run a module named --help. Each prints its usage, exits 0, writes nothing."""
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    for name in ("check", "launch"):
        out = subprocess.run([sys.executable, "-m", "rlhf.cli", name, "--help"], cwd=tmp_path, capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert out.returncode == 0 and out.stdout.startswith(f"usage: rlhf {name}"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]
    assert "usage: rlhf launch MODULE" in rlhf("launch").stderr


@pytest.mark.slow  # git, dvc init and two CLI processes
def test_status_reads_the_champion_and_the_last_verdict(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    out = rlhf("status", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "champion: none yet" in out.stdout and "last verdict: none" in out.stdout
    (tmp_path / "models/champion").mkdir(parents=True)
    (tmp_path / "models/champion/champion.json").write_text(json.dumps({"candidate": "dpo", "model_version": "3"}))
    (tmp_path / "reports").mkdir()
    verdict = {"promoted": False, "promote": None, "candidates": {"dpo": {"passed": False}, "kto": {"passed": False}}}
    (tmp_path / "reports/gate.json").write_text(json.dumps(verdict))
    out = rlhf("status", cwd=tmp_path)
    assert "champion: dpo (registry version 3)" in out.stdout
    assert "last verdict: promoted nothing; passed: none" in out.stdout
