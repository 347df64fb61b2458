"""The Prefect flow draws dvc.yaml's DAG: each stage's task waits for the tasks of the
stages it depends on, a stage downstream of a failure is not run while an independent one
is, and the flow fails naming them. A four-stage DVC project of shell commands, run through
the real flow on Prefect's test harness: one server for the module (`prefect_api`), as
Prefect's testing guide sets it up, since each start takes about 20 s here."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import yaml

from tests.conftest import REPO, run

pytestmark = pytest.mark.slow  # starts Prefect's test server


@pytest.fixture(scope="module")
def prefect_api():
    """Prefect's test harness (a real server in a subprocess, on a database of its own) for
    the module's flows; its API address, for flows run in another process."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


DVC_YAML = {
    "stages": {
        "a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]},
        "b": {"cmd": "cat a.txt > b.txt && exit 3", "deps": ["a.txt"], "outs": ["b.txt"]},
        "c": {"cmd": "cat b.txt > c.txt", "deps": ["b.txt"], "outs": ["c.txt"]},
        "d": {"cmd": "cat a.txt > d.txt", "deps": ["a.txt"], "outs": ["d.txt"]},
    }
}


def test_the_run_graph_has_the_dags_edges_and_a_failure_stops_only_its_downstream(tmp_path, monkeypatch, prefect_api):
    from prefect.client.orchestration import get_client

    from flows.pipeline import pipeline, stage_graph

    root = tmp_path / "project"
    root.mkdir()
    (root / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    run(["git", "init", "-q"], root)
    run([sys.executable, "-m", "dvc", "init", "-q"], root)
    cwd = os.getcwd()
    monkeypatch.chdir(root)  # DVC names stages relative to the working directory, as the flow runs
    order, upstream = stage_graph(root)
    assert upstream == {"a": [], "b": ["a"], "c": ["b"], "d": ["a"]}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RLHF_PARENT_RUN_ID", "RLHF_ARTIFACT_ROOT"):
        monkeypatch.delenv(name, raising=False)

    async def task_runs():
        async with get_client() as client:
            return await client.read_task_runs()

    earlier = {r.id for r in asyncio.run(task_runs())}  # the module's other flows share the server
    try:
        # --push without a DVC remote fails before any stage (it failed after all of them).
        with pytest.raises(RuntimeError, match=r"^--push: this project has no default DVC remote"):
            pipeline(root=str(root), push=True)
        assert not (root / "a.txt").exists()
        with pytest.raises(RuntimeError, match=r"stages not completed: b \(failed\), c \(not run"):
            pipeline(root=str(root))
        runs = [r for r in asyncio.run(task_runs()) if r.id not in earlier]
    finally:
        os.chdir(cwd)
    by_name = {r.name: r for r in runs}
    assert set(by_name) == {"a", "b", "c", "d"}
    states = {name: r.state.type.value for name, r in by_name.items()}
    assert states["a"] == "COMPLETED" and states["d"] == "COMPLETED", "an independent stage still runs"
    assert states["b"] == "FAILED"
    assert states["c"] != "COMPLETED" and not (root / "c.txt").exists(), "downstream of the failure: not run"
    ids = {r.id: name for name, r in by_name.items()}
    edges = {(ids[i.id], name) for name, r in by_name.items() for i in r.task_inputs.get("wait_for", []) if i.id in ids}
    assert edges == {("a", "b"), ("b", "c"), ("a", "d")}, "one edge per dependency in `dvc dag`"
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (parent,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.`rlhf.stage` = 'pipeline'"
    )
    assert parent.info.status == "FAILED" and parent.data.tags["pipeline.failed"] == "b,c", "Compare shows it failed"


def test_a_second_flow_in_a_held_workspace_fails_at_once_and_a_killed_holder_frees_it(
    tmp_path, monkeypatch, prefect_api
):
    """One flow run per workspace: while another process holds it, the flow fails before
    any stage, naming the holder; once the holder is killed (-9), the next flow runs."""
    import subprocess

    from flows.pipeline import pipeline
    from flows.processes import LOCK_FILE

    root = tmp_path / "project"
    root.mkdir()
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"a": DVC_YAML["stages"]["a"]}}))
    run(["git", "init", "-q"], root)
    run([sys.executable, "-m", "dvc", "init", "-q"], root)
    (root / LOCK_FILE).parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.write('pid 4242, flow run held-by-test'); f.flush(); print('held', flush=True); time.sleep(600)"
        ), str(root / LOCK_FILE)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    cwd = os.getcwd()
    monkeypatch.chdir(root)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RLHF_PARENT_RUN_ID", "RLHF_ARTIFACT_ROOT"):
        monkeypatch.delenv(name, raising=False)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="another flow run holds this workspace.*held-by-test"):
            pipeline(root=str(root))
        assert not (root / "a.txt").exists(), "no stage ran"
        holder.kill()
        holder.wait()
        result = pipeline(root=str(root))
    finally:
        holder.kill()
        os.chdir(cwd)
    assert [s["status"] for s in result["stages"]] == ["ran"] and (root / "a.txt").read_text() == "a\n"


RECORD = """\
# start time, the thread count this stage was given, end time
echo "$(date +%s.%N) ${OMP_NUM_THREADS:-unset}" > "$1.txt"
sleep 2
date +%s.%N >> "$1.txt"
"""


def test_jobs_run_independent_stages_side_by_side_with_a_share_of_the_cores(tmp_path, monkeypatch, prefect_api):
    """`jobs=2`: two stages that depend only on `a` run at the same time, each with
    OMP_NUM_THREADS = cores / 2, and the stage after them, alone, keeps torch's default.
    DVC records all of them (dvc.lock, `dvc status` clean). `jobs=1` runs them in turn."""

    from flows.pipeline import pipeline
    from flows.processes import machine_cores

    root = tmp_path / "project"
    root.mkdir()
    (root / "record.sh").write_text(RECORD)
    stages = {
        "a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]},
        **{n: {"cmd": f"sh record.sh {n}", "deps": ["a.txt", "record.sh"], "outs": [f"{n}.txt"]} for n in "bc"},
        "d": {"cmd": "sh record.sh d", "deps": ["b.txt", "c.txt", "record.sh"], "outs": ["d.txt"]},
    }  # fmt: skip
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    run(["git", "init", "-q"], root)
    run([sys.executable, "-m", "dvc", "init", "-q"], root)
    cwd = os.getcwd()
    monkeypatch.chdir(root)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RLHF_PARENT_RUN_ID", "RLHF_ARTIFACT_ROOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def record(name: str) -> tuple[float, str, float]:
        first, last = (root / f"{name}.txt").read_text().split("\n")[:2]
        start, threads = first.split()
        return float(start), threads, float(last)

    try:
        pipeline(root=str(root), jobs=2)
        side_by_side = {name: record(name) for name in "bcd"}
        status = run([sys.executable, "-m", "dvc", "status"], root)
        pipeline(root=str(root), jobs=1, force=["b", "c"])
        in_turn = {name: record(name) for name in "bc"}
    finally:
        os.chdir(cwd)
    (b0, b_threads, b1), (c0, c_threads, c1) = side_by_side["b"], side_by_side["c"]
    assert max(b0, c0) < min(b1, c1), f"b and c overlap in time: {side_by_side}"
    assert b_threads == c_threads == str(max(1, machine_cores() // 2))
    assert side_by_side["d"][1] == "unset", "a stage that runs alone keeps every core"
    assert side_by_side["d"][0] >= max(b1, c1), "d waits for both"
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"a", "b", "c", "d"} and "up to date" in status.stdout
    (b0, b_threads, b1), (c0, c_threads, c1) = in_turn["b"], in_turn["c"]
    assert min(b1, c1) <= max(b0, c0), f"jobs=1: one after the other: {in_turn}"
    assert b_threads == c_threads == "unset"


STAGE_THAT_STOPS = """\
import os, signal, sys, time
def ended(signum, frame):
    time.sleep(2)  # a stage that takes a moment to end (a checkpoint being written)
    with open("a.log", "a") as log:
        log.write(f"terminated {time.time()}\\n")
    sys.exit(143)
signal.signal(signal.SIGTERM, ended)
with open("a.log", "w") as log:
    log.write(f"pid {os.getpid()}\\n")
time.sleep(300)
"""

FLOW = """\
import sys
from flows.pipeline import pipeline
state = pipeline(root=sys.argv[1], return_state=True)
print("STATE", state.type.value, state.message, flush=True)
"""


def test_sigterm_to_the_flow_stops_its_stages_and_then_frees_the_workspace(tmp_path, prefect_api):
    """SIGTERM to a running flow (a process of its own, on the module's server) reaches the
    stage it runs (in its own process group), the flow waits for the stage to end, ends
    Cancelled, and only then frees the workspace; the stage after it never starts."""
    import fcntl
    import subprocess
    import time

    from flows.processes import LOCK_FILE

    root = tmp_path / "project"
    root.mkdir()
    (root / "stage_a.py").write_text(STAGE_THAT_STOPS)
    stages = {
        "a": {"cmd": f"{sys.executable} stage_a.py && echo a > a.txt", "deps": ["stage_a.py"], "outs": ["a.txt"]},
        "b": {"cmd": "cat a.txt > b.txt", "deps": ["a.txt"], "outs": ["b.txt"]},
    }
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    run(["git", "init", "-q"], root)
    run([sys.executable, "-m", "dvc", "init", "-q"], root)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RLHF_"))}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env["PREFECT_API_URL"] = prefect_api
    flow = subprocess.Popen(
        [sys.executable, "-c", FLOW, str(root)], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not (root / "a.log").exists():
        assert flow.poll() is None and time.monotonic() < deadline, flow.communicate()[0][-3000:]
        time.sleep(0.2)
    stage_pid = int((root / "a.log").read_text().split()[1])
    flow.send_signal(15)
    output, _ = flow.communicate(timeout=120)
    freed = time.time()
    assert "STATE CANCELLED stopped by SIGTERM" in output, output[-3000:]
    ended = float((root / "a.log").read_text().split("terminated ")[1])
    assert ended <= freed, "the flow ended after its stage"
    try:
        os.kill(stage_pid, 0)
        raise AssertionError(f"the stage (pid {stage_pid}) outlived the flow")
    except ProcessLookupError:
        pass
    assert not (root / "b.txt").exists() and not (root / "a.txt").exists()
    with open(root / LOCK_FILE, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: no BlockingIOError


SEEN = """\
import prefect  # first, as an import sorter may put it: Prefect reads its settings here
import flows.pipeline  # noqa: F401
from prefect import flow
from prefect.settings import get_current_settings

@flow
def seen():
    return get_current_settings().server.ephemeral.startup_timeout_seconds

print("SEEN", seen(), flush=True)
"""


def test_the_running_flow_sees_the_environments_server_startup_timeout(tmp_path):
    """rlhf.environment sets Prefect's ephemeral-server startup timeout to 120 s (a busy
    2-core machine needs more than the default 20); Prefect reads its settings at import, so
    a flow module that imports prefect before rlhf ran with 20 s. A flow run in a fresh
    process, on an ephemeral server, sees 120 whatever the import order."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    out = subprocess.run([sys.executable, "-c", SEEN], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "SEEN 120" in out.stdout, (out.stdout + out.stderr)[-3000:]
