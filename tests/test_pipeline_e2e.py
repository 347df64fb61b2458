"""The whole DAG in a real git + DVC repository: first as the Prefect flow against a real
`prefect server` and a real `mlflow server` on 127.0.0.1 (tests/ui_check.py starts them;
every stage, flow and test of this module logs there), then with plain `dvc repro`:

1. the flow runs every stage once, ends with a markdown artifact, and leaves one MLflow
   parent run with a nested run per stage, each tagged with its dvc.lock entry hash;
   every file a stage opened is one of its dvc.yaml deps (or under one), and every data
   and model dep is read (but for the few that a param's value decides);
2. `dvc repro` again runs nothing; retraining the reward model leaves the DPO policy up to
   date;
3. bad params and a bad data file fail before any compute, naming key / file, row and
   field, and every output already produced is still there;
4. last, the UI check (tests/ui_check.py): a second flow run with one policy param
   changed reruns exactly that policy stage and the stages after it (and the params
   check, which every change of params.yaml triggers); the two parent runs compared as
   MLflow's Compare view does, the run graph in Prefect's API; changing the param back
   restores the policy and evaluation outputs from DVC's run-cache without training (the
   gate reruns: its champion is state, not cache); the champion loaded from the server's
   registry in a second clone, and the pages photographed in a headless browser.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import make_project, run, write_params

pytestmark = pytest.mark.slow

ALL_STAGES = [
    "check_params", "prepare", "base", "sft", "verifier", "compress", "rm", "prm", "policy@dpo", "merge", "evaluate",
    "validate", "gate", "infer",
]  # fmt: skip
# Edges of the DAG the flow's task order must respect (it may order independent stages freely).
ORDER = [
    ("check_params", "prepare"), ("prepare", "sft"), ("base", "sft"), ("sft", "verifier"), ("verifier", "prm"),
    ("sft", "rm"), ("sft", "policy@dpo"), ("policy@dpo", "merge"), ("merge", "evaluate"), ("rm", "evaluate"),
    ("evaluate", "validate"), ("validate", "gate"), ("prm", "infer"),
]  # fmt: skip
# Data and model deps a stage may leave unread in the default run, because a param's value
# decides whether it reads them (DVC deps cannot follow a value).
UNREAD_BY_DESIGN = {
    ("prepare", "data/raw"): "read with prepare.source: files, and the labelling page's file when it has rows",
    ("check_params", "data/raw"): "read when a gate or round test names a difficulty of a suite from a file",
    ("merge", "data/prepared/eval"): "read only by merge.method: greedy_soup",
    ("prm", "models/sft"): "the rollout policy, read only when no step labels are given",
    ("prm", "data/prepared/prompts.parquet"): "read only when step labels are derived by rollouts",
    ("infer", "models/rm"): "read only by a reward_model scorer (the default best-of-n scorer is the PRM)",
    ("policy@dpo", "data/prepared/unpaired.parquet"): "the offline template's KTO input",
    ("policy@dpo", "data/prepared/sft.parquet"): "EWC's previous data, read only with policy.<method>.ewc.strength > 0",
    ("gate", "models/policy"): "read only when a policy is promoted (here: dpo)",
    ("gate", "models/merged"): "read only when the merge is promoted",
    ("evaluate", "models/base"): "read only when evaluate.baselines names it (the model as it came)",
    ("compress", "models/sft"): "read only with compress.enabled (off by default: the stage writes absent.json)",
    ("compress", "data/prepared/compress.parquet"): "read only with compress.enabled",
    ("evaluate", "models/compressor"): "read only with evaluate.compress.enabled and a long-context suite",
    ("infer", "models/compressor"): "read only with infer.compress.enabled and a long-context suite",
}
TRACE = Path(__file__).resolve().parent / "trace"


def dvc_repro(root: Path, *targets: str) -> str:
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return run([sys.executable, "-m", "dvc", "repro", *targets], root, env=env).stdout


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def restored(output: str) -> list[str]:
    return re.findall(r"Stage '([^']+)' is cached - skipping run", output)


def tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + file.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def e2e_servers(tmp_path_factory):
    """A Prefect server and an MLflow server on 127.0.0.1 for the module (their state in
    `<ui>/servers`, where the UI check looks), MLflow's address in MLFLOW_TRACKING_URI for
    everything the module runs, and an experiment name of the user's own."""
    from tests.ui_check import servers

    out = tmp_path_factory.mktemp("ui")
    with servers(out / "servers") as urls, pytest.MonkeyPatch.context() as mp:
        for name in ("RLHF_PARENT_RUN_ID", "RLHF_ARTIFACT_ROOT"):
            mp.delenv(name, raising=False)
        mp.setenv("MLFLOW_TRACKING_URI", urls["mlflow"])
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "e2e-experiment")
        yield {**urls, "out": out}


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, e2e_servers):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import pipeline

    root = make_project(tmp_path_factory.mktemp("e2e") / "project")
    cwd = os.getcwd()
    with pytest.MonkeyPatch.context() as mp:
        # Every stage process of this first run records the files it reads (tests/trace/sitecustomize.py).
        mp.setenv("RLHF_TRACE_READS", str(root.parent / "reads.log"))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(TRACE), os.environ.get("PYTHONPATH", "")]))
        try:
            with temporary_settings({PREFECT_API_URL: e2e_servers["prefect"]}):
                result = pipeline(root=str(root))
                artifacts = read_artifacts()
                result["task_runs"] = read_task_runs()  # the server's first and only flow run
        finally:
            os.chdir(cwd)
    return root, result, artifacts


def read_artifacts():
    import asyncio

    from prefect.client.orchestration import get_client

    async def fetch():
        async with get_client() as client:
            return await client.read_artifacts()

    return asyncio.run(fetch())


def read_task_runs():
    import asyncio

    from prefect.client.orchestration import get_client

    async def fetch():
        async with get_client() as client:
            return await client.read_task_runs()

    return asyncio.run(fetch())


def test_the_prefect_run_graph_has_the_edges_of_dvc_dag(flow_run):
    """Each task waits for its upstream stages' tasks: as many edges as `dvc dag` draws."""
    import networkx as nx
    from dvc.repo import Repo

    root, result, _ = flow_run
    runs = {r.name: r for r in result["task_runs"]}
    ids = {r.id: name for name, r in runs.items()}
    edges = {(ids[i.id], name) for name, r in runs.items() for i in r.task_inputs.get("wait_for", []) if i.id in ids}
    cwd = os.getcwd()
    try:
        os.chdir(root)
        with Repo(str(root)) as repo:
            graph = repo.index.graph
            dag = {(dep.addressing, stage.addressing) for stage, dep in graph.edges}
    finally:
        os.chdir(cwd)
    assert edges == dag and len(edges) == nx.number_of_edges(graph)


def test_flow_runs_every_stage_as_a_task_and_summarises(flow_run):
    _root, result, artifacts = flow_run
    order = [s["stage"] for s in result["stages"]]
    assert sorted(order) == sorted(ALL_STAGES)
    assert all(order.index(a) < order.index(b) for a, b in ORDER), order
    assert all(s["status"] == "ran" for s in result["stages"])
    summary = [a for a in artifacts if a.key == "pipeline-summary"]
    assert summary, "the flow ends with a markdown artifact"
    markdown = summary[0].data
    assert "| policy@dpo | ran |" in markdown and "## Gate: promoted **dpo**" in markdown
    # Tables read better as tables: each is an artifact of its own, named in the summary.
    keys = {a.key for a in artifacts}
    assert {"eval-table", "gate-verdict", "inference-table"} <= keys
    assert "artifact `gate-verdict`" in markdown
    verdict = next(a for a in artifacts if a.key == "gate-verdict")
    assert "kl_to_ref" in str(verdict.data) and "passed" in str(verdict.data)


def test_mlflow_has_a_parent_run_with_a_tagged_nested_run_per_stage(flow_run):
    from rlhf.tracking.runs import lock_entry_hash

    root, result, _ = flow_run
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])  # the module's mlflow server
    parent = client.get_run(result["mlflow_run_id"])
    # The parent run carries what MLflow's Compare shows: headline metrics and the params.
    assert {"dev.dpo.accuracy", "dev.sft.accuracy", "test.dpo.accuracy_low", "gate.promoted"} <= set(
        parent.data.metrics
    )
    assert parent.data.metrics["gate.promoted"] == 1.0
    assert parent.data.params["sft.max_steps"] == "4" and "params.sha256" in parent.data.tags
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_stage = {r.data.tags["rlhf.stage"]: r for r in children}
    # check_params only validates (in half a second, no MLflow import): it logs no run; nor
    # does compress when it is off (it writes absent.json only).
    assert set(by_stage) == set(ALL_STAGES) - {"check_params", "compress"}
    for stage, child in by_stage.items():
        assert child.data.tags["dvc.lock_hash"] == lock_entry_hash(stage, root / "dvc.lock")
        assert child.data.tags["mlflow.source.git.commit"] == parent.data.tags["mlflow.source.git.commit"]
    assert parent.data.tags["gate.promoted"] == "True"
    assert client.get_model_version_by_alias("rlhf-policy", "champion").tags["candidate"] == "dpo"
    # The Dataset and Models columns: tables as run inputs, candidates as logged models.
    evaluate_run = next(r for r in children if r.data.tags["rlhf.stage"] == "evaluate")
    assert {i.dataset.name for i in client.get_run(evaluate_run.info.run_id).inputs.dataset_inputs} == {"dev", "test"}
    sft_run = next(r for r in children if r.data.tags["rlhf.stage"] == "sft")
    assert [i.dataset.name for i in client.get_run(sft_run.info.run_id).inputs.dataset_inputs] == ["sft"]
    models = client.search_logged_models(experiment_ids=[parent.info.experiment_id])
    assert {m.name for m in models} >= {"sft", "dpo"}
    dpo = next(m for m in models if m.name == "dpo")
    assert dpo.tags["dvc.md5"].endswith(".dir") and any(m.key == "dev.accuracy" for m in dpo.metrics)


def test_dvc_plots_show_renders_loss_reward_kl_and_accuracy(flow_run):
    """`dvc plots show` draws every declared curve with data and no load error: the SFT
    curves, each RM member, the DPO policy's loss, implicit reward and preference accuracy,
    and a bar of accuracy per model on every eval suite."""
    root, _, _ = flow_run
    out = subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=root, capture_output=True, text=True, check=True
    )
    shown = json.loads(out.stdout)
    assert not shown.get("errors"), shown.get("errors")
    rows = {name: plots[0]["content"]["data"]["values"] for name, plots in shown["data"].items() if plots}
    expected = {
        "SFT loss", "SFT token accuracy", "plots/rm/member_0.csv", "plots/rm/member_1.csv",
        "plots/policy/dpo/loss.csv", "plots/policy/dpo/reward.csv", "plots/policy/dpo/accuracy.csv",
        "plots/evaluate/dev.csv", "plots/evaluate/test.csv",
    }  # fmt: skip
    assert expected <= {name for name, values in rows.items() if values}, sorted(rows)
    assert "rewards/margins" in rows["plots/policy/dpo/reward.csv"][0]
    assert shown["data"]["plots/evaluate/test.csv"][0]["content"]["mark"]["type"] == "bar"
    assert {row["model"] for row in rows["plots/evaluate/test.csv"]} >= {"sft", "dpo"}


def test_a_clone_that_pulls_from_a_dvc_remote_trains_nothing(flow_run, e2e_servers, tmp_path):
    """The first run's results pushed to a local-folder DVC remote (run-cache included); a
    fresh clone with the same dvc.lock runs the flow with --pull --push (on the module's
    Prefect server): every stage is restored or up to date, none trains, and the policy is
    byte for byte the first run's."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import pipeline

    root, _, _ = flow_run
    remote = tmp_path / "remote"
    run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "store", str(remote)], root)
    run([sys.executable, "-m", "dvc", "push", "--run-cache"], root)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(root), str(clone)], tmp_path)
    (clone / "dvc.lock").write_bytes((root / "dvc.lock").read_bytes())  # what a commit of the run would carry
    run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "store", str(remote)], clone)
    cwd = os.getcwd()
    try:
        with temporary_settings({PREFECT_API_URL: e2e_servers["prefect"]}):
            result = pipeline(root=str(clone), pull=True, push=True)
    finally:
        os.chdir(cwd)
    status = {s["stage"]: s["status"] for s in result["stages"]}
    # Only the gate runs: the champion is the workspace's state (persisted, never cached),
    # so the clone's gate decides afresh on the restored reports; it trains nothing.
    assert {a for a, s in status.items() if s == "ran"} <= {"gate"}, status
    assert {"sft", "rm", "prm", "policy@dpo", "evaluate"} <= {
        a for a, s in status.items() if s in ("restored", "skipped")
    }
    assert tree_digest(clone / "models/policy/dpo") == tree_digest(root / "models/policy/dpo")
    assert (clone / "reports/eval.json").read_bytes() == (root / "reports/eval.json").read_bytes()


def test_a_worker_runs_the_scheduled_deployment_to_completion(flow_run, e2e_servers, tmp_path):
    """`--deploy` against the real `prefect server`: a deployment on a process work pool
    with the cron schedule and one run at a time; a run triggered with the CLI is picked up
    by `prefect worker start`, which runs the flow in the project (nothing is stale, so no
    stage trains) to COMPLETED with its pipeline-summary artifact."""
    from tests.ui_check import get_json

    root, _, _ = flow_run
    prefect = str(Path(sys.executable).parent / "prefect")
    urls = e2e_servers
    env = {"PREFECT_API_URL": urls["prefect"], "PREFECT_HOME": str(tmp_path / "prefect-home")}
    command = ["--deploy", "--pool", "test-pool", "--cron", "0 3 * * *", "--retries", "1"]
    out = run([sys.executable, "-m", "flows.pipeline", *command], root, env=env).stdout
    assert "prefect worker start --pool test-pool" in out
    deployment = get_json(f"{urls['prefect']}/deployments/name/rlhf-pipeline/scheduled")
    assert deployment["work_pool_name"] == "test-pool"
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]
    assert deployment["global_concurrency_limit"]["limit"] == 1  # one run at a time; the next waits
    assert deployment["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(root)}}]
    # Each scheduled run takes the flags given with --deploy.
    assert deployment["parameters"] == {"force": [], "retries": 1, "pull": False, "push": False, "root": str(root)}
    pool = get_json(f"{urls['prefect']}/work_pools/test-pool")
    assert pool["type"] == "process"
    triggered = run([prefect, "deployment", "run", "rlhf-pipeline/scheduled"], root, env=env).stdout
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", triggered).group(1)
    worker = subprocess.run(
        [prefect, "worker", "start", "--pool", "test-pool", "--run-once"],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    state = get_json(f"{urls['prefect']}/flow_runs/{flow_run_id}")
    assert state["state_type"] == "COMPLETED", (state["state_type"], worker.stdout[-3000:], worker.stderr[-3000:])
    artifacts = post_json(
        f"{urls['prefect']}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    )
    summary = [a for a in artifacts if a["key"] == "pipeline-summary"]
    assert summary and "## Gate" in summary[0]["data"]
    assert re.search(r"\| sft \| (skipped|restored) \|", summary[0]["data"]), summary[0]["data"]


def test_queued_experiments_run_two_at_a_time_compare_and_never_move_the_champion(flow_run):
    """`dvc exp run --queue -S gate.confidence=...` twice, `dvc queue start -j 2`: both run
    in DVC's temporary workspaces (their MLflow runs land in the tracking store of the
    workspace), `dvc exp show` lists each with its confidence and its own verdict, the gate
    of each judges without promoting (a passing verdict included), and the workspace's
    champion (folder and registry alias) and outputs are as they were. (A param of the gate
    alone: each experiment reruns check_params and the gate; which stages a param reruns is
    test_the_ui_check_compares_a_second_run_in_both_servers's.)"""
    root, _, _ = flow_run
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    alias = client.get_model_version_by_alias("rlhf-policy", "champion").version
    champion = tree_digest(root / "models/champion")
    policy = tree_digest(root / "models/policy/dpo")
    # An experiment's baseline is a commit: the user commits the run's dvc.lock first.
    run(["git", "add", "dvc.lock"], root)
    run(["git", "commit", "-qm", "results of the first run"], root)
    dvc = [sys.executable, "-m", "dvc"]
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    # Values no later test uses: their runs land in the shared run-cache, which would then
    # restore a stage that a later test expects to run.
    for name, confidence in (("conf-80", 0.8), ("conf-50", 0.5)):
        run([*dvc, "exp", "run", "--queue", "--name", name, "-S", f"gate.confidence={confidence}"], root, env=env)
    # The workers it starts outlive it: their output goes to a file, not a pipe to wait on.
    with open(root.parent / "queue-start.log", "w") as log:
        started = subprocess.run(
            [*dvc, "queue", "start", "-j", "2"],
            cwd=root,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    assert started.returncode == 0, (root.parent / "queue-start.log").read_text()
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        status = run([*dvc, "queue", "status"], root, env=env).stdout
        if not re.search(r"\b(Queued|Running)\b", status):
            break
        time.sleep(5)
    logs = {
        name: run([*dvc, "queue", "logs", name], root, env=env, check=False).stdout for name in ("conf-80", "conf-50")
    }
    assert len(re.findall(r"\bSuccess\b", status)) == 2, (status, {k: v[-3000:] for k, v in logs.items()})
    shown = json.loads(run([*dvc, "exp", "show", "--json"], root, env=env).stdout)
    experiments = {}
    for baseline in shown:
        for exp in baseline.get("experiments") or []:
            for rev in exp["revs"]:
                data = rev["data"]
                params = data["params"]["params.yaml"]["data"]
                metrics = data["metrics"]
                experiments[rev["name"]] = (params["gate"]["confidence"], metrics["reports/gate.json"]["data"])
    assert {name: confidence for name, (confidence, _) in experiments.items()} == {"conf-80": 0.8, "conf-50": 0.5}
    for name, (_, gate) in experiments.items():  # the tiny params' tests pass: held back, not failed
        assert gate["promoted"] is False and "queued DVC experiment" in gate["held_back"], (name, gate)
    assert tree_digest(root / "models/champion") == champion
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == alias
    assert tree_digest(root / "models/policy/dpo") == policy  # the workspace is untouched


def post_json(url: str, body: dict):
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def stage_files(root: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Each stage's resolved deps and outs (paths relative to the project), from DVC."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return {
            stage.name: (
                [Path(d.def_path).as_posix() for d in stage.deps],
                [Path(o.def_path).as_posix() for o in stage.outs],
            )
            for stage in repo.index.stages
        }


def covered(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f + "/") for f in folders)


def test_every_file_a_stage_reads_is_a_dep(flow_run):
    """The traced reads of the first run: each file under data/, models/ or reports/ that a
    stage opened (its own outputs and their temporary siblings or journal aside) is one of its deps or
    inside one; and each data, model or report dep is read, but for those a param decides."""
    root, _, _ = flow_run
    reads: dict[str, set[str]] = {}
    for line in (root.parent / "reads.log").read_text().splitlines():
        stage, path = line.split("\t")
        relative = Path(path).resolve().relative_to(root.resolve()) if Path(path).is_relative_to(root) else None
        if relative is not None and relative.parts[0] in ("data", "models", "reports"):
            # Staging siblings (`.X.tmp-*`) and the champion's move journal (`.champion-move`).
            if not any(part.startswith(".") and (".tmp-" in part or part.endswith("-move")) for part in relative.parts):
                reads.setdefault(stage, set()).add(relative.as_posix())
    files = stage_files(root)
    # check_params reads params and code; prepare and base read no data in the built-in run.
    assert set(reads) >= set(ALL_STAGES) - {"check_params", "prepare", "base", "compress"}, sorted(reads)
    for stage, paths in reads.items():
        deps, outs = files[stage]
        undeclared = sorted(p for p in paths if not covered(p, deps) and not covered(p, outs))
        assert undeclared == [], f"{stage} reads files that are not its deps: {undeclared}"
    for stage, (deps, _) in files.items():
        for dep in deps:
            if dep.split("/")[0] not in ("data", "models", "reports") or dep == "reports/params.ok":
                continue
            if (stage, dep) in UNREAD_BY_DESIGN:
                continue
            assert any(covered(p, [dep]) for p in reads.get(stage, ())), f"{stage} never reads its dep {dep}"


def test_retraining_the_reward_model_leaves_the_dpo_policy_up_to_date(flow_run):
    """DPO reads no reward model: with a new rm.learning_rate, `dvc repro evaluate` reruns
    rm and the evaluation it judges, never policy@dpo or merge, which stand between them in
    the DAG's order. (Only as far as evaluate: which stages after a change rerun is
    test_the_ui_check_compares_a_second_run_in_both_servers's.)"""
    root, _, _ = flow_run
    params = yaml.safe_load((root / "params.yaml").read_text())
    original = params["rm"]["learning_rate"]
    params["rm"]["learning_rate"] = original * 2
    scorers = json.loads((root / "reports/eval.json").read_text())["scorers"]
    write_params(root, params)
    try:
        output = dvc_repro(root, "evaluate")
        assert ran(output) == ["check_params", "rm", "evaluate"], output
        # The report names the RM version that scored it (for the gate's champion tests).
        rescored = json.loads((root / "reports/eval.json").read_text())["scorers"]
        lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
        (rm_out,) = [out for out in lock["rm"]["outs"] if out["path"] == "models/rm"]
        assert rescored["rm"] == rm_out["md5"] != scorers["rm"]
        assert rescored["reference"] == scorers["reference"] and rescored["reference"].endswith(".dir")
    finally:
        params["rm"]["learning_rate"] = original
        write_params(root, params)
        dvc_repro(root)


def test_dvc_repro_after_the_flow_runs_nothing(flow_run):
    """The flow's run, committed, is what `dvc repro` reproduces: nothing runs or is
    restored. (Which stages a changed param reruns, and their restore from the run-cache
    when it is changed back, is the UI check's, last in the module.)"""
    root, _, _ = flow_run
    # Commit the lock so the repo state is what a user would have after a run.
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "first run", "--allow-empty"], root)  # an earlier test may have committed it all
    output = dvc_repro(root)
    assert ran(output) == [] and restored(output) == [], output


def test_bad_params_and_bad_data_fail_before_compute_and_lose_nothing(flow_run):
    root, _, _ = flow_run
    outputs = ["data/prepared", "models/sft", "models/rm", "models/policy/dpo", "models/champion"]
    before = {p: tree_digest(root / p) for p in outputs}
    good = (root / "params.yaml").read_text()
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}

    params = yaml.safe_load(good)
    params["sft"]["learnin_rate"] = 0.1  # typo
    params["rm"]["num_members"] = 0  # out of range
    params["policy"]["dpo"]["beta"] = "high"  # wrong type
    write_params(root, params)
    start = time.perf_counter()
    result = run([sys.executable, "-m", "dvc", "repro"], root, check=False, env=env)
    elapsed = time.perf_counter() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0
    for key in ("sft.learnin_rate", "rm.num_members", "policy.dpo.beta"):
        assert key in output, output[-3000:]
    assert "check_params: params.yaml: 3 problem(s):" in output and "Traceback" not in output, output[-3000:]
    assert ran(output) == ["check_params"], "no stage after the check may start"
    assert elapsed < 90, f"bad params took {elapsed:.0f} s to fail"

    raw = root / "data/raw"
    (raw / "sft.jsonl").write_text('{"prompt": "1+2\\n", "completion": "1+2=3; answer 3"}\n')
    (raw / "heldout.jsonl").write_text('{"question": "1+2\\n", "solution": "3"}\n')
    (raw / "pairs.jsonl").write_text(
        '{"prompt": "1+2\\n", "chosen": "1+2=3; answer 3", "rejected": "1+2=4; answer 4"}\n'
        '{"prompt": "2+2\\n", "chosen": "", "rejected": "2+2=5; answer 5"}\n'
        '{"prompt": "3+2\\n", "chosen": "3+2=5; answer 5"}\n'
    )
    params = yaml.safe_load(good)
    params["prepare"]["source"] = "files"
    params["prepare"]["files"] = {
        "sft": {"path": "data/raw/sft.jsonl"},
        "prefs": {"path": "data/raw/pairs.jsonl"},
        "eval_heldout": {"path": "data/raw/heldout.jsonl", "columns": {"prompt": "question", "answer": "solution"}},
    }
    write_params(root, params)
    result = run([sys.executable, "-m", "dvc", "repro"], root, check=False, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "data/raw/pairs.jsonl" in output and "row 2: 'chosen' is empty" in output, output[-3000:]
    assert "row 3: 'rejected' is missing" in output and "Traceback" not in output, output[-3000:]

    assert {p: tree_digest(root / p) for p in outputs} == before, "a failed run must not lose any output"
    (root / "params.yaml").write_text(good)
    for name in ("sft.jsonl", "heldout.jsonl", "pairs.jsonl"):
        (raw / name).unlink()
    output = dvc_repro(root)
    assert set(ran(output)) | set(restored(output)) <= {"check_params"}, output


def test_the_ui_check_compares_a_second_run_in_both_servers(flow_run, e2e_servers):
    """Last in the module: tests/ui_check.py on the servers that hold the first run. A
    second flow run with policy.dpo.beta changed reruns exactly that policy stage and the
    stages after it (and the params check, which every change of params.yaml triggers);
    Prefect's run graph has every edge of `dvc dag`; MLflow's Compare of the two parent
    runs shows exactly that param and DPO's metrics moved, not SFT's. Then `dvc repro` with
    the first params restores the policy and evaluation outputs from DVC's run-cache
    without training, byte for byte (the gate reruns: its champion is state, not cache).
    The champion loads from the server's registry in a second clone; the pages are
    photographed."""
    from tests.browser import missing_browser
    from tests.ui_check import check

    root, result, _ = flow_run
    out = e2e_servers["out"]
    urls = {name: e2e_servers[name] for name in ("prefect", "prefect_ui", "mlflow")}
    policy_before = tree_digest(root / "models/policy/dpo")
    report = check(root, out, vary="policy.dpo.beta=0.4", restore=True, running=urls, baseline=result["mlflow_run_id"])
    prefect = report["prefect"]
    assert prefect["state"] == "COMPLETED"
    artifacts = post_json(
        f"{urls['prefect']}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [prefect["flow_run"]]}}}
    )
    (summary,) = [a["data"] for a in artifacts if a["key"] == "pipeline-summary"]
    statuses = dict(re.findall(r"^\| (\S+) \| (ran|restored|skipped) \|", summary, re.M))
    rerun = {"check_params", "policy@dpo", "merge", "evaluate", "validate", "gate"}
    assert {s for s, status in statuses.items() if status == "ran"} == rerun, summary
    assert set(statuses) == set(ALL_STAGES), summary
    restore = (out / "restore.log").read_text()
    assert restored(restore) == ["check_params", "policy@dpo", "merge", "evaluate", "validate"], restore
    assert ran(restore) == ["gate"], restore
    assert tree_digest(root / "models/policy/dpo") == policy_before
    # The run graph Prefect's page draws has every edge of `dvc dag` and no other.
    assert prefect["graph_edges"] == prefect["dvc_dag_edges"] > 10
    assert not prefect["missing_edges"] and not prefect["extra_edges"]
    assert {"dev.dpo.accuracy", "gate.promoted"} <= set(report["mlflow"]["headline"])
    # Compare of the two pipeline runs: the one param that changed, and what it moved.
    assert report["compare"]["params_changed"] == {"policy.dpo.beta": ["0.1", "0.4"]}
    moved = report["compare"]["metrics_moved"]
    assert any(name.startswith(("dev.dpo.", "test.dpo.")) for name in moved), moved
    assert not any(name.startswith(("dev.sft.", "test.sft.")) for name in moved), "SFT did not rerun"
    # The gate's champion, loaded by a second clone pointed at the server from the
    # registry, is models/champion's weights, uploaded to the server's store.
    registry = report["registry"]
    assert registry["tensors"] > 0 and registry["max_difference"] == 0.0, registry
    assert registry["artifact_location"].startswith("mlflow-artifacts:") and registry["weights_in_server_store"]
    if missing_browser():
        assert "skipped" in report["screenshots"]
    else:
        for name in ("prefect-flow-run.png", "mlflow-run.png", "mlflow-compare.png"):
            data = (out / name).read_bytes()
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name
    assert report["passed"], report["checks"]
