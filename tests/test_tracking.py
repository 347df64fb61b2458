"""Tracking never stalls training: the training stages write their curves to MLflow
synchronously (no asynchronous queue for a run's end to wait on), several trainers back to
back against one sqlite store each end their run in a bounded time with every curve point
logged, a store that is locked holds a write up only until it is free, and a tracking
server that goes away mid-training costs the training nothing but a warning naming what
was not logged."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from rlhf.training.methods.sft import SFTParams
from tests.conftest import tiny_params

END_BOUND_S = 5.0


@pytest.fixture
def sft_inputs(tmp_path):
    from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model

    tokenizer = build_tokenizer()
    base = tmp_path / "base"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, base)
    data = tmp_path / "sft.parquet"
    pd.DataFrame(
        {"prompt": [f"{a}+{a}\n" for a in range(16)], "completion": [f"{2 * a}" for a in range(16)]}
    ).to_parquet(data)
    return base, data


def _params(steps: int = 3) -> SFTParams:
    return SFTParams(max_steps=steps, per_device_train_batch_size=4, logging_steps=1, save_steps=100, max_length=16)


def test_trainers_do_not_use_transformers_asynchronous_callback(tmp_path):
    from trl import SFTConfig

    from rlhf.training.trainer_setup import MLflowMetrics, tracking_callbacks, trl_config

    args = trl_config(SFTConfig, _params(), tmp_path)
    assert args.report_to == [] or args.report_to == "none"
    assert [type(c) for c in tracking_callbacks()] == [MLflowMetrics]


@pytest.mark.slow
def test_trainers_back_to_back_end_their_runs_quickly_and_log_every_point(
    sft_inputs, tmp_path, mlflow_store, monkeypatch
):
    """Four trainings, each in its stage run nested under an open parent run (as under the
    flow), against one sqlite store: every run end is under the bound, every logged step is
    in MLflow."""
    import mlflow

    from rlhf.tracking.runs import setup_experiment, stage_run
    from tests.conftest import train_sft

    waits = tmp_path / "waits.jsonl"
    monkeypatch.setenv("RLHF_TRACKING_WAITS", str(waits))
    base, data = sft_inputs
    setup_experiment()
    parent = mlflow.start_run(run_name="pipeline")
    monkeypatch.setenv("RLHF_PARENT_RUN_ID", parent.info.run_id)
    run_ids = []
    try:
        for i in range(4):
            with stage_run(f"sft-{i}", _params()) as run:
                train_sft(_params(), base, data, tmp_path / f"out{i}", tmp_path / "checkpoints", f"sft-{i}")
                run_ids.append(run.info.run_id)
            assert mlflow.active_run().info.run_id == parent.info.run_id, "the stage run ended, the parent did not"
    finally:
        mlflow.end_run()
    rows = [json.loads(line) for line in waits.read_text().splitlines()]
    ends = [r["seconds"] for r in rows if r["what"] == "end_run"]
    assert len(ends) == 4 and max(ends) < END_BOUND_S, ends
    client = mlflow.tracking.MlflowClient()
    for run_id in run_ids:
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
        assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow  # waits out a 2 s lock
def test_a_locked_store_holds_a_write_only_until_it_is_free(mlflow_store, tmp_path, monkeypatch):
    """Another connection holds the sqlite store's write lock for 2 s: the synchronous write
    waits for it, then lands (not lost, and not an error)."""
    import mlflow

    from rlhf.tracking.runs import log_metrics, setup_experiment

    setup_experiment()
    with mlflow.start_run() as run:
        lock = sqlite3.connect(mlflow_store.removeprefix("sqlite:///"), timeout=1, check_same_thread=False)
        lock.execute("BEGIN EXCLUSIVE")
        threading.Timer(2.0, lock.rollback).start()
        start = time.perf_counter()
        assert log_metrics({"loss": 0.5}, step=7)
        waited = time.perf_counter() - start
        lock.close()
    assert 1.5 < waited < 15, waited
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(7, 0.5)]


@pytest.mark.slow
def test_a_tracking_server_that_goes_away_costs_training_a_warning(sft_inputs, tmp_path, monkeypatch, caplog):
    """`mlflow server` on 127.0.0.1 is stopped after the first logged step: the training
    finishes and saves its model, and a warning names the metrics it could not log."""
    import mlflow

    from rlhf.tracking.runs import setup_experiment, stage_run
    from tests.conftest import train_sft

    server, uri = start_mlflow_server(tmp_path)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        monkeypatch.delenv("RLHF_ARTIFACT_ROOT", raising=False)
        monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
        base, data = sft_inputs
        setup_experiment("server-goes-away")
        from transformers import TrainerCallback

        class StopServer(TrainerCallback):
            def on_log(self, args, state, control, **kwargs):
                if state.global_step == 1:
                    server.terminate()
                    server.wait(timeout=30)

        import rlhf.training.trainer_setup as setup

        original = setup.tracking_callbacks
        monkeypatch.setattr(setup, "tracking_callbacks", lambda: [*original(), StopServer()])
        out = tmp_path / "out"
        start = time.perf_counter()
        # Closing the run on the stopped server fails too: a warning, not the stage's failure.
        with caplog.at_level("WARNING", logger="rlhf.tracking"):
            with stage_run("sft", _params(4)):
                train_sft(_params(4), base, data, out, tmp_path / "checkpoints", "sft")
        seconds = time.perf_counter() - start
    finally:
        server.kill()
        while mlflow.active_run():
            mlflow.end_run()
    assert (out / "model.safetensors").is_file(), "the trained model is saved"
    assert seconds < 120
    text = caplog.text
    assert "MLflow did not log" in text and "loss" in text and "the run's end" in text
    assert os.environ.get("MLFLOW_TRACKING_URI") == uri


def start_mlflow_server(tmp_path) -> tuple[subprocess.Popen, str]:
    from tests.servers import mlflow_server

    return mlflow_server(tmp_path / "server.db", cwd=tmp_path)


@pytest.mark.slow
def test_a_server_stopped_mid_stage_under_dvc_repro_costs_no_training(tmp_path):
    """`dvc repro sft` against a real `mlflow server`, stopped once sft has written its first
    checkpoint: the stage exits 0, publishes its model and metrics, removes its checkpoints
    only then, and says what MLflow did not record; a second `dvc repro` has nothing to do."""
    from tests.conftest import make_project, run, run_and_commit

    root = make_project(tmp_path / "project", tiny_params(sft={"max_steps": 40, "save_steps": 5, "logging_steps": 5}))
    run_and_commit(root, ["check_params", "prepare", "base"], f"sqlite:///{tmp_path / 'before.db'}")  # sft alone runs
    server, uri = start_mlflow_server(tmp_path)
    env = {
        "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
        "RLHF_ARTIFACT_ROOT": "", "MLFLOW_EXPERIMENT_NAME": "server-stops",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }  # fmt: skip
    env = {k: v for k, v in env.items() if v}
    try:
        repro = subprocess.Popen(
            [sys.executable, "-m", "dvc", "repro", "sft"], cwd=root, env={**os.environ, **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while not list((root / "checkpoints").glob("sft/*/checkpoint-*")):
            if repro.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"sft wrote no checkpoint:\n{repro.communicate()[0][-3000:]}")
            time.sleep(0.2)
        server.terminate()
        server.wait(timeout=30)
        output, _ = repro.communicate(timeout=600)
    finally:
        server.kill()
    assert repro.returncode == 0, output[-3000:]
    assert (root / "models/sft/model.safetensors").is_file()
    assert json.loads((root / "metrics/sft.json").read_text())["steps"] == 40
    assert not (root / "checkpoints/sft").exists(), "removed once the model was published"
    assert "MLflow did not record" in output and "the metrics and the loss curve" in output
    status = run([sys.executable, "-m", "dvc", "status", "sft"], root, env=env)
    assert "up to date" in status.stdout, "dvc.lock records the published stage: a rerun has nothing to do"


@pytest.mark.slow  # seconds (a DVC repo, stage processes or training): out of the quick tier
def test_tables_are_run_inputs_with_their_dvc_hash_and_models_carry_their_metrics(tmp_path, mlflow_store):
    """A prepared table is an MLflow dataset input whose digest is the file's md5 (DVC's
    hash); a candidate is a logged model (external: DVC keeps it) whose metrics are linked to
    it and to the suite's dataset."""
    import hashlib

    import mlflow

    from rlhf.tracking.runs import log_model_metrics, log_table, setup_experiment

    table = tmp_path / "dev.parquet"
    pd.DataFrame({"prompt": ["1+1\n", "2+2\n"], "answer": ["2", "4"]}).to_parquet(table)
    setup_experiment()
    with mlflow.start_run() as run:
        dataset = log_table(table, "evaluation")
        model_id = log_model_metrics("dpo", tmp_path / "models/policy/dpo", [({"dev.accuracy": 0.75}, dataset)])
    inputs = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [
        ("dev", hashlib.md5(table.read_bytes()).hexdigest())
    ]
    model = mlflow.get_logged_model(model_id)
    assert model.name == "dpo" and model.tags["path"].endswith("models/policy/dpo")
    [metric] = model.metrics
    assert (metric.key, metric.value, metric.dataset_name) == ("dev.accuracy", 0.75, "dev")


@pytest.mark.slow
def test_a_model_with_its_own_code_is_logged_and_loads_from_the_registry(tmp_path, mlflow_store, monkeypatch):
    """A candidate with custom modelling code (config.json's auto_map), which evaluate
    loads with trust_remote_code, is logged as the gate logs a champion when
    gate.trust_remote_code is set, and loads from the registry elsewhere as its own class."""
    import mlflow

    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.tracking.champion import log_registered_model
    from rlhf.tracking.runs import setup_experiment

    tokenizer = build_tokenizer()
    model_dir = tmp_path / "custom"
    build_tiny_model("micro", tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (model_dir / "configuration_mine.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MineConfig(LlamaConfig):\n    model_type = 'mine'\n"
    )
    (model_dir / "modeling_mine.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_mine import MineConfig\n\n\n"
        "class MineForCausalLM(LlamaForCausalLM):\n    config_class = MineConfig\n"
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "mine"
    config["auto_map"] = {
        "AutoConfig": "configuration_mine.MineConfig",
        "AutoModelForCausalLM": "modeling_mine.MineForCausalLM",
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    setup_experiment()
    with mlflow.start_run():
        with pytest.raises(ValueError, match="set gate.trust_remote_code: true"):
            log_registered_model(model_dir, "custom-policy", "model", {"candidate": "dpo"})
        version = log_registered_model(model_dir, "custom-policy", "model", {"candidate": "dpo"}, True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    pipe = mlflow.transformers.load_model(f"models:/custom-policy/{version}")
    assert type(pipe.model).__name__ == "MineForCausalLM"


@pytest.mark.slow
def test_a_champion_stored_in_bfloat16_is_registered_in_bfloat16(tmp_path, mlflow_store):
    """The registry keeps the dtype a model was stored in: a bfloat16 champion (model.save_dtype
    on a GPU) is not widened to float32 (twice its size) on its way to the registry, and it
    loads back with the same weights."""
    import mlflow
    import torch
    from safetensors import safe_open

    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.tracking.champion import log_registered_model
    from rlhf.tracking.runs import setup_experiment

    tokenizer = build_tokenizer()
    model_dir = tmp_path / "policy"
    model = build_tiny_model("micro", tokenizer, seed=0).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    setup_experiment()
    with mlflow.start_run():
        version = log_registered_model(model_dir, "bf16-policy", "model", {"candidate": "dpo"})
    logged = Path(mlflow.artifacts.download_artifacts(f"models:/bf16-policy/{version}"))
    [weights] = logged.rglob("*.safetensors")
    with safe_open(str(weights), "pt") as stored:
        dtypes = {stored.get_slice(name).get_dtype() for name in stored.keys()}
    assert dtypes == {"BF16"}, dtypes
    loaded = mlflow.transformers.load_model(f"models:/bf16-policy/{version}").model
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].to(torch.bfloat16), value), name


def test_a_tracking_uri_that_is_a_bare_path_names_the_uri_to_write(monkeypatch, tmp_path):
    """MLflow reads a bare path as its retired file store and fails deep in a stage; the
    project fails first, naming the variable and the sqlite URI of that file."""
    from rlhf.tracking.runs import TrackingURIError, tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlflow.db"))
    with pytest.raises(TrackingURIError, match=rf"set MLFLOW_TRACKING_URI=sqlite:///{tmp_path}/mlflow.db for"):
        tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_the_experiment_is_tagged_as_model_training_so_the_ui_opens_on_its_runs(mlflow_store):
    """MLflow 3's UI opens an experiment on the GenAI overview unless its kind says model
    training; an experiment made before the tag gets it, a kind the user chose stays."""
    import mlflow

    from rlhf.tracking.runs import KIND_TAG, setup_experiment

    experiment = mlflow.get_experiment(setup_experiment())
    assert experiment.tags[KIND_TAG] == "custom_model_development"
    older = mlflow.create_experiment("made-before")
    setup_experiment("made-before")
    assert mlflow.get_experiment(older).tags[KIND_TAG] == "custom_model_development"
    chosen = mlflow.create_experiment("chosen", tags={KIND_TAG: "genai_development"})
    setup_experiment("chosen")
    assert mlflow.get_experiment(chosen).tags[KIND_TAG] == "genai_development"


# Each process imports MLflow first, says it is ready, then waits for the go to open the store.
RACE = """
import os, sys, time
from pathlib import Path
import mlflow
from rlhf.tracking import runs
if os.environ.get("WITHOUT_LOCK"):
    import contextlib
    runs.first_contact = lambda uri: contextlib.nullcontext()
gate = Path(sys.argv[1])
(gate / f"ready-{os.getpid()}").touch()
while not (gate / "go").exists():
    time.sleep(0.005)
print(runs.setup_experiment())
"""


def run_together(store: Path, processes: int, env: dict) -> list[subprocess.CompletedProcess]:
    gate = store.parent / "gate"
    gate.mkdir()
    env = {**os.environ, **env, "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "PYTHONPATH": os.getcwd()}
    env.pop("MLFLOW_EXPERIMENT_NAME", None)
    started = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(gate)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(processes)
    ]
    deadline = time.monotonic() + 120
    while len(list(gate.glob("ready-*"))) < processes and time.monotonic() < deadline:
        if any(p.poll() is not None for p in started):
            break
        time.sleep(0.05)
    (gate / "go").touch()  # every process has imported MLflow: they open the store together
    return [subprocess.CompletedProcess(p.args, p.wait(), *p.communicate()) for p in started]


@pytest.mark.slow
def test_stages_that_start_together_on_a_new_store_all_set_it_up(tmp_path):
    """Queued `dvc exp run` experiments start their first stages at the same moment on the
    project's store, which does not exist yet: four processes opening one new sqlite store
    at once all get the one experiment (MLflow makes the tables and the experiment on
    first contact; unserialised, one of them failed with `duplicate column name: step`)."""
    done = run_together(tmp_path / "mlflow.db", 4, {})
    assert [d.returncode for d in done] == [0] * 4, [d.stderr[-2000:] for d in done if d.returncode]
    assert len({d.stdout.split()[-1] for d in done}) == 1, "one experiment, the same id for all"


def test_dvc_lock_is_read_again_when_it_changes(tmp_path):
    """dvc.lock is parsed once per version of the file (rlhf.lockfile): a stage asking again
    gets the same answers, and a lock rewritten by the next stage's run is read afresh."""
    from rlhf.lockfile import lock_stages, output_hash
    from rlhf.tracking.runs import lock_entry_hash

    lock = tmp_path / "dvc.lock"
    assert lock_stages(lock) is None and output_hash("models/rm", lock) is None
    entry = {"cmd": "python -m stages.rm", "outs": [{"path": "models/rm", "md5": "aaa.dir"}]}
    lock.write_text(json.dumps({"schema": "2.0", "stages": {"rm": entry}}))  # JSON is YAML
    assert output_hash("models/rm", lock) == "aaa.dir" and output_hash("models/sft", lock) is None
    first = lock_entry_hash("rm", lock)
    entry["outs"][0]["md5"] = "bbbb.dir"
    lock.write_text(json.dumps({"schema": "2.0", "stages": {"rm": entry}}))
    assert output_hash("models/rm", lock) == "bbbb.dir" and lock_entry_hash("rm", lock) != first
