"""The dvc.yaml DAG as a Prefect flow: one task per DVC stage, each run through DVC.

    python -m flows.pipeline                  # run once (ephemeral Prefect, no server needed)
    python -m flows.pipeline --force sft      # rerun sft (and what is stale after it)
    python -m flows.pipeline --retries 2      # retry a failed stage (e.g. a preempted worker)
    python -m flows.pipeline --jobs 1         # one stage at a time (default: 2 without a GPU)
    python -m flows.pipeline --pull --push    # fetch results from the DVC remote first, share them after
    python -m flows.pipeline --deploy --pool rlhf --cron "0 3 * * *"   # a scheduled deployment
    prefect worker start --pool rlhf                      #   that a worker runs (both need a server:
                                                          #   prefect server start --host 127.0.0.1)
    python -m flows.pipeline --serve --cron "0 3 * * *"   # or: this process serves the schedule

The DAG comes from DVC itself (`Repo.index.graph`), so dvc.yaml stays the single source
of truth. Each task runs `dvc repro --single-item <stage>` in topological order: DVC alone
decides whether the stage is stale, runs it, restores it from the run-cache, or skips it,
and the task reports which. Each task waits for the tasks of the stages it depends on
(`wait_for`), so Prefect's run graph draws the DVC DAG, and a stage downstream of a failed
one is not run (Prefect marks it NotReady) while the rest go on; the flow then fails,
naming them.

`--jobs N` runs up to N stages at once whose inputs are ready (DVC releases its repository
lock while a stage's command runs and locks only the stage's own deps and outs; the flow
passes `--wait-for-lock` for the moments it holds it). The machine's cores are split among
the stages that can run: a stage that starts while others can run gets `OMP_NUM_THREADS`
= cores / min(N, stages that can run), a stage that runs alone keeps torch's default of
all of them (an OMP_NUM_THREADS already set is left as it is).
The default is 2 on a machine with no GPU, at least 2 cores and 4 GiB of memory available,
and 1 with a GPU, where two stages would share one device's memory, when `compute.processes`
> 1, or when memory is short (two training stages hold about twice the memory of one). On
the default pipeline's 2 cores, two one-thread stages finish sooner than the same two one
after the other with two threads each (benchmarks/README.md).

`--deploy` registers the flow as a deployment (`rlhf-pipeline/scheduled`) of this
checkout on a process work pool (created if missing) with a cron schedule and a
concurrency limit of one: a worker on the machine that holds the checkout runs each
scheduled or triggered run in a subprocess, and runs that come due while one is running
wait (the workspace lock below also stops a second flow started by hand).

With a DVC remote (`dvc remote add -d <name> <url>`), `--pull` first runs `dvc pull
--run-cache` (outputs of dvc.lock and the run-cache: a stage whose inputs someone already
ran is restored, not retrained) and `--push` ends with `dvc push --run-cache`.

Prefect adds retries, logs, the UI and schedules; MLflow gets one parent run per flow run
with one nested run per stage that ran (the stages read `RLHF_PARENT_RUN_ID`), each tagged
with its dvc.lock entry hash once DVC has written it. The flow ends with a markdown
artifact: per-stage status, key metrics and the gate verdict.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

import rlhf  # noqa: F401  (offline, no-telemetry environment first)
from flows.dag import stage_graph, stage_order
from flows.processes import STAGES, FlowStopped, Slots, default_jobs, machine_cores, stop_on_signals, workspace_lock
from flows.summary import headline_metrics, read_metrics, summary_markdown, table_artifacts
from rlhf.params import InputError, input_errors_exit
from rlhf.tracking.runs import (
    PARENT_RUN_ENV,
    flatten,
    git_commit,
    log_metrics,
    setup_experiment,
    tag_stage_runs_with_lock,
)

ROOT = Path(__file__).resolve().parent.parent
PROGRESS_RE = re.compile(r"\d+%\|")


def parse_status(output: str, address: str) -> str:
    """ran | restored | skipped, from `dvc repro` output for one stage."""
    if re.search(rf"Stage '{re.escape(address)}' is cached - skipping run", output):
        return "restored"
    if re.search(rf"Running stage '{re.escape(address)}'", output):
        return "ran"
    return "skipped"


def stage_environment(parent_run_id: str | None) -> dict:
    """The environment of a `dvc repro`: this interpreter's bin first on PATH (dvc.yaml's
    `python -m stages...` must run in the same environment as the flow), and the parent
    MLflow run for the stages to nest under."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if parent_run_id:
        env[PARENT_RUN_ENV] = parent_run_id
    return env


SLOTS: Slots | None = None  # set by run_pipeline for its tasks


@contextmanager
def slot(address: str):
    if SLOTS is None:
        yield None
    else:
        with SLOTS.take(address) as threads:
            yield threads


@task(name="dvc-stage", retries=0, task_run_name="{address}")
def run_stage(address: str, parent_run_id: str | None, force: bool = False) -> dict:
    with slot(address) as threads:
        return repro_stage(address, parent_run_id, force, threads)


def repro_stage(address: str, parent_run_id: str | None, force: bool, threads: int | None) -> dict:
    logger = get_run_logger()
    command = [sys.executable, "-m", "dvc", "--wait-for-lock", "repro", "--single-item", address]
    command += ["--force"] if force else []
    env = stage_environment(parent_run_id)
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
        logger.info(f"{threads} thread(s) of {machine_cores()} cores: stages run side by side")
    start = time.perf_counter()
    process = STAGES.start(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines, last_progress = [], 0.0
    # Stream so that the stage's progress shows in the Prefect logs. Text mode splits tqdm's
    # carriage-return updates into lines; log a progress bar at most every 10 s.
    for line in process.stdout:
        lines.append(line)
        text = line.strip()
        if not text:
            continue
        if PROGRESS_RE.search(text):
            if time.monotonic() - last_progress < 10:
                continue
            last_progress = time.monotonic()
        logger.info(text[-500:])
    code = process.wait()
    STAGES.done(process)
    output = "".join(lines)
    if STAGES.stopping:
        raise RuntimeError(f"{address}: stopped ({STAGES.stopping} to the flow)")
    if code != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed with exit code {code}:\n{output[-4000:]}")
    return {"stage": address, "status": parse_status(output, address), "seconds": time.perf_counter() - start}


def default_remote(root: Path) -> str | None:
    out = subprocess.run(
        [sys.executable, "-m", "dvc", "config", "core.remote"], cwd=root, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or None


@task(name="dvc-remote")
def sync_remote(direction: str) -> str:
    """`dvc pull --run-cache` or `dvc push --run-cache` against the default remote."""
    remote = default_remote(ROOT)
    if remote is None:
        raise RuntimeError(
            f"--{direction}: this project has no default DVC remote; add one with "
            "`dvc remote add -d <name> <url>` (a local folder, s3://, gs://, ssh://...)"
        )
    command = [sys.executable, "-m", "dvc", direction, "--run-cache"]
    done = subprocess.run(command, cwd=ROOT, env=stage_environment(None), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"`dvc {direction} --run-cache` (remote {remote}) failed:\n{(done.stdout + done.stderr)[-4000:]}"
        )
    get_run_logger().info(f"dvc {direction} --run-cache ({remote}): {done.stdout.strip()[-500:]}")
    return remote


def log_run_definition(root: Path) -> None:
    """The params that define the run, on the parent run: every key of params.yaml,
    flattened (`sft.learning_rate`), and its hash, so that Compare shows what changed."""
    import hashlib

    import yaml

    if not (root / "params.yaml").is_file():  # a DAG without params
        return
    text = (root / "params.yaml").read_text()
    params = flatten(yaml.safe_load(text) or {})
    mlflow.log_params({key: str(value)[:6000] for key, value in params.items()})
    mlflow.set_tag("params.sha256", hashlib.sha256(text.encode()).hexdigest()[:16])


def describe(state) -> str:
    """failed, or not run (upstream failed), for the summary."""
    return "failed" if state.is_failed() or state.is_crashed() else "not run: an upstream stage failed"


@flow(name="rlhf-pipeline", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=64))
def pipeline(
    force: list[str] | None = None,
    retries: int = 0,
    root: str | None = None,
    pull: bool = False,
    push: bool = False,
    jobs: int | None = None,
) -> dict:
    """Run every stage of dvc.yaml through DVC; return per-stage status and the metrics.
    `pull`/`push`: `dvc pull --run-cache` before, `dvc push --run-cache` after success.
    `jobs`: stages at once (None: 2 on a CPU machine of 2+ cores, 1 with a GPU)."""
    global ROOT
    if root:
        ROOT = Path(root).resolve()
    os.chdir(ROOT)
    check_inputs(ROOT)
    with workspace_lock(ROOT):  # released after the stages have ended, even when stopped
        try:
            with stop_on_signals():
                return run_pipeline(set(force or []), retries, pull, push, jobs or default_jobs(ROOT))
        except FlowStopped as stopped:
            from prefect.states import Cancelled

            print(f"flow stopped by {stopped}; the workspace is free again (a rerun resumes from checkpoints)")
            return Cancelled(message=f"stopped by {stopped}")


def check_inputs(root: Path) -> None:
    """params.yaml (as stage check_params reads it) and MLFLOW_TRACKING_URI, before the flow
    reads either (the stage graph, the default --jobs, the parent run): a typo there fails
    with the check's message, not with DVC's or MLflow's traceback."""
    from rlhf.tracking.runs import tracking_uri

    tracking_uri()
    if (root / "params.yaml").is_file() and (root / "stages").is_dir():  # the project's own stages
        from stages import load_all

        load_all(str(root / "params.yaml"))


class ForceError(InputError, ValueError):
    """--force names a stage dvc.yaml does not have."""


def forced_stages(names: set[str], order: list[str]) -> set[str]:
    """The stage addresses `--force` names: a stage (`sft`, `policy@dpo`) or a foreach
    group (`policy`: each of its stages). A name that is none fails before any stage runs
    (a typo forced nothing, and the run said every stage was up to date)."""
    groups: dict[str, list[str]] = {}
    for address in order:
        groups.setdefault(address.split("@", 1)[0], []).append(address)
    unknown = sorted(n for n in names if n not in order and n not in groups)
    if unknown:
        raise ForceError(f"--force {' '.join(unknown)}: no such stage in dvc.yaml; its stages are {', '.join(order)}")
    return {address for name in names for address in ([name] if name in order else groups[name])}


def run_pipeline(force: set[str], retries: int, pull: bool, push: bool, jobs: int = 1) -> dict:
    global SLOTS
    if push and default_remote(ROOT) is None:  # before the stages, not after them
        raise RuntimeError(
            "--push: this project has no default DVC remote; add one with `dvc remote add -d <name> <url>`"
        )
    order, upstream = stage_graph(ROOT)
    force = forced_stages(force, order)
    if pull:
        sync_remote("pull")
    setup_experiment()
    run_name = f"pipeline-{flow_run.get_name() or time.strftime('%Y%m%d-%H%M%S')}"
    with mlflow.start_run(
        run_name=run_name,
        tags={
            "rlhf.stage": "pipeline",
            "mlflow.source.git.commit": git_commit(),
            # The Prefect flow run this MLflow run belongs to (its page: /runs/flow-run/<id>).
            "prefect.flow_run_id": str(flow_run.get_id() or ""),
        },
    ) as parent:
        task = run_stage.with_options(retries=retries, retry_delay_seconds=10)
        # Each stage waits for the stages it depends on: the run graph draws dvc.yaml's DAG,
        # and a stage downstream of a failure is not run (Prefect marks it NotReady) while
        # the others go on. Every task has a thread; Slots lets `jobs` of them run at once.
        SLOTS = Slots(jobs, upstream, machine_cores())
        get_run_logger().info(f"{len(order)} stages, up to {jobs} at once on {machine_cores()} cores")
        futures: dict = {}
        for address in order:
            waits = [futures[u] for u in upstream[address] if u in futures]
            futures[address] = task.submit(address, parent.info.run_id, force=address in force, wait_for=waits)
        for future in futures.values():
            future.wait()
        states = {address: future.state for address, future in futures.items()}
        failed = [a for a in order if not states[a].is_completed()]
        results = [
            futures[a].result() if a not in failed else {"stage": a, "status": describe(states[a]), "seconds": 0.0}
            for a in order
        ]
        tag_stage_runs_with_lock(parent.info.run_id, ROOT / "dvc.lock")
        metrics = read_metrics(ROOT, current={a for a in order if a not in failed})
        gate_ran = any(r["stage"] == "gate" and r["status"] == "ran" for r in results)
        log_run_definition(ROOT)
        # The parent run carries a verdict only when its gate decided one (a run where the
        # gate was up to date promoted nothing).
        log_metrics(headline_metrics(metrics if gate_ran else {**metrics, "gate": None}))
        for r in results:
            mlflow.set_tag(f"stage.{r['stage'].replace('@', ':')}", r["status"])
        if metrics["gate"] and gate_ran:
            mlflow.set_tags(
                {"gate.promoted": str(metrics["gate"]["promoted"]), "gate.champion": str(metrics["gate"]["champion"])}
            )
        tables = table_artifacts(metrics)
        markdown = summary_markdown(results, metrics)
        if tables:
            markdown += "\n\nTables: " + ", ".join(f"artifact `{key}`" for key in tables)
        mlflow.log_text(markdown, "summary.md")
        if failed:
            mlflow.set_tag("pipeline.failed", ",".join(failed))
    if failed:  # Compare shows the run as failed, not finished
        mlflow.MlflowClient().set_terminated(parent.info.run_id, "FAILED")
    for key, rows in tables.items():
        create_table_artifact(table=rows, key=key, description=f"{key.replace('-', ' ')} of this run")
    create_markdown_artifact(
        markdown=markdown, key="pipeline-summary", description="stage status, metrics, gate verdict"
    )
    print(markdown)
    if push and not failed:
        try:
            sync_remote("push")
        except Exception:
            mlflow.MlflowClient().set_tag(parent.info.run_id, "pipeline.failed", "dvc push")
            mlflow.MlflowClient().set_terminated(parent.info.run_id, "FAILED")
            raise
    if failed:
        raise RuntimeError(
            "stages not completed: " + ", ".join(f"{a} ({describe(states[a])})" for a in order if a in failed)
        )
    return {"stages": results, "metrics": metrics, "mlflow_run_id": parent.info.run_id}


DEPLOYMENT = "scheduled"


def deploy(pool: str, cron: str, name: str = DEPLOYMENT, parameters: dict | None = None):
    """This checkout's flow as deployment `rlhf-pipeline/<name>` on process work pool
    `pool` (created when missing), scheduled by `cron` (UTC), one run at a time, each run
    with `parameters` (the flow's: force, retries, pull, push, jobs); its id."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    async def ensure_pool() -> None:
        async with get_client() as client:
            try:
                await client.create_work_pool(
                    WorkPoolCreate(
                        name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()
                    )
                )
            except ObjectAlreadyExists:
                existing = await client.read_work_pool(pool)
                if existing.type != "process":
                    raise SystemExit(f"work pool {pool!r} is of type {existing.type!r}; name a process pool") from None

    asyncio.run(ensure_pool())
    source = pipeline.from_source(str(ROOT), f"{Path(__file__).relative_to(ROOT).as_posix()}:pipeline")
    return source.deploy(
        name=name,
        work_pool_name=pool,
        cron=cron,
        concurrency_limit=1,
        parameters={**(parameters or {}), "root": str(ROOT)},
        description=f"dvc.yaml's stages through DVC in {ROOT}",
        print_next_steps=False,
        ignore_warnings=True,  # Prefect suggests .serve for a process pool: --serve is that
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="rlhf run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )  # `rlhf run` starts this module (so does `python -m flows.pipeline`)
    parser.add_argument(
        "--force", nargs="*", default=None, metavar="STAGE", help="rerun these stages even if unchanged"
    )
    parser.add_argument("--retries", type=int, default=0, help="retry a failed stage this many times")
    parser.add_argument("--pull", action="store_true", help="dvc pull --run-cache from the default remote first")
    parser.add_argument("--push", action="store_true", help="dvc push --run-cache to the default remote after")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="stages at once (default: 2 on a CPU machine of 2+ cores with 4 GiB free, else 1; 1 with a GPU)",
    )
    parser.add_argument("--serve", action="store_true", help="serve the flow with a schedule (needs a Prefect server)")
    parser.add_argument(
        "--deploy", action="store_true", help="register a scheduled deployment for a worker (needs a Prefect server)"
    )
    parser.add_argument("--pool", default="rlhf", help="process work pool of --deploy (created when missing)")
    parser.add_argument("--cron", default="0 3 * * *", help="schedule of --serve and --deploy (UTC)")
    args = parser.parse_args(argv)
    if args.force == []:
        parser.error("--force needs the stages to rerun (e.g. --force sft, or --force policy for each method)")
    with input_errors_exit("flows.pipeline: "):  # params, the tracking URI, --force
        check_inputs(ROOT)
        if args.force:
            forced_stages(set(args.force), stage_order(ROOT))
    # Every run of a schedule takes these, as one run started here would.
    parameters = {"force": args.force or [], "retries": args.retries, "pull": args.pull, "push": args.push}
    parameters |= {"jobs": args.jobs} if args.jobs is not None else {}
    if args.deploy:
        deployment = deploy(args.pool, args.cron, parameters=parameters)
        print(
            f"deployment rlhf-pipeline/{DEPLOYMENT} ({deployment}) on work pool {args.pool!r}, cron {args.cron!r}.\n"
            f"Start a worker here: prefect worker start --pool {args.pool}\n"
            f"Run it now:          prefect deployment run rlhf-pipeline/{DEPLOYMENT}"
        )
        return
    if args.serve:
        pipeline.serve(name="scheduled", cron=args.cron, parameters=parameters)
        return
    from prefect.exceptions import CancelledRun

    try:
        pipeline(force=args.force or [], retries=args.retries, pull=args.pull, push=args.push, jobs=args.jobs)
    except CancelledRun as cancelled:
        print(f"flows.pipeline: {cancelled}", file=sys.stderr)
        raise SystemExit(143) from None  # as a process ended by SIGTERM


if __name__ == "__main__":
    sys.exit(main())
