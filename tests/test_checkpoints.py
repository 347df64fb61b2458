"""Which checkpoint a resumed run trusts (rlhf.training.checkpoints): the newest whole one;
a damaged newer one is named and removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlhf.training.checkpoints import checkpoint_problem, usable_checkpoint


def write_checkpoint(folder: Path, step: int, state: str = "trainer_state.json") -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.ones(64)}}}, path / "optimizer.pt")
    (path / state).write_text(json.dumps({"global_step": step}))
    return path


def truncate(file: Path, keep: float = 0.5) -> None:
    file.write_bytes(file.read_bytes()[: int(file.stat().st_size * keep)])


def test_a_whole_checkpoint_has_no_problem(tmp_path):
    assert checkpoint_problem(write_checkpoint(tmp_path, 3)) is None


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda p: truncate(p / "model.safetensors"), "model.safetensors"),
        (lambda p: truncate(p / "model.safetensors", keep=0.001), "model.safetensors"),
        (lambda p: truncate(p / "optimizer.pt"), "optimizer.pt"),
        (lambda p: (p / "trainer_state.json").unlink(), "trainer_state.json"),
        (lambda p: (p / "trainer_state.json").write_text("{"), "trainer_state.json"),
    ],
    ids=["weights-cut", "weights-header-cut", "optimizer-cut", "no-state", "state-not-json"],
)
def test_a_damaged_newest_checkpoint_is_discarded_for_the_older_whole_one(tmp_path, capsys, damage, named):
    older = write_checkpoint(tmp_path, 3)
    newest = write_checkpoint(tmp_path, 6)
    damage(newest)
    assert usable_checkpoint(tmp_path, "checkpoint", "sft") == older
    assert not newest.exists()
    line = capsys.readouterr().out
    assert f"sft: discarding damaged checkpoint {newest}: " in line and named in line


def test_a_flipped_byte_inside_the_optimizer_state_fails_its_crc(tmp_path):
    path = write_checkpoint(tmp_path, 3)
    data = bytearray((path / "optimizer.pt").read_bytes())
    # Flip a byte of the stored tensor data (after the archive's first entry header).
    index = data.index(b"\x00\x00\x80\x3f") if b"\x00\x00\x80\x3f" in data else len(data) // 2
    data[index] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(data))
    assert "optimizer.pt" in checkpoint_problem(path)


def test_no_whole_checkpoint_means_a_fresh_start_and_ppo_steps_are_read_too(tmp_path):
    only = write_checkpoint(tmp_path, 4)
    truncate(only / "model.safetensors")
    assert usable_checkpoint(tmp_path, "checkpoint", "sft") is None
    assert usable_checkpoint(tmp_path / "missing", "checkpoint", "sft") is None
    step = tmp_path / "ppo" / "step-2"
    step.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, str(step / "policy.safetensors"))
    (step / "state.json").write_text(json.dumps({"iteration": 2}))
    assert usable_checkpoint(tmp_path / "ppo", "step", "ppo") == step
