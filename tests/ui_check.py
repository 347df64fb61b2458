"""Look at pipeline runs as a user does: a Prefect server and an MLflow server on
127.0.0.1, the flow run against both, their APIs checked and their pages photographed.

    python -m tests.ui_check                                  # this project, one flow run
    python -m tests.ui_check --vary policy.dpo.beta=0.2       # and a second run to compare

It starts `prefect server start --host 127.0.0.1` and `mlflow server --host 127.0.0.1` on
free ports, with their state under `<out>/servers/` (its own Prefect home and sqlite
stores, so nothing of yours is touched), runs the flow (`python -m flows.pipeline`) in the
project against both, and checks through their APIs what their pages show:

* Prefect: the flow run's graph (`/api/flow_runs/<id>/graph-v2`, what the run page draws)
  has exactly the edges of `dvc dag`;
* MLflow: the flow's parent run carries the headline metrics and the params;
* the registry: the champion's model version has its files in the server's artifact store
  (not in the project), and `mlflow.transformers.load_model("models:/<name>@champion")`,
  run in a second clone of the project (under `<out>/second-checkout`) pointed at the
  server, loads the champion's weights; skipped, saying so, when the gate promoted nothing;
* with `--vary KEY=VALUE`: a second flow runs with that one param changed, and the two
  parent runs are compared as MLflow's Compare view compares them: the params that differ
  (exactly KEY) and the metrics that moved. params.yaml is then restored and `dvc repro`
  brings the first run's outputs back from DVC's run-cache.

Headless Chromium (tests.browser) then saves `<out>/prefect-flow-run.png` (the run graph),
`<out>/mlflow-run.png` (the parent run) and, with --vary, `<out>/mlflow-compare.png`;
`<out>/check.json` has the results and the pages' addresses. The servers stop at the end;
to browse again: `PREFECT_HOME=<out>/servers/prefect prefect server start --host 127.0.0.1`
and `mlflow server --host 127.0.0.1 --backend-store-uri sqlite:///<out>/servers/mlflow.db
--artifacts-destination <out>/servers/mlartifacts`. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager, nullcontext
from pathlib import Path

import yaml

from flows.pipeline import stage_environment
from rlhf.environment import configure_environment
from rlhf.tracking.runs import experiment_name
from tests.servers import free_port, wait_http

SCREENSHOT_WAIT_S = 8.0  # for the pages' scripts to draw after their text is there


@contextmanager
def servers(state: Path, prefect_port: int | None = None, mlflow_port: int | None = None, names=("prefect", "mlflow")):
    """A Prefect server and an MLflow server (or those of `names`) on 127.0.0.1, their
    state under `state`; yields {"prefect": api url, "prefect_ui": ui url, "mlflow": url},
    stops them after."""
    state.mkdir(parents=True, exist_ok=True)
    prefect_port, mlflow_port = prefect_port or free_port(), mlflow_port or free_port()
    env = {**os.environ, "PREFECT_HOME": str(state / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    # MLflow's job runner (GenAI jobs, a consumer process per job type) runs nothing here.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    # The UI's pages call the API at this address (its default is port 4200).
    env["PREFECT_UI_API_URL"] = env["PREFECT_SERVER_UI_API_URL"] = f"http://127.0.0.1:{prefect_port}/api"
    bin_dir = Path(sys.executable).parent
    prefect_log, mlflow_log = state / "prefect.log", state / "mlflow.log"
    commands = {
        "prefect": (
            [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            prefect_log,
        ),
        "mlflow": (
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
             "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}",
             "--artifacts-destination", str(state / "mlartifacts"), "--workers", "1"],
            mlflow_log,
        ),
    }  # fmt: skip
    processes = {}
    try:
        for name in names:
            command, log = commands[name]
            with open(log, "w") as handle:
                processes[name] = subprocess.Popen(
                    command, cwd=state, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
                )
        urls = {
            "prefect": f"http://127.0.0.1:{prefect_port}/api",
            "prefect_ui": f"http://127.0.0.1:{prefect_port}",
            "mlflow": f"http://127.0.0.1:{mlflow_port}",
        }
        for name in names:
            wait_http(urls[name] + "/health", processes[name], commands[name][1])
        yield urls
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, 15)
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)


def run_flow(project: Path, urls: dict, log: Path) -> None:
    """The flow in `project` against the servers; its output goes to `log`."""
    env = {**stage_environment(None), "PREFECT_API_URL": urls["prefect"], "MLFLOW_TRACKING_URI": urls["mlflow"]}
    with open(log, "w") as handle:
        done = subprocess.run(
            [sys.executable, "-m", "flows.pipeline"], cwd=project, env=env, stdout=handle, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"the flow failed (exit {done.returncode}); its log is {log}:\n{tail}")


def set_param(text: str, key: str, value) -> str:
    """params.yaml text with `key` (dotted) set to `value`; the key must exist."""
    params = yaml.safe_load(text)
    node, parts = params, key.split(".")
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            raise SystemExit(f"--vary {key}: params.yaml has no key {key!r} (no {part!r})")
        node = node[part]
    if not isinstance(node, dict) or parts[-1] not in node:
        raise SystemExit(f"--vary {key}: params.yaml has no key {key!r}")
    node[parts[-1]] = value
    return yaml.safe_dump(params, sort_keys=False)


def dag_edges(project: Path) -> set[tuple[str, str]]:
    """(upstream, downstream) stage addresses of `dvc dag`, read from DVC afresh (not from
    flows.pipeline.stage_graph, which the flow's edges come from: the check stays independent)."""
    from dvc.repo import Repo

    cwd = os.getcwd()
    try:
        os.chdir(project)
        with Repo(str(project)) as repo:
            return {(dep.addressing, stage.addressing) for stage, dep in repo.index.graph.edges}
    finally:
        os.chdir(cwd)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def graph_edges(prefect_api: str, flow_run_id: str) -> set[tuple[str, str]]:
    """(upstream, downstream) task-run labels of a flow run's graph, as the run page draws it."""
    graph = get_json(f"{prefect_api}/flow_runs/{flow_run_id}/graph-v2")
    nodes = dict((node_id, node) for node_id, node in graph["nodes"])
    return {(nodes[edge["id"]]["label"], node["label"]) for node in nodes.values() for edge in node["parents"]}


def pipeline_runs(mlflow_uri: str) -> list:
    """The flow's parent runs, newest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name(experiment_name())
    if experiment is None:
        raise RuntimeError(f"no experiment {experiment_name()!r} on {mlflow_uri}: the flow logged no run there")
    return client.search_runs(
        [experiment.experiment_id],
        filter_string="tags.`rlhf.stage` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
    )


def compare(first, second) -> dict:
    """What MLflow's Compare of two runs shows: the params that differ and the metrics that
    moved, each with (first, second)."""
    a, b = first.data.params, second.data.params
    params = {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    x, y = first.data.metrics, second.data.metrics
    metrics = {k: [x.get(k), y.get(k)] for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}
    return {"params_changed": params, "metrics_moved": metrics}


def screenshot(driver, url: str, path: Path, expect: str, timeout: float = 60.0) -> dict:
    """Open `url`, wait until the page's text has `expect`, let its scripts draw, save a PNG."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    deadline, found = time.monotonic() + timeout, False
    while time.monotonic() < deadline and not found:
        try:
            found = expect in driver.find_element(By.TAG_NAME, "body").text
        except Exception:  # the page is still being built
            pass
        time.sleep(0.5)
    time.sleep(SCREENSHOT_WAIT_S)
    driver.save_screenshot(str(path))
    return {"url": url, "file": str(path), "shows": expect, "found": found}


def take_screenshots(out: Path, urls: dict, flow_run: dict, runs: list) -> dict:
    from tests.browser import INSTALL_HINT, headless_chromium, missing_browser

    missing = missing_browser()
    if missing:
        return {"skipped": f"no headless browser ({', '.join(missing)} missing): {INSTALL_HINT}"}
    experiment = runs[0].info.experiment_id
    driver = headless_chromium(out / "servers/chromium-profile", width=1600, height=1000)
    shots = {}
    try:
        shots["prefect"] = screenshot(
            driver,
            f"{urls['prefect_ui']}/runs/flow-run/{flow_run['id']}",
            out / "prefect-flow-run.png",
            flow_run["name"],
        )
        shots["mlflow_run"] = screenshot(
            driver,
            f"{urls['mlflow']}/#/experiments/{experiment}/runs/{runs[0].info.run_id}",
            out / "mlflow-run.png",
            runs[0].info.run_name,
        )
        if len(runs) > 1:
            ids = json.dumps([r.info.run_id for r in runs])
            query = urllib.parse.urlencode({"runs": ids, "experiments": json.dumps([experiment])})
            shots["mlflow_compare"] = screenshot(
                driver, f"{urls['mlflow']}/#/compare-runs?{query}", out / "mlflow-compare.png", runs[1].info.run_name
            )
    finally:
        driver.quit()
    return shots


LOAD_CHAMPION = """
import json, sys
import mlflow
from safetensors.torch import load_file
from pathlib import Path
name, champion = sys.argv[1], Path(sys.argv[2])
pipe = mlflow.transformers.load_model(f"models:/{name}@champion")
loaded = pipe.model.state_dict()
saved = {k: v for f in champion.glob("*.safetensors") for k, v in load_file(str(f)).items()}
common = [k for k in saved if k in loaded]
print(json.dumps({
    "tensors": len(common),
    "max_difference": max(float((loaded[k] - saved[k]).abs().max()) for k in common) if common else None,
}))
"""


def registry_elsewhere(project: Path, urls: dict, out: Path) -> dict:
    """Load the champion from the server's registry in a second clone of `project`, and
    check that its files are in the server's artifact store. {"skipped": why} when the
    gate promoted nothing or the project is not a git clone."""
    from mlflow.tracking import MlflowClient

    from stages import load_config

    name = load_config("gate", project / "params.yaml").registered_model
    client = MlflowClient(urls["mlflow"])
    try:
        version = client.get_model_version_by_alias(name, "champion")
    except Exception as error:  # noqa: BLE001 - the registry answers "not found" in several ways
        return {"skipped": f"no {name}@champion in the registry ({type(error).__name__}): the gate promoted nothing"}
    if not (project / ".git").exists():
        return {"skipped": f"{project} is not a git repository to clone"}
    second = out / "second-checkout"
    shutil.rmtree(second, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(project), str(second)], check=True, capture_output=True)
    env = {**stage_environment(None), "MLFLOW_TRACKING_URI": urls["mlflow"]}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_CHAMPION, name, str(project / "models/champion")],
        cwd=second, env=env, capture_output=True, text=True,
    )  # fmt: skip
    report = {"model": f"{name}/{version.version}", "source": version.source, "checkout": str(second)}
    if done.returncode:
        return {**report, "error": (done.stdout + done.stderr)[-2000:]}
    report.update(json.loads(done.stdout.strip().splitlines()[-1]))
    # Where the version's files are: an mlflow-artifacts: address is the server's store.
    model_id = version.model_id or (
        version.source.removeprefix("models:/") if version.source.startswith("models:/m-") else None
    )
    location = client.get_logged_model(model_id).artifact_location if model_id else version.source
    store = out / "servers" / "mlartifacts"
    report["artifact_location"] = location
    report["weights_in_server_store"] = location.startswith("mlflow-artifacts:") and any(
        (model_id or version.run_id) in str(f) for f in store.rglob("*.safetensors")
    )
    return report


def check(
    project: Path,
    out: Path,
    vary: str | None = None,
    ports: tuple = (None, None),
    shots: bool = True,
    restore: bool = True,
    running: dict | None = None,
    baseline: str | None = None,
) -> dict:
    """Run the flow (twice with `vary`, then `dvc repro` with the first params again unless
    not `restore`, its output in `<out>/restore.log`) against fresh servers and check both
    UIs' APIs; write `<out>/check.json` and the screenshots. Returns the report.

    `running`: the urls of servers that `servers(<out>/servers)` started and that already
    hold the project's first flow run, whose MLflow parent run is `baseline`: only the
    varied run is made (the end-to-end tests do so, after their own checks of that run)."""
    project, out = project.resolve(), out.resolve()
    if (out / "servers").exists() and running is None:
        shutil.rmtree(out / "servers")
    out.mkdir(parents=True, exist_ok=True)
    key, value = None, None
    if vary:
        key, sep, raw = vary.partition("=")
        if not sep:
            raise SystemExit(f"--vary {vary!r}: give KEY=VALUE, e.g. policy.dpo.beta=0.2")
        value = yaml.safe_load(raw)
        set_param((project / "params.yaml").read_text(), key, value)  # an unknown key fails here, first
    report: dict = {"project": str(project), "vary": vary}
    with nullcontext(running) if running else servers(out / "servers", *ports) as urls:
        report["servers"] = urls
        if running is None:
            run_flow(project, urls, out / "flow-1.log")
        if vary:
            original = (project / "params.yaml").read_text()
            try:
                (project / "params.yaml").write_text(set_param(original, key, value))
                run_flow(project, urls, out / "flow-2.log")
            finally:
                (project / "params.yaml").write_text(original)
        if vary and restore:
            # Against the servers too: a stage that reruns (the gate) logs there, not in your store.
            env = {**stage_environment(None), "MLFLOW_TRACKING_URI": urls["mlflow"]}
            restored = subprocess.run(
                [sys.executable, "-m", "dvc", "repro"], cwd=project, env=env, capture_output=True, text=True
            )
            (out / "restore.log").write_text(restored.stdout + restored.stderr)
            report["restored_first_run"] = restored.returncode == 0
            if restored.returncode:
                report["restore_error"] = (restored.stdout + restored.stderr)[-2000:]
        runs = pipeline_runs(urls["mlflow"])
        if baseline is not None:  # the first run to compare with, and the newest
            runs = [runs[0], *[r for r in runs if r.info.run_id == baseline]]
        newest = runs[0]
        flow_run_id = newest.data.tags["prefect.flow_run_id"]
        flow_run = get_json(f"{urls['prefect']}/flow_runs/{flow_run_id}")
        edges, dag = graph_edges(urls["prefect"], flow_run_id), dag_edges(project)
        report["prefect"] = {
            "flow_run": flow_run_id,
            "state": flow_run["state_type"],
            "graph_edges": len(edges),
            "dvc_dag_edges": len(dag),
            "missing_edges": sorted(map(list, dag - edges)),
            "extra_edges": sorted(map(list, edges - dag)),
        }
        report["mlflow"] = {
            "parent_run": newest.info.run_id,
            "metrics": len(newest.data.metrics),
            "params": len(newest.data.params),
            "headline": {
                k: v for k, v in newest.data.metrics.items() if k.startswith("gate.") or k.endswith(".accuracy")
            },
        }
        checks = {
            "prefect run completed": flow_run["state_type"] == "COMPLETED",
            "prefect graph has the edges of dvc dag": edges == dag and bool(dag),
            "mlflow parent run has headline metrics and params": bool(report["mlflow"]["headline"])
            and bool(newest.data.params),
        }
        report["registry"] = registry = registry_elsewhere(project, urls, out)
        if "skipped" not in registry:
            checks["champion loads from the registry in a second checkout"] = (
                registry.get("tensors", 0) > 0 and registry["max_difference"] == 0.0
            )
            checks["champion's weights are in the server's artifact store"] = registry["weights_in_server_store"]
        if vary:
            report["compare"] = compare(runs[1], runs[0])
            changed = set(report["compare"]["params_changed"])
            checks["compare shows exactly the varied param"] = changed == {key}
            checks["compare shows metrics that moved"] = bool(report["compare"]["metrics_moved"])
            if restore:
                checks["first run restored from the run-cache"] = report["restored_first_run"]
        if shots:
            report["screenshots"] = take_screenshots(
                out, urls, {"id": flow_run_id, "name": flow_run["name"]}, runs[:2] if vary else runs[:1]
            )
            for name, shot in report["screenshots"].items():
                if isinstance(shot, dict):
                    checks[f"screenshot {name} shows {shot['shows']!r}"] = shot["found"]
    report["checks"] = checks
    report["passed"] = all(checks.values())
    (out / "check.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    configure_environment()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="the project to run (default: here)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: <project>/reports/ui)")
    parser.add_argument("--vary", metavar="KEY=VALUE", help="a second run with this params.yaml key changed")
    parser.add_argument("--prefect-port", type=int)
    parser.add_argument("--mlflow-port", type=int)
    parser.add_argument("--no-screenshots", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or args.project / "reports/ui"
    report = check(args.project, out, args.vary, (args.prefect_port, args.mlflow_port), not args.no_screenshots)
    for name, passed in report["checks"].items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    if "compare" in report:
        print("params changed:", json.dumps(report["compare"]["params_changed"]))
        moved = report["compare"]["metrics_moved"]
        print(f"metrics moved ({len(moved)}):", ", ".join(f"{k} {a} -> {b}" for k, (a, b) in list(moved.items())[:12]))
    print(f"report: {out / 'check.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
