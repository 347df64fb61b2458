"""A training stage killed with SIGKILL resumes from its last checkpoint, and the resumed
run ends with the same weights as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_params, write_params
from tests.test_stages import weights

pytestmark = pytest.mark.slow


def wait_for_checkpoint(root: Path, process: subprocess.Popen, minimum_step: int, timeout: float = 240) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(root.glob("checkpoints/sft/*/checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        done = [p for p in found if (p / "trainer_state.json").exists() and int(p.name.split("-")[1]) >= minimum_step]
        if done:
            return done[-1]
        if process.poll() is not None:
            raise AssertionError(f"sft finished before it could be killed:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared in time")


def test_sft_killed_mid_run_resumes_and_reproduces(in_project):
    import stages.base
    import stages.prepare
    import stages.sft

    root = in_project
    write_params(
        root,
        tiny_params(sft={"max_steps": 120, "save_steps": 20, "logging_steps": 10, "per_device_train_batch_size": 8}),
    )
    stages.prepare.main()
    stages.base.main()

    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    process = subprocess.Popen(
        [sys.executable, "-m", "stages.sft"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    checkpoint = wait_for_checkpoint(root, process, minimum_step=40)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (root / "models/sft").exists(), "a killed stage leaves no half-written output"

    resumed = subprocess.run(
        [sys.executable, "-m", "stages.sft"], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    assert "resuming from" in resumed.stdout + resumed.stderr
    metrics = json.loads((root / "metrics/sft.json").read_text())
    assert metrics["resumed"] is True and metrics["steps"] == 120
    resumed_weights = weights(root / "models/sft")
    assert int(checkpoint.name.split("-")[1]) >= 40

    # The same params from scratch, uninterrupted, in process.
    stages.sft.main()
    fresh = json.loads((root / "metrics/sft.json").read_text())
    assert fresh["resumed"] is False
    fresh_weights = weights(root / "models/sft")
    for name, tensor in fresh_weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
