"""MLflow tracking shared by the stages and the flow.

Embedded default: a sqlite store ``mlflow.db`` and an ``mlartifacts/`` folder in the project
root, so the UI and the model registry work without a server (``mlflow ui
--backend-store-uri sqlite:///mlflow.db``). ``MLFLOW_TRACKING_URI`` points elsewhere.

A stage run is nested under the pipeline's parent run when ``RLHF_PARENT_RUN_ID`` is set
(the Prefect flow sets it for every ``dvc repro`` it launches; nested runs started in
another process need the explicit ``parent_run_id``). Every run is tagged with the git
commit and its DVC stage address; the flow adds the hash of the stage's dvc.lock entry
once DVC has written it.

Tracking never holds up training for long, and never silently: every write is synchronous
(transformers' MLflow callback queues metrics on MLflow's asynchronous logging thread, and
a run's end then waits for that queue to drain, which was seen to stall training for
minutes against a busy sqlite store), so a write waits at most for the store's lock timeout
and a failed write is a warning that names what was not logged (`log_metrics`). Training
stages use `rlhf.training.trainer_setup.MLflowMetrics` instead of transformers' callback.
With RLHF_TRACKING_WAITS set to a file, each write's wait and each run's end are appended to
it as JSON lines (`record_wait`): the test suite reports the longest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from rlhf.atomic import file_md5
from rlhf.lockfile import lock_stages, output_hash
from rlhf.params import InputError

EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
DEFAULT_EXPERIMENT = "rlhf-pipeline"
PARENT_RUN_ENV = "RLHF_PARENT_RUN_ID"
STAGE_TAG = "rlhf.stage"
COMMIT_TAG = "mlflow.source.git.commit"
LOCK_HASH_TAG = "dvc.lock_hash"
WAITS_ENV = "RLHF_TRACKING_WAITS"

logger = logging.getLogger("rlhf.tracking")


def record_wait(what: str, seconds: float) -> None:
    """Append how long a tracking call held up its caller to the file RLHF_TRACKING_WAITS
    names (nothing when unset)."""
    path = os.environ.get(WAITS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps({"what": what, "seconds": round(seconds, 4), "pid": os.getpid()}) + "\n")


def log_table(path: str | Path, context: str, frame=None):
    """Log a prepared table as an input of the active run: an MLflow dataset named after
    the file, whose digest is the file's md5 (the hash DVC records for it), so MLflow's
    Dataset column says exactly which version trained or scored the run. Returns the
    dataset, or None (with a warning) when it could not be logged."""
    import pandas as pd
    from mlflow.data import from_pandas

    path = Path(path)
    try:
        with warnings.catch_warnings():
            # MLflow registers two sources of one name for local paths (schemes "" and
            # "file") and warns on every local file that it picked one: they are the same.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple")
            if frame is None and parquet_rows(path) > LOGGED_WHOLE_ROWS:
                dataset = described_table(path)
            else:
                table = frame if frame is not None else pd.read_parquet(path)
                dataset = from_pandas(table, source=path.as_posix(), name=path.stem, digest=file_md5(path))
        mlflow.log_input(dataset, context=context)
        return dataset
    except Exception as error:  # tracking must not fail a stage whose result is made
        logger.warning("MLflow did not log the input %s: %s", path, error)
        return None


# A table of more rows is logged by its schema and digest (MLflow's MetaDataset), not read
# whole into a frame for MLflow's profile: a stage's memory does not grow with its data.
LOGGED_WHOLE_ROWS = 100_000


def parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    with open(path, "rb") as file:
        return pq.ParquetFile(file).metadata.num_rows


def described_table(path: Path):
    """An MLflow dataset of a large Parquet table: its source, name, the file's md5 and the
    schema read from its first rows (no profile: that would read every row)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types.utils import _infer_schema

    from rlhf.data.prepared import prepared_batches

    sample = next(prepared_batches(path, batch_rows=100))
    source = resolve_dataset_source(path.as_posix())
    return MetaDataset(source, name=path.stem, digest=file_md5(path), schema=_infer_schema(sample))


def log_model_metrics(name: str, path: str | Path, scored: list[tuple[Mapping[str, float], Any]]) -> str | None:
    """An MLflow logged model for a model DVC keeps (`create_external_model`: no weights are
    copied; its tags say where it is and its DVC hash), with each (metrics, dataset) of
    `scored` linked to it and to that dataset, so MLflow's Models column and model pages
    show what each candidate scored on what. Returns the model id, or None (with a
    warning) when the store refused."""
    active = mlflow.active_run()
    try:
        tags = {"path": Path(path).as_posix(), "dvc.md5": str(output_hash(path))}
        model = mlflow.create_external_model(
            name=name, source_run_id=active.info.run_id if active else None, tags=tags, model_type="causal-lm"
        )
        for metrics, dataset in scored:
            mlflow.log_metrics(dict(metrics), model_id=model.model_id, dataset=dataset, synchronous=True)
        return model.model_id
    except Exception as error:  # tracking must not fail a stage whose result is made
        logger.warning("MLflow did not log model %s (%s): %s", name, path, error)
        return None


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> bool:
    """Log to the active run synchronously; on failure warn with the metric names and the
    step, and return False instead of raising (a tracking store that is away or locked
    must not lose the training result)."""
    start = time.perf_counter()
    try:
        mlflow.log_metrics(dict(metrics), step=step, synchronous=True)
        return True
    except Exception as error:  # any store error: the training goes on, the loss is said
        where = f" at step {step}" if step is not None else ""
        logger.warning("MLflow did not log %s%s: %s", ", ".join(sorted(metrics)), where, error)
        return False
    finally:
        record_wait("log_metrics", time.perf_counter() - start)


def project_root() -> Path:
    return Path(os.environ.get("DVC_ROOT", os.getcwd())).resolve()


class TrackingURIError(InputError, ValueError):
    """MLFLOW_TRACKING_URI is a bare path, which MLflow reads as its retired file store."""


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else the project's sqlite store. A bare path (no scheme) fails
    naming the variable and the URI to write instead."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{project_root() / 'mlflow.db'}"
    if "://" not in uri and not uri.startswith("databricks"):
        path = Path(uri).expanduser().resolve()
        store = path if path.suffix == ".db" else path / "mlflow.db"
        raise TrackingURIError(
            f"MLFLOW_TRACKING_URI={uri}: a path, not a URI (MLflow reads a path as its retired file store); set "
            f"MLFLOW_TRACKING_URI=sqlite:///{store} for a database file, or http://<host>:<port> for a tracking server"
        )
    return uri


# MLflow 3's UI opens an experiment by its kind: model training opens on its runs (the
# pipeline's stages), not on the GenAI overview of traces, which this project has none of.
KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"


def experiment_name() -> str:
    """The experiment runs go to: MLFLOW_EXPERIMENT_NAME, else the project's default."""
    return os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT


@contextmanager
def first_contact(uri: str) -> Iterator[None]:
    """Processes that open a local sqlite store one at a time. MLflow makes a new store's
    tables (and their migrations) on the first connection, and the experiment when it is
    missing: two stages that start together on a new store (queued `dvc exp run`
    experiments, the flow's parallel lanes) would both try, and one fail (`duplicate column
    name`, `RESOURCE_ALREADY_EXISTS`). An advisory lock in the temporary folder, named
    after the database's path: nothing is added to the project, and the kernel drops it
    when its holder dies. A server serialises its clients itself."""
    import fcntl
    import tempfile

    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri[len("sqlite:///") :].split("?")[0]).expanduser().resolve()
    digest = hashlib.sha256(str(database).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"rlhf-mlflow-{digest}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def setup_experiment(name: str | None = None) -> str:
    """Point MLflow at the project's store and return the experiment id, creating the
    experiment with an explicit artifact location for a local store (the project's
    mlartifacts/, so artifacts never land in the cwd); a tracking server keeps artifacts
    where it is configured to (`mlflow server --artifacts-destination`), unless
    RLHF_ARTIFACT_ROOT names a location."""
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    name = name or experiment_name()
    with first_contact(uri):
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is None:
            artifacts = os.environ.get("RLHF_ARTIFACT_ROOT")
            if artifacts is None and not uri.startswith(("http://", "https://", "databricks")):
                artifacts = (project_root() / "mlartifacts").as_uri()
            tags = {KIND_TAG: MODEL_TRAINING}
            experiment_id = mlflow.create_experiment(name, artifact_location=artifacts, tags=tags)
        else:
            experiment_id = experiment.experiment_id
            if KIND_TAG not in experiment.tags:  # one made before the tag, or by hand: a kind the user set stays
                mlflow.MlflowClient().set_experiment_tag(experiment_id, KIND_TAG, MODEL_TRAINING)
    mlflow.set_experiment(experiment_id=experiment_id)
    # transformers' MLflowCallback reads the experiment from the environment.
    os.environ[EXPERIMENT_ENV] = name
    return experiment_id


def git_commit(root: Path | None = None) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root or project_root(), capture_output=True, text=True, check=True
        )
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root or project_root(),
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        key.replace("@", "_"): float(value)
        for key, value in flatten(metrics).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


@contextmanager
def stage_run(stage: str, config: Any, tags: Mapping[str, str] | None = None) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run for one stage: resolved config logged as params, tags set, nested under
    the pipeline run when there is one. Exceptions propagate (the run ends FAILED). Under a
    multi-process launch only rank 0 opens the run; the other ranks get None."""
    if os.environ.get("RANK", "0") != "0":
        yield None
        return
    setup_experiment()
    parent = os.environ.get(PARENT_RUN_ENV) or None
    address = os.environ.get("DVC_STAGE", stage)
    run_tags = {STAGE_TAG: address, COMMIT_TAG: git_commit(), **(tags or {})}
    run = mlflow.start_run(run_name=address, parent_run_id=parent, nested=parent is not None, tags=run_tags)
    with ending(run):
        params = flatten(config.model_dump(mode="json")) if hasattr(config, "model_dump") else flatten(config)
        mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})
        yield run


# What this process could not log after its work was done (`tracked`), said at the end.
NOT_LOGGED: list[str] = []


@contextmanager
def tracked(what: str) -> Iterator[None]:
    """Tracking calls made after a stage's work is done (its outputs published): a failure
    (a tracking server gone away, a locked store) is a warning naming `what`, never the
    stage's failure: the training is not lost to it, and the rerun finds the outputs."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - whatever the tracking client raises
        NOT_LOGGED.append(what)
        logger.warning("MLflow did not log %s: %s", what, str(error).splitlines()[0] if str(error) else error)


@contextmanager
def ending(run: mlflow.ActiveRun) -> Iterator[mlflow.ActiveRun]:
    """End the started `run` after the block: FAILED on an exception (which propagates),
    else FINISHED, with the time the end took recorded (`record_wait`). Ending the run is
    tracked: a store gone away warns. What was not logged is said last."""
    try:
        yield run
    except BaseException:
        with tracked("the run's FAILED status"):
            mlflow.end_run("FAILED")
        raise
    start = time.perf_counter()
    with tracked("the run's end"):
        mlflow.end_run()
    record_wait("end_run", time.perf_counter() - start)
    if NOT_LOGGED:
        print(
            f"tracking: the stage's outputs are published; MLflow did not record {', '.join(NOT_LOGGED)} "
            "(the tracking store was not reachable): `dvc metrics show` has the numbers",
            file=sys.stderr,
        )


def lock_entry_hash(stage_address: str, lock_path: str | Path = "dvc.lock") -> str | None:
    """md5 of the stage's entry in dvc.lock (cmd, deps, params and outs hashes): the
    fingerprint of the exact code, data and params that produced a number."""
    entry = (lock_stages(lock_path) or {}).get(stage_address)
    if entry is None:
        return None
    return hashlib.md5(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def tag_stage_runs_with_lock(parent_run_id: str, lock_path: str | Path = "dvc.lock") -> dict[str, str]:
    """Tag each nested stage run of `parent_run_id` that finished with its dvc.lock entry
    hash (a failed stage's entry is still the previous run's)."""
    client = MlflowClient(tracking_uri())
    runs = client.search_runs(
        experiment_ids=[client.get_run(parent_run_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
    )
    tagged = {}
    for run in runs:
        if run.info.status != "FINISHED":
            continue
        address = run.data.tags.get(STAGE_TAG)
        digest = lock_entry_hash(address, lock_path) if address else None
        if digest:
            client.set_tag(run.info.run_id, LOCK_HASH_TAG, digest)
            tagged[address] = digest
    return tagged


@contextmanager
def nested_run(name: str) -> Iterator[mlflow.ActiveRun]:
    """A run nested in the active one; a trainer inside logs its curves there.

    The run's end is timed like a stage run's (`record_wait`). Under a multi-process launch
    only rank 0 opens it; the other ranks get None."""
    if os.environ.get("RANK", "0") != "0":
        yield None
        return
    with ending(mlflow.start_run(run_name=name, nested=True)) as run:
        yield run
