"""Training stages under several processes (stages/launch.py): the launch command params
choose, and a 2-process data-parallel run on CPUs (gloo) that trains what one process
trains on the same global batch."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from stages.launch import command
from tests.conftest import tiny_params, write_params

TOLERANCE = 1e-4  # |loss difference| per step allowed between 1 and 2 processes (float32 sums in another order)


def compute(**values):
    from rlhf.models.compute import ComputeConfig

    return ComputeConfig(**values)


def test_the_launch_command_follows_compute_params(tmp_path):
    python = [sys.executable, "-m", "stages.sft", "--x"]
    assert command("stages.sft", ["--x"], compute()) == python
    assert command("stages.sft", ["--x"], compute(launcher="torchrun", processes=1)) == python
    assert command("stages.sft", ["--x"], compute(launcher="torchrun", processes=2)) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "stages.sft", "--x",
    ]  # fmt: skip
    config = tmp_path / "ddp.yaml"
    config.write_text("distributed_type: MULTI_CPU\n")
    assert command("stages.sft", [], compute(launcher="accelerate", processes=2, accelerate_config=str(config))) == [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
        "-m", "stages.sft",
    ]  # fmt: skip
    # A stage whose loop is not data-parallel yet starts as one process.
    assert command("stages.policy", ["ppo"], compute(launcher="torchrun", processes=2)) == [
        sys.executable, "-m", "stages.policy", "ppo",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"processes": 2}, "processes > 1 needs launcher torchrun or accelerate"),
        (
            {"launcher": "torchrun", "accelerate_config": "x.yaml"},
            "accelerate_config: read only with launcher accelerate",
        ),
        (
            {"launcher": "accelerate", "accelerate_config": "missing.yaml"},
            "accelerate_config: missing.yaml does not exist",
        ),
        ({"launcher": "mpirun"}, "launcher"),
    ],
)
def test_bad_launch_params_fail_naming_the_key(values, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        compute(**values)


def read_curve(path: Path) -> list[float]:
    with open(path) as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        f"{f.relative_to(folder)}:{k}": v
        for f in sorted(folder.rglob("*.safetensors"))
        for k, v in load_file(str(f)).items()
    }


CASES = {
    # stage: (launch args, params section, its curve, its metrics, its output)
    "sft": (["stages.sft"], "sft", "plots/sft/loss.csv", "metrics/sft.json", "models/sft"),
    "rm": (["stages.reward_model"], "rm", "plots/rm/member_0.csv", "metrics/rm.json", "models/rm"),
    "prm": (["stages.process_reward_model"], "prm", "plots/prm/loss.csv", "metrics/prm.json", "models/prm"),
    "policy@dpo": (
        ["stages.policy", "dpo"], "policy", "plots/policy/dpo/loss.csv", "metrics/policy/dpo.json", "models/policy/dpo",
    ),
}  # fmt: skip


def case_params(name: str, per_device: int, processes: int, launcher: str = "torchrun") -> dict:
    steps = {"max_steps": 8, "save_steps": 100, "logging_steps": 1, "per_device_train_batch_size": per_device}
    if name == "sft":
        params = tiny_params(sft={**steps, "learning_rate": 1e-3})
    elif name == "prm":  # the classifier kind trains (the likelihood kind fits a calibration)
        params = tiny_params(prm={**steps, "kind": "classifier", "learning_rate": 1e-3})
    elif name == "rm":
        params = tiny_params(rm={**steps, "learning_rate": 1e-3})
    else:
        # sft_weight 0: the RPO term is a token mean per process, which DDP averages over
        # processes, not over all tokens (a difference of about 1e-4 of the loss: README).
        params = tiny_params(policy={"offline": ["dpo"], "dpo": {**steps, "learning_rate": 1e-4, "sft_weight": 0.0}})
    if processes > 1:
        params["compute"] = {**params["compute"], "launcher": launcher, "processes": processes}
        if launcher == "accelerate":
            params["compute"]["accelerate_config"] = "configs/accelerate/ddp.yaml"
    return params


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "launcher"),
    [("sft", "torchrun"), ("sft", "accelerate"), ("rm", "torchrun"), ("prm", "torchrun"), ("policy@dpo", "torchrun")],
)
def test_two_gloo_processes_train_as_one_process_on_the_same_global_batch(in_project, name, launcher):
    """`python -m stages.launch ...`: one process with 8 rows per step, then `torchrun` (or
    `accelerate launch` with configs/accelerate/ddp.yaml) with 2 processes of 4 rows
    each. The loss curves agree step by step within TOLERANCE and so do the weights; rank 0
    alone wrote the outputs and the one MLflow run of each launch."""
    import stages.base
    import stages.prepare
    import stages.sft
    import stages.verifier

    root = in_project
    args, _, curve, metrics, output = CASES[name]
    write_params(root, case_params(name, 8, 1))
    stages.prepare.main()
    stages.base.main()
    if name != "sft":
        stages.sft.main()
    if name == "prm":
        stages.verifier.main()
        # The classifier head's dropout (0.1 by default) draws other masks when the batch is
        # split across processes: off here, so the comparison is of the data-parallel maths.
        config = root / "models/verifier/config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "classifier_dropout": 0.0}))
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    env.pop("RLHF_PARENT_RUN_ID", None)

    def launch() -> None:
        done = subprocess.run(
            [sys.executable, "-m", "stages.launch", *args], cwd=root, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    launch()
    one, one_weights = read_curve(root / curve), weights(root / output)
    assert json.loads((root / metrics).read_text())["processes"] == 1
    write_params(root, case_params(name, 4, 2, launcher))
    launch()
    two, two_weights = read_curve(root / curve), weights(root / output)
    assert json.loads((root / metrics).read_text())["processes"] == 2
    assert len(one) == len(two) == 8
    differences = [abs(a - b) for a, b in zip(one, two)]
    print(f"{name}: loss 1 process {one}\nloss 2 processes {two}\nmax |difference| {max(differences):.2e}")
    assert one[0] != one[-1], "the loss moved: the runs trained"
    assert max(differences) < TOLERANCE, (one, two)
    for key, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[key], tensor, atol=1e-4, rtol=1e-3, msg=key)
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string=f"tags.`rlhf.stage` = '{name}'"
    )
    assert len(runs) == 2, "one MLflow run per launch, from rank 0"
    assert not list((root / output).parent.glob(".*.tmp-*")), "the other rank left no temporary output"


def test_the_prm_loss_divides_by_the_labelled_positions_of_the_whole_step():
    """Alone it is the mean over labelled positions; given the step's count of them (every
    process and accumulation step), each process's share sums to that mean."""
    from rlhf.rewards.prm_classifier import IGNORE, labelled_token_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 2)
    labels = torch.tensor([[IGNORE, 1, IGNORE, 0, 1], [IGNORE, IGNORE, 0, IGNORE, IGNORE]])
    mask = labels != IGNORE
    mean = torch.nn.functional.cross_entropy(logits[mask], labels[mask])
    torch.testing.assert_close(labelled_token_loss({"logits": logits}, labels), mean)
    halves = [
        labelled_token_loss({"logits": logits[i : i + 1]}, labels[i : i + 1], num_items_in_batch=4) for i in (0, 1)
    ]
    torch.testing.assert_close(sum(halves), mean)
