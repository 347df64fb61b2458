"""Training stages under several processes (rlhf/cli/launch.py): the launch command params
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

from rlhf.cli.launch import command
from tests.conftest import call_main, tiny_params, write_params

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
    # Without accelerate_config, the project's plain DDP config: accelerate alone would read
    # the user's default config, or start one process on a machine without a GPU.
    assert command("stages.sft", [], compute(launcher="accelerate", processes=2))[3:7] == [
        "--config_file", "configs/accelerate/ddp.yaml", "--num_processes", "2",
    ]  # fmt: skip
    # PPO (our own loop) is data-parallel too; a stage that does not train starts as one process.
    assert command("stages.policy", ["ppo"], compute(launcher="torchrun", processes=2))[2] == "torch.distributed.run"
    assert command("stages.evaluate", [], compute(launcher="torchrun", processes=2)) == [
        sys.executable, "-m", "stages.evaluate",
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


def read_curve(path: Path, column: str = "loss") -> list[float]:
    with open(path) as handle:
        return [float(row[column]) for row in csv.DictReader(handle)]


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
    "rm": (["stages.rm"], "rm", "plots/rm/member_0.csv", "metrics/rm.json", "models/rm"),
    "prm": (["stages.prm"], "prm", "plots/prm/loss.csv", "metrics/prm.json", "models/prm"),
    **{
        f"{'policy' if m == 'dpo' else 'rl'}@{m}": (
            ["stages.policy" if m == "dpo" else "stages.rl", m], "policy", f"plots/policy/{m}/loss.csv",
            f"metrics/policy/{m}.json", f"models/policy/{m}",
        )
        for m in ("dpo", "grpo", "ppo")
    },
}  # fmt: skip
# Online methods sample with keyed_sampling, so that 1 and 2 processes draw the same
# completions, and a reward that varies on the micro model's text (its answers never match).
ONLINE_REWARDS = [{"name": "format", "pattern": ".*[0-9].*"}, {"name": "length", "max_chars": 10, "weight": 0.5}]


def case_params(name: str, per_device: int, processes: int, launcher: str = "torchrun") -> dict:
    steps = {"max_steps": 8, "save_steps": 100, "logging_steps": 1, "per_device_train_batch_size": per_device}
    if name == "sft":
        params = tiny_params(sft={**steps, "learning_rate": 1e-3})
    elif name == "prm":  # the classifier kind trains (the likelihood kind fits a calibration)
        params = tiny_params(prm={**steps, "kind": "classifier", "learning_rate": 1e-3})
    elif name == "rm":
        params = tiny_params(rm={**steps, "learning_rate": 1e-3})
    elif name == "rl@grpo":
        grpo = {
            **steps, "learning_rate": 1e-3, "num_generations": 4, "max_completion_length": 12, "temperature": 1.0,
            "keyed_sampling": True, "rewards": ONLINE_REWARDS,
        }  # fmt: skip
        params = tiny_params(policy={"offline": [], "online": ["grpo"], "grpo": grpo})
    elif name == "rl@ppo":
        # 8 prompts per iteration (4 per process) in mini-batches of 2: in most iterations
        # both rows of some mini-batch are on one process and the other holds none.
        ppo = {
            "max_steps": 8, "save_steps": 100, "logging_steps": 1, "rollout_batch_size": 8, "mini_batch_size": 2,
            "max_new_tokens": 12, "temperature": 1.0, "learning_rate": 1e-3, "keyed_sampling": True,
            "rewards": ONLINE_REWARDS,
        }  # fmt: skip
        params = tiny_params(policy={"offline": [], "online": ["ppo"], "ppo": ppo})
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
    [  # sft through accelerate's launcher, the other stages through torchrun: each launcher, each stage
        ("sft", "accelerate"),
        ("rm", "torchrun"),
        ("policy@dpo", "torchrun"),
        ("rl@grpo", "torchrun"),
        ("rl@ppo", "torchrun"),
    ],  # fmt: skip
)
def test_two_gloo_processes_train_as_one_process_on_the_same_global_batch(in_project, name, launcher):
    """One process with 8 rows per step (this one: `rlhf.cli.launch` with one process only
    runs the module, and a new process would only add its imports), then `python -m
    rlhf.cli.launch ...` starting `torchrun` (or `accelerate launch` with
    configs/accelerate/ddp.yaml) with 2 processes of 4 rows each. The loss curves agree
    step by step within TOLERANCE and so do the weights; rank 0 alone wrote the outputs and
    the one MLflow run of each launch."""
    import stages.base
    import stages.prepare
    import stages.sft
    import stages.verifier

    root = in_project
    args, _, curve, metrics, output = CASES[name]
    online = name in ("rl@grpo", "rl@ppo")
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
            [sys.executable, "-m", "rlhf.cli.launch", *args], cwd=root, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # An online method's loss is 0 whenever a group's completions have one length (its
    # advantages sum to 0): its reward curve (GRPO's reward, PPO's score) is compared too.
    reward = {"rl@grpo": "reward", "rl@ppo": "score"}.get(name)
    curves = [(curve, "loss")] + ([(curve.replace("loss.csv", "reward.csv"), reward)] if reward else [])

    def read() -> tuple[list[list[float]], dict]:
        return [read_curve(root / file, column) for file, column in curves], weights(root / output)

    call_main(args)
    one, one_weights = read()
    assert json.loads((root / metrics).read_text())["processes"] == 1
    write_params(root, case_params(name, 4, 2, launcher))
    launch()
    two, two_weights = read()
    assert json.loads((root / metrics).read_text())["processes"] == 2
    for (file, column), a, b in zip(curves, one, two):
        assert len(a) == len(b) == 8, file
        differences = [abs(x - y) for x, y in zip(a, b)]
        print(f"{name} {column}: 1 process {a}\n2 processes {b}\nmax |difference| {max(differences):.2e}")
        assert max(differences) < TOLERANCE, (column, a, b)
        assert len(set(a)) > 1, f"the {column} moved: the runs trained"
    if online:  # the weights moved away from SFT's
        start = weights(root / "models/sft")
        assert any(not torch.allclose(start[k], v) for k, v in one_weights.items() if k in start)
    for key, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[key], tensor, atol=1e-4, rtol=1e-3, msg=key)
    from stages.policy import stage_name

    tag = stage_name(args[1]) if args[0] in ("stages.policy", "stages.rl") else name
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string=f"tags.`rlhf.stage` = '{tag}'"
    )
    assert len(runs) == 2, "one MLflow run per launch, from rank 0"
    assert not list((root / output).parent.glob(".*.tmp-*")), "the other rank left no temporary output"


def test_the_prm_loss_divides_by_the_labelled_positions_of_the_whole_step():
    """Alone it is the mean over labelled positions; given the step's count of them (every
    process and accumulation step), each process's share sums to that mean."""
    from rlhf.rewards.prm_classifier import IGNORE
    from rlhf.training.prm_trainer import labelled_token_loss

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


def test_keyed_sampling_draws_from_the_tempered_softmax():
    """Over 8,000 rows the keyed draws of one logits vector have the frequencies of
    softmax(z / T), within 4 standard errors."""
    from rlhf.models.generation import KeyedSampling

    logits, temperature, rows = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]), 0.7, 8000
    counts = torch.zeros(5)
    for row in range(rows):
        out = KeyedSampling(seed=3, step=0, first_row=row, temperature=temperature)(torch.zeros(1, 4), logits)
        assert int((out == 0).sum()) == 1 and torch.isinf(out).sum() == 4, "one token kept, the rest -inf"
        counts += (out[0] == 0).float()
    expected = (logits[0] / temperature).softmax(-1)
    error = 4 * (expected * (1 - expected) / rows).sqrt()
    assert ((counts / rows - expected).abs() <= error).all(), (counts / rows, expected)


def test_keyed_generation_is_the_same_however_the_batch_is_split(micro_dir):
    """The micro model samples 8 completions (4 prompts of different lengths, twice each) as
    one batch of 8 and as two processes' batches of 4 (rows 0-3 and 4-7, other left
    padding): the completions are the same. Repeated prompts get different completions
    (it samples), and another step draws others."""
    from rlhf.models.generation import keyed_generate
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    tokenizer, model = load_tokenizer(micro_dir), load_causal_lm(micro_dir)
    tokenizer.padding_side = "left"
    prompts = ["1+2=", "12+34+5=", "7=", "100+200+300+4="] * 2
    step = {"value": 0}

    def sample(texts: list[str], first: int) -> list[str]:
        keyed_generate(model, seed=0, step=lambda: step["value"], first_row=lambda rows: first, temperature=1.0)
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**batch, do_sample=True, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)

    whole = sample(prompts, 0)
    assert sample(prompts[:4], 0) + sample(prompts[4:], 4) == whole
    assert whole[:4] != whole[4:], "the same prompt in another row draws another completion"
    step["value"] = 1
    assert sample(prompts, 0) != whole, "another step draws other completions"


def test_the_shipped_accelerate_configs_load_and_the_sharded_ones_gather_for_the_save(tmp_path):
    """Every file in configs/accelerate/ loads as accelerate's own config (an unknown or
    misspelt key fails), and the sharding ones (GPU only, not run here) keep what the
    end-of-stage gather needs: FSDP's full state dict, ZeRO-3's 16-bit consolidation."""
    from accelerate.commands.config.config_args import load_config_from_file

    from tests.conftest import REPO

    loaded = {f.name: load_config_from_file(str(f)) for f in sorted((REPO / "configs/accelerate").glob("*.yaml"))}
    assert {"ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "fsdp.yaml"} <= set(loaded)
    assert loaded["fsdp.yaml"].fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert loaded["deepspeed_zero3.yaml"].deepspeed_config["zero3_save_16bit_model"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs/accelerate/ddp.yaml").read_text() + "num_procesess: 2\n")
    with pytest.raises(ValueError, match="num_procesess"):
        load_config_from_file(str(bad))


@pytest.mark.slow
def test_fsdp2_on_two_gloo_processes_shards_the_weights_and_saves_what_one_process_trains(micro_dir, tmp_path):
    """accelerate launches FSDP on a CPU as plain data parallelism (docs/guides/real-models.md),
    so benchmarks/fsdp_cpu.py runs torch's FSDP2 directly, as accelerate's plugin would: each
    rank holds half of the parameters; the gathered save writes one model, tied embeddings
    once, equal to one process's after the same two steps on the whole batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fsdp_cpu

    from rlhf.models.loading import load_causal_lm

    ranks = fsdp_cpu.sharded(micro_dir, tmp_path / "sharded")
    assert all(0.45 < ranks[rank]["share"] < 0.55 for rank in (0, 1)), ranks
    fsdp_cpu.one_process(micro_dir, tmp_path / "one")
    names, difference = fsdp_cpu.largest_difference(tmp_path / "sharded", tmp_path / "one")
    assert "lm_head.weight" not in names  # tied to the input embedding: stored once
    assert difference < 1e-5
    _, moved = fsdp_cpu.largest_difference(tmp_path / "sharded", micro_dir)
    assert moved > 1e-3  # two steps changed the weights
    config = json.loads((tmp_path / "sharded/config.json").read_text())
    assert config["architectures"] == [type(load_causal_lm(tmp_path / "sharded")).__name__]
