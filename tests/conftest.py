"""Shared fixtures: a tiny copy of the project (real git + DVC repo, tiny params) and a
temporary MLflow sqlite store.

The tiny params keep the real stages and trainers but shrink the model (`builtin:micro`),
the data and the step counts so that a whole pipeline runs in about two minutes on 2 cores.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

import rlhf  # noqa: F401  (no-telemetry environment for every test)

# The test suite never needs the network: the Hub is off for it (and for the `dvc repro`
# subprocesses it starts), as a user without one would set it. The project itself leaves
# the Hub on (rlhf.environment); tests of Hub ids check the offline error.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
PROJECT_FILES = [
    "rlhf", "stages", "flows", "configs", "dvc.yaml", "params.yaml", ".dvcignore", ".gitignore", "data/raw",
]  # fmt: skip

TINY_OVERRIDES = {
    "prepare": {
        "builtin": {
            "sizes": {
                "sft": 400,
                "prefs": 64,
                "prefs_eval": 24,
                "unpaired": 32,
                "prm": 32,
                "prm_eval": 16,
                "prompts": 32,
                "eval_dev": 24,
                "eval_test": 24,
            }
        }
    },
    "base": {"model": "builtin:micro"},
    "sft": {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8},
    "verifier": {"max_steps": 2, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8},
    "rm": {"max_steps": 2, "num_members": 2, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8},
    "policy": {
        "offline": ["dpo"],
        "dpo": {"max_steps": 2, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8},
    },
    "evaluate": {"kl_prompts": 8, "max_new_tokens": 24, "samples": 2},
    "infer": {
        "limit": 4,
        "max_new_tokens": 16,
        "best_of_n": {"n": 2},
        "self_consistency": {"max_samples": 4, "round_size": 2},
        "mcts": {"simulations": 2, "expand": 2, "max_depth": 2},
    },
    # The micro model writes gibberish: test the plumbing, not the quality bar.
    "validate": {
        "max_nll_increase": 100.0,
        "max_repetition_increase": 1.0,
        "max_degenerate_increase": 1.0,
        "max_length_ratio": 100.0,
        "min_diversity_ratio": 0.0,
    },
    "gate": {
        "tests": [
            {"metric": "accuracy", "relative_to": "sft", "op": ">=", "threshold": -1.0},
            {"metric": "kl_to_ref", "relative_to": "absolute", "op": "<=", "threshold": 1000.0},
        ]
    },
}


def deep_update(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "sizes":
            deep_update(base[key], value)
        else:
            base[key] = value
    return base


def tiny_params(**overrides) -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    deep_update(params, TINY_OVERRIDES)
    return deep_update(params, overrides)


def fit_texts(model, tokenizer, texts, steps: int, lr: float, optimizer: str = "Adam", stop_below=None) -> float:
    """Train `model` full-batch on `texts` (padding left out of the loss) for `steps` steps
    of torch.optim.<optimizer>, or until its loss is below `stop_below`; leaves it in eval
    mode and returns the last loss. What the tests that need a model with a known answer
    train it with."""
    import torch

    batch = tokenizer(list(texts), return_tensors="pt", add_special_tokens=False, padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    step = getattr(torch.optim, optimizer)(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        if stop_below is not None and loss.item() < stop_below:
            break
        step.zero_grad()
        loss.backward()
        step.step()
    model.eval()
    return loss.item()


def train_sft(params, start: Path, data: Path, out: Path, checkpoints: Path, stage: str = "sft", ewc=None,
              key: str | None = None):  # fmt: skip
    """SFT as a stage runs it (rlhf.training.methods.sft.train with the job a stage
    describes): `ewc` = (EwcParams, the earlier table) as a round's; `key` the block's
    params key (default: `stage`)."""
    from rlhf.training.methods import sft
    from rlhf.training.trl_training import TrainingJob

    job = TrainingJob(
        stage=stage, key=key or stage, start=start, data=data, checkpoints=checkpoints,
        trust_remote_code=params.trust_remote_code, ewc=ewc[0] if ewc else None, sft_data=ewc[1] if ewc else None,
    )  # fmt: skip
    return sft.train(job, params, out)


def write_params(root: Path, params: dict) -> None:
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def params_problems(tmp_path: Path, data: dict) -> list[str]:
    """The problems check_params finds in the params `data` (written to tmp_path); it must find some."""
    from rlhf.params import ParamsError
    from stages import load_all

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError) as error:
        load_all(str(path))
    return error.value.problems


def assert_each_once(found: list[str], expected: list[str]) -> None:
    """Each expected message begins exactly one of the problems found."""
    for line in expected:
        assert sum(p.startswith(line) for p in found) == 1, (line, found)


def run(cmd: list[str], cwd: Path, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def call_main(command: list[str]) -> None:
    """`python -m module args` in this process: the module's main, with the args (a stage
    that takes none has a main without them)."""
    import importlib

    module, *argv = command
    main = importlib.import_module(module).main
    main(argv) if argv else main()


def run_and_commit(root: Path, names: list[str], tracking_uri: str | None = None) -> None:
    """The stages `names` (in order, each by its main in this process: a stage process would
    add ~10 s of imports), then `dvc commit -f` of them: DVC records their deps and outs as
    `dvc repro` would have, so a later `dvc repro` runs only the stages after them."""
    with pytest.MonkeyPatch.context() as mp:
        run_stages_in(mp, root, tracking_uri)
        for name in names:
            module, _, key = name.partition("@")
            call_main([f"stages.{module}", key] if key else [f"stages.{module}"])
    commit_stages(root, names)


def commit_stages(root: Path, names: list[str]) -> None:
    """`dvc commit -f` of stages whose outputs were made outside DVC (a test's process)."""
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    run([sys.executable, "-m", "dvc", "commit", "-f", *names], root, env=env)


def serve_app(app):
    """`app` served by uvicorn on a free port of 127.0.0.1 in a thread: (server, thread, its
    address). Stop it with `server.should_exit = True` and `thread.join()`."""
    import threading
    import time

    import uvicorn

    from tests.servers import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def project_cache_type() -> str:
    """`cache.type` of the project's own .dvc/config."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / ".dvc/config")
    return config.get("cache", "type").strip('"')


def make_project(root: Path, params: dict | None = None) -> Path:
    """A fresh git + DVC repository holding the project's code and tiny params."""
    root.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    write_params(root, params or tiny_params())
    run(["git", "init", "-q"], root)
    run(["git", "config", "user.email", "test@example.com"], root)
    run(["git", "config", "user.name", "test"], root)
    run([sys.executable, "-m", "dvc", "init", "-q"], root)
    # The project's own .dvc/config (no analytics; its cache type: links, one copy of each
    # model on disk), as a clone of the project has it.
    shutil.copy2(REPO / ".dvc/config", root / ".dvc/config")
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "tiny project"], root)
    return root


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A temporary MLflow sqlite store (and artifact root) for one test."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("RLHF_ARTIFACT_ROOT", (tmp_path / "mlartifacts").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"test-{tmp_path.name}")
    return uri


@pytest.fixture
def micro_dir(tmp_path):
    """models/sft in tmp_path: the untrained micro model and the built-in tokenizer."""
    from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model

    tokenizer = build_tokenizer()
    path = tmp_path / "models/sft"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, path)
    return path


def run_stages_in(mp: pytest.MonkeyPatch, root: Path, tracking_uri: str | None = None) -> None:
    """Make this process a place to call stages' mains in the project `root`: cwd there
    (stages read params.yaml and write outputs relative to it), no parent run or DVC stage
    inherited, MLflow at `tracking_uri` when given."""
    mp.chdir(root)
    if tracking_uri is not None:
        mp.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    for name in ("RLHF_PARENT_RUN_ID", "DVC_STAGE", "DVC_ROOT"):
        mp.delenv(name, raising=False)


@pytest.fixture
def in_project(tmp_path, monkeypatch, mlflow_store):
    """cwd = a fresh tiny project, ready for stages' mains (run_stages_in)."""
    root = make_project(tmp_path / "project")
    run_stages_in(monkeypatch, root)
    return root


@pytest.fixture(autouse=True)
def tracking_environment_restored():
    """setup_experiment exports MLFLOW_EXPERIMENT_NAME (transformers' callback reads it);
    a test's own experiment must not leak into the next test's flows and servers."""
    names = ("MLFLOW_EXPERIMENT_NAME", "RLHF_PARENT_RUN_ID")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_dangling_mlflow_run():
    """A test that leaves an MLflow run active in this process (a failed stage run, a test's
    own run) would nest the next stage's run under it; end it after each test so the next
    stage's `start_run` starts clean, as it does in its own process under DVC."""
    yield
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()


# The modules that take minutes, longest first by `--durations` on 2 cores (the rest take
# well under one).
LONGEST_MODULES = [
    "test_pipeline_e2e", "test_own_data", "test_faults", "test_distributed", "test_improve", "test_flow_graph",
    "test_tracking",
]  # fmt: skip


def pytest_collection_modifyitems(items):
    """Longest modules first, then those with other slow tests, then the quick ones; each
    module's tests together and in file order. scripts/test.sh gives each of its pytest
    workers a whole module (`--dist loadfile`: a module's shared fixtures, such as the
    end-to-end module's pipeline run, are built once) and the next one when it is free, in
    this order (`--no-loadscope-reorder`), so a long module started last cannot keep one
    worker busy while the other idles."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, int]:
        if item.path.stem in LONGEST_MODULES:
            return (0, LONGEST_MODULES.index(item.path.stem))
        return (1, 0 if item.path in slow else 1)

    items.sort(key=rank)


# ----------------------------------------------------------------------------- garbage collector
# As a stage's process does (rlhf.models.compute.freeze_startup_objects): what the test
# modules import (torch, transformers, TRL, MLflow: most of a million objects) lives as long
# as the worker, and each full collection walks all of it again. Collecting the quick tier
# spent 5.7 s of its 20 in the collector (gc.callbacks, one process). So the collector is
# off while the modules are imported, and at the end of collection one full collection
# frees what collecting left and gc.freeze() takes the rest out of its sight; the tests'
# own objects (models, trainers) are collected as usual.
gc.disable()


def pytest_collection_finish(session):
    from rlhf.models.compute import freeze_startup_objects

    gc.collect()
    freeze_startup_objects()
    gc.enable()


# ----------------------------------------------------------------------------- tracking waits
# Every MLflow write and run end of the session (this process and the stages it starts) is
# timed into one file (rlhf.tracking.runs.record_wait); the summary reports the longest.
_WAITS = Path(os.environ.setdefault("RLHF_TRACKING_WAITS", str(Path(tempfile.mkdtemp()) / "tracking-waits.jsonl")))


def pytest_terminal_summary(terminalreporter):
    import json

    if not _WAITS.is_file():
        return
    rows = [json.loads(line) for line in _WAITS.read_text().splitlines() if line.strip()]
    for what, label in (("end_run", "end-of-run wait"), ("log_metrics", "metrics write")):
        times = [row["seconds"] for row in rows if row["what"] == what]
        if times:
            terminalreporter.write_line(
                f"MLflow: longest {label} {max(times):.2f} s over {len(times)} ({what}, rlhf.tracking.runs)"
            )
