"""The pipeline as a user sees it in both UIs (tests/ui_check.py): a real `prefect server`
and a real `mlflow server` on 127.0.0.1, two flow runs of a tiny project that differ in
one param, checked through the servers' APIs and photographed in a headless Chromium."""

from __future__ import annotations

import pytest

from tests.conftest import make_project

PNG = b"\x89PNG\r\n\x1a\n"


def test_set_param_changes_one_key_and_refuses_an_unknown_one():
    import yaml

    from tests.ui_check import set_param

    text = "policy:\n  dpo:\n    beta: 0.1  # comment\n  offline: [dpo]\n"
    assert yaml.safe_load(set_param(text, "policy.dpo.beta", 0.2)) == {
        "policy": {"dpo": {"beta": 0.2}, "offline": ["dpo"]}
    }
    with pytest.raises(SystemExit, match="policy.dpo.betta"):
        set_param(text, "policy.dpo.betta", 0.2)


def test_compare_lists_the_params_that_differ_and_the_metrics_that_moved():
    from types import SimpleNamespace

    from tests.ui_check import compare

    def run(params, metrics):
        return SimpleNamespace(data=SimpleNamespace(params=params, metrics=metrics))

    first = run({"a": "1", "b": "x"}, {"acc": 0.5, "kl": 0.1})
    second = run({"a": "2", "b": "x"}, {"acc": 0.5, "kl": 0.3, "new": 1.0})
    assert compare(first, second) == {
        "params_changed": {"a": ["1", "2"]},
        "metrics_moved": {"kl": [0.1, 0.3], "new": [None, 1.0]},
    }


@pytest.mark.slow
def test_two_runs_in_real_prefect_and_mlflow_servers(tmp_path, monkeypatch):
    from tests.browser import missing_browser
    from tests.ui_check import check

    root = make_project(tmp_path / "project")
    # A user's own experiment name: the flow logs there and the check looks there.
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "ui-check-experiment")
    # Without the tool's last step (dvc repro with the first params: the run-cache restore
    # that tests/test_pipeline_e2e.py checks), which would add half a minute here.
    report = check(root, root / "reports/ui", vary="policy.dpo.beta=0.4", restore=False)
    prefect = report["prefect"]
    assert prefect["state"] == "COMPLETED"
    # The run graph Prefect's page draws has every edge of `dvc dag` and no other.
    assert prefect["graph_edges"] == prefect["dvc_dag_edges"] > 10
    assert not prefect["missing_edges"] and not prefect["extra_edges"]
    assert {"dev.dpo.accuracy", "gate.promoted"} <= set(report["mlflow"]["headline"])
    # Compare of the two pipeline runs: the one param that changed, and what it moved.
    assert report["compare"]["params_changed"] == {"policy.dpo.beta": ["0.1", "0.4"]}
    moved = report["compare"]["metrics_moved"]
    assert any(name.startswith(("dev.dpo.", "test.dpo.")) for name in moved), moved
    assert not any(name.startswith(("dev.sft.", "test.sft.")) for name in moved), "SFT did not rerun"
    # The gate promoted the first run's DPO: a second clone pointed at the server loads it
    # from the registry, and its weights were uploaded to the server's store.
    registry = report["registry"]
    assert registry["tensors"] > 0 and registry["max_difference"] == 0.0, registry
    assert registry["artifact_location"].startswith("mlflow-artifacts:") and registry["weights_in_server_store"]
    if missing_browser():
        assert "skipped" in report["screenshots"]
    else:
        for name in ("prefect-flow-run.png", "mlflow-run.png", "mlflow-compare.png"):
            data = (root / "reports/ui" / name).read_bytes()
            assert data.startswith(PNG) and len(data) > 10_000, name
    assert report["passed"], report["checks"]
