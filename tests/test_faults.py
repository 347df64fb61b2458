"""The fault table (docs/reference/faults.md): every training stage killed with SIGKILL after
its first checkpoint, then run again.

For each way a stage trains: sft (the verifier trains with the same function), rm (killed
during its second member), prm, policy@dpo (simpo, orpo and kto resume through the same
TRL trainer setup, `trainer_setup.train_resumable`), rl@grpo (rloo likewise) and rl@ppo
(our loop):

* the stage first runs uninterrupted; its output is the reference;
* the same stage is started again and killed (`kill -9`) once a checkpoint is on disk: the
  reference output is still there, byte for byte (outputs are replaced atomically, so a
  failed write leaves the previous artifact);
* the rerun (in the test's process: it finds only what the killed one left on disk) says it
  resumes from that checkpoint and ends with the reference's weights.

A damaged checkpoint (its weights truncated, as a kill during the write or a full disk
leaves it) is named, discarded, and the run still ends where an uninterrupted run ends.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import call_main, tiny_params
from tests.test_pipeline_e2e import tree_digest

pytestmark = pytest.mark.slow

SAVE = 3  # checkpoint every SAVE steps; a run has STEPS steps, killed after its first checkpoint
STEPS = 4 * SAVE
TRAINER = {"max_steps": STEPS, "save_steps": SAVE, "logging_steps": 1}
# Online steps on the micro model take about 50 ms: more of them, so the kill lands mid-run.
# The micro model's answers never match: the RM ensemble's reward varies, so the advantages
# are not all zero and the weights the resumed run must reproduce really move.
REWARD = {"rewards": [{"name": "reward_model"}]}
ONLINE = {
    "max_steps": 2 * STEPS, "num_generations": 2, "max_completion_length": 8, "per_device_train_batch_size": 4,
    **REWARD,
}  # fmt: skip
PPO = {
    "max_steps": 2 * STEPS, "save_steps": SAVE, "rollout_batch_size": 4, "mini_batch_size": 2, "max_new_tokens": 8,
    **REWARD,
}  # fmt: skip

FAULTS_STEPS = {f"rl@{m}": 2 * STEPS for m in ("grpo", "ppo")}
# stage: (command, output folder, checkpoint glob, the params section that sets its steps)
FAULTS = {
    "sft": (["stages.sft"], "models/sft", "checkpoints/sft/*/checkpoint-*"),
    "rm": (["stages.rm"], "models/rm", "checkpoints/rm/*/member_1/checkpoint-*"),
    "prm": (["stages.prm"], "models/prm", "checkpoints/prm/*/checkpoint-*"),
    "policy@dpo": (["stages.policy", "dpo"], "models/policy/dpo", "checkpoints/policy-dpo/*/checkpoint-*"),
    "rl@grpo": (["stages.rl", "grpo"], "models/policy/grpo", "checkpoints/rl-grpo/*/checkpoint-*"),
    "rl@ppo": (["stages.rl", "ppo"], "models/policy/ppo", "checkpoints/rl-ppo/*/step-*"),
}


def fault_params() -> dict:
    policy = {
        "offline": ["dpo"],
        "online": ["grpo", "ppo"],
        "dpo": {**TRAINER, "per_device_train_batch_size": 4},
        "grpo": {**TRAINER, **ONLINE},
        "ppo": PPO,
    }
    return tiny_params(
        sft={**TRAINER, "per_device_train_batch_size": 8},
        verifier={**TRAINER, "per_device_train_batch_size": 8},
        rm={**TRAINER, "num_members": 2, "per_device_train_batch_size": 8},
        prm={**TRAINER, "kind": "classifier", "per_device_train_batch_size": 8},
        policy=policy,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from tests.conftest import make_project

    root = make_project(tmp_path_factory.mktemp("faults") / "project", fault_params())
    setup = (
        ["stages.prepare"],
        ["stages.base"],
        FAULTS["sft"][0],
        ["stages.verifier"],
        FAULTS["rm"][0],
        FAULTS["prm"][0],
    )
    for command in setup:
        stage_here(root, command)
    return root


def environment(root: Path) -> dict:
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    for name in ("RLHF_PARENT_RUN_ID", "DVC_STAGE", "DVC_ROOT", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(name, None)
    return env


def stage_here(root: Path, command: list[str]) -> str:
    """Run a stage in this process, as `python -m` would in the project's folder with its
    tracking store and no parent run, and return what it printed: the setup, the
    uninterrupted references and the reruns need not pay a new process's imports (about
    10 s each). What is killed runs in its own process (kill_after_checkpoint); the rerun
    finds only what that process left on disk."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", environment(root)["MLFLOW_TRACKING_URI"])
        for name in ("RLHF_PARENT_RUN_ID", "DVC_STAGE", "DVC_ROOT", "MLFLOW_EXPERIMENT_NAME"):
            patch.delenv(name, raising=False)
        try:
            call_main(command)
        except BaseException:
            sys.__stderr__.write(out.getvalue()[-3000:])  # what a failed stage printed, in the report
            raise
    return out.getvalue()


def kill_after_checkpoint(root: Path, command: list[str], pattern: str, timeout: float = 600) -> Path:
    """Start the stage, SIGKILL it once a whole checkpoint matching `pattern` exists."""
    process = subprocess.Popen(
        [sys.executable, "-m", *command], cwd=root, env=environment(root),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            whole = [
                p for p in root.glob(pattern) if (p / "trainer_state.json").is_file() or (p / "state.json").is_file()
            ]
            if whole:
                process.send_signal(signal.SIGKILL)
                process.wait()
                return whole[0]
            if process.poll() is not None:
                raise AssertionError(f"{command} ended before it could be killed:\n{process.stdout.read()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no checkpoint {pattern} within {timeout:.0f} s")
    finally:
        if process.poll() is None:
            process.kill()


def step(checkpoint: Path) -> int:
    return int(checkpoint.name.rsplit("-", 1)[1])


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.rglob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            out[f"{file.relative_to(folder)}:{name}"] = tensor
    return out


def assert_same_weights(resumed: dict, reference: dict, what: str) -> None:
    assert resumed.keys() == reference.keys(), what
    for name, tensor in reference.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-5, rtol=1e-4, msg=f"{what}: {name}")


@pytest.mark.parametrize("name", list(FAULTS))
def test_killed_stage_resumes_and_ends_where_an_uninterrupted_run_ends(project, name):
    command, output, pattern = FAULTS[name]
    stage_here(project, command)  # uninterrupted: the reference (and the artifact a kill must not touch)
    reference, digest = tensors(project / output), tree_digest(project / output)
    assert reference and not list(project.glob(pattern)), "a finished stage leaves no checkpoint"
    if name.startswith(("policy@", "rl@")):  # the weights to reproduce moved away from the start
        start = tensors(project / "models/sft")
        assert any(not torch.equal(start[k], v) for k, v in reference.items() if k in start), name

    checkpoint = kill_after_checkpoint(project, command, pattern)
    assert tree_digest(project / output) == digest, "the kill left the previous artifact intact"

    log = stage_here(project, command)
    # From the checkpoint the kill found, or a newer one completed before the signal landed.
    resumed = re.search(r"resuming from (\S+)", log)
    assert resumed and Path(resumed[1]).parent == checkpoint.relative_to(project).parent, log[-3000:]
    assert step(Path(resumed[1])) >= step(checkpoint)
    metrics = project / ("metrics/sft.json" if name == "sft" else f"metrics/policy/{name.split('@')[-1]}.json")
    if name == "sft" or name.startswith(("policy@", "rl@")):
        recorded = json.loads(metrics.read_text())
        assert recorded["resumed"] is True and recorded["steps"] == FAULTS_STEPS.get(name, STEPS), recorded
    assert_same_weights(tensors(project / output), reference, name)


def test_a_damaged_checkpoint_is_discarded_and_the_run_still_ends_right(project):
    command, output, pattern = FAULTS["sft"]
    stage_here(project, command)
    reference = tensors(project / output)
    checkpoint = kill_after_checkpoint(project, command, pattern)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a write cut short

    log = stage_here(project, command)
    assert f"discarding damaged checkpoint {checkpoint.relative_to(project)}: model.safetensors" in log, log[-3000:]
    assert "resuming from" not in log
    assert_same_weights(tensors(project / output), reference, "sft after a damaged checkpoint")


def test_two_dvc_repros_at_once_one_fails_cleanly_and_nothing_is_corrupted(project):
    """A second `dvc repro` while the first is inside the sft stage: DVC's locks make it fail
    at once with a message that says the path is in use (or wait); the first finishes, and
    the project is up to date with whole outputs."""
    from tests.conftest import commit_stages

    dvc = [sys.executable, "-m", "dvc"]
    env = environment(project)
    stage_here(project, ["stages.check_params"])
    commit_stages(project, ["check_params", "prepare", "base"])  # what the module's setup ran: the repros run sft
    first = subprocess.Popen(
        [*dvc, "repro", "sft"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while not list(project.glob("checkpoints/sft/*/checkpoint-*")):
            assert first.poll() is None, first.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "sft never checkpointed"
            time.sleep(0.05)
        second = subprocess.run([*dvc, "repro", "sft"], cwd=project, env=env, capture_output=True, text=True)
        output, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, output[-3000:]
    message = second.stdout + second.stderr
    assert second.returncode != 0, message
    assert re.search(r"already being used|Unable to acquire lock|is busy", message), message
    status = subprocess.run([*dvc, "status", "sft"], cwd=project, env=env, capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout
    assert tensors(project / "models/sft")
