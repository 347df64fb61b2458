"""What the flow shows: a summary row per self-improvement round, the parent run's
headline metrics, and the tables it publishes as Prefect artifacts (flows/summary.py), and
the flow's own checks and scheduling (flows/pipeline.py)."""

from __future__ import annotations

import pytest


def test_the_flow_summary_has_a_row_per_round():
    from flows.summary import rounds_table

    accuracy = {"accuracy": 0.5, "accuracy_low": 0.4, "accuracy_high": 0.6}
    rounds = {
        "r1": {"passed": True, "data": {"kept_samples": 30, "samples": 80}, "candidate_eval": {"dev_long": accuracy}},
        "r2": {"passed": False, "data": {"kept_samples": 0, "samples": 80}, "failures": ["progress: fails"]},
        "r3": {"passed": None, "stopped_at": "r2"},
    }
    table = rounds_table(rounds)
    assert table[3] == "| round | kept / samples | dev_long accuracy [95% CI] | verdict |"
    assert table[5] == "| r1 | 30 / 80 | 0.500 [0.400, 0.600] | passed: the candidate is the winner |"
    assert table[6] == "| r2 | 0 / 80 | n/a | stopped: progress: fails |"
    assert table[7] == "| r3 | n/a | n/a | not run: the loop stopped at round r2 |"


def test_the_parent_run_headline_has_each_models_suite_metrics_and_each_round():
    from flows.summary import headline_metrics

    metrics = {
        "eval": {"suites": {"dev": {"sft": {"accuracy": 0.5, "kl_to_ref": 0.0}, "dpo": {"accuracy": 0.7}}}},
        "rm": {"ensemble_accuracy": 0.9},
        "gate": {"promoted": True, "candidates": {"dpo": {"passed": True}}},
        "rounds": {"r1": {"passed": False, "candidate_eval": {"dev_long": {"accuracy": 0.1}}}},
    }
    assert headline_metrics(metrics) == {
        "dev.sft.accuracy": 0.5,
        "dev.sft.kl_to_ref": 0.0,
        "dev.dpo.accuracy": 0.7,
        "rm.ensemble_accuracy": 0.9,
        "gate.promoted": 1.0,
        "gate.dpo.passed": 1.0,
        "round.r1.passed": 0.0,
        "round.r1.dev_long.accuracy": 0.1,
    }


def test_the_tables_are_the_eval_the_gate_verdict_and_the_strategies():
    from flows.summary import table_artifacts

    metrics = {
        "eval": {"suites": {"dev": {"sft": {"accuracy": 0.5}, "dpo": {"accuracy": 0.7, "kl_to_ref": 0.2}}}},
        "gate": {"candidates": {"dpo": {"tests": [{"name": "kl", "passed": False, "reason": "0.2 <= 0.1 fails"}]}}},
        "infer": {"strategies": {"greedy": {"accuracy": 0.6, "seconds": 1.5}}},
    }
    tables = table_artifacts(metrics)
    assert list(tables) == ["eval-table", "gate-verdict", "inference-table"]
    assert [(r["suite"], r["model"], r["accuracy"]) for r in tables["eval-table"]] == [
        ("dev", "sft", 0.5),
        ("dev", "dpo", 0.7),
    ]
    assert tables["gate-verdict"] == [{"candidate": "dpo", "test": "kl", "passed": False, "reason": "0.2 <= 0.1 fails"}]
    assert tables["inference-table"][0]["strategy"] == "greedy" and tables["inference-table"][0]["seconds"] == 1.5
    assert table_artifacts({}) == {}


def test_slots_run_at_most_jobs_stages_and_split_the_cores_among_those_that_can_run():
    """a, then b and c side by side (each half the cores: both are ready when a ends), then
    d alone (None: torch's default, every core). With jobs 1 nothing is ever shared."""
    import threading

    from flows.processes import Slots

    upstream = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}
    slots = Slots(2, upstream, cores=4)
    with slots.take("a") as threads:
        assert threads is None and slots.ready() == set(), "a alone: nothing else is ready"
    assert slots.ready() == {"b", "c"}
    with slots.take("b") as b_threads:
        waiting = slots.take("x")  # a third stage (held here, so that it keeps its slot)
        third = threading.Thread(target=waiting.__enter__)
        with slots.take("c") as c_threads:
            assert (b_threads, c_threads) == (2, 2)
            third.start()
            third.join(timeout=0.3)
            assert third.is_alive() and "x" not in slots.running, "no third slot while b and c run"
    third.join(timeout=5)
    assert "x" in slots.running, "the waiting stage gets the slot once one is free"
    waiting.__exit__(None, None, None)
    with slots.take("d") as threads:
        assert threads is None
    assert slots.done == {"a", "b", "c", "d", "x"}

    one = Slots(1, upstream, cores=4)
    with one.take("a"):
        pass
    with one.take("b") as threads:
        assert threads is None, "jobs 1: a stage always runs alone"


def test_a_failed_stage_does_not_make_its_downstream_ready():
    from flows.processes import Slots

    slots = Slots(2, {"a": [], "b": ["a"], "c": []}, cores=2)
    try:
        with slots.take("a"):
            raise RuntimeError("stage a failed")
    except RuntimeError:
        pass
    assert "a" not in slots.done and slots.ready() == {"c"}


@pytest.mark.slow  # seconds (a DVC repo, stage processes or training): out of the quick tier
def test_the_default_is_one_stage_at_a_time_when_a_stage_has_several_processes(tmp_path):
    import yaml

    from flows.processes import default_jobs, machine_cores

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"compute": {"launcher": "torchrun", "processes": 2}}))
    assert default_jobs(tmp_path) == 1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"compute": {"device": "cpu"}}))
    assert default_jobs(tmp_path) in ((1,) if machine_cores() < 2 else (1, 2))


def test_the_summary_of_a_run_whose_rm_dropped_out_and_with_a_harness_task():
    """No preference data: metrics/rm.json says why the RM dropped out (so does the PRM's);
    a harness task's suite holds lm-eval's metrics, not evaluate's. The summary says so and
    still ends with the gate (it raised a KeyError after every stage had run)."""
    from flows.summary import summary_markdown

    metrics = {
        "rm": {"absent": "no preference pairs"},
        "prm": {"absent": "no step labels"},
        "eval": {
            "suites": {
                "dev": {"sft": {"accuracy": 0.5, "kl_to_ref": 0.0}, "dpo": {"accuracy": 0.7}},
                "harness/rlhf_dev": {"sft": {"accuracy": 0.5, "accuracy_stderr": 0.05}},
            }
        },
        "gate": {"promote": None, "promoted": False, "champion": None, "candidates": {"dpo": {"passed": True}}},
    }
    markdown = summary_markdown([{"stage": "sft", "status": "ran", "seconds": 1.0}], metrics)
    assert (
        "Stage rm dropped out: no preference pairs" in markdown and "Stage prm dropped out: no step labels" in markdown
    )
    assert "| dpo | 0.700 | n/a | n/a | n/a | n/a |" in markdown
    assert "## Harness task `rlhf_dev`" in markdown and "| sft | accuracy 0.500, accuracy_stderr 0.050 |" in markdown
    assert markdown.rstrip().endswith("- dpo: pass")


@pytest.mark.slow  # seconds (a DVC repo, stage processes or training): out of the quick tier
def test_force_names_stages_or_groups_and_a_typo_fails_before_any_stage():
    """`--force policy` forces each policy stage; a name that is no stage fails naming it
    (it forced nothing, and the run said every stage was up to date); `--force` alone
    is an error, not a run that forces nothing."""
    import pytest

    from flows.pipeline import ForceError, forced_stages, main

    order = ["prepare", "sft", "policy@dpo", "policy@kto", "gate"]
    assert forced_stages({"sft", "policy"}, order) == {"sft", "policy@dpo", "policy@kto"}
    assert forced_stages({"policy@kto"}, order) == {"policy@kto"}
    with pytest.raises(ForceError, match=r"^--force sfft: no such stage in dvc.yaml; its stages are prepare, sft"):
        forced_stages({"sft", "sfft"}, order)
    with pytest.raises(SystemExit, match=r"^flows.pipeline: --force sfft: no such stage in dvc.yaml"):
        main(["--force", "sfft"])
    with pytest.raises(SystemExit):
        main(["--force"])


def test_reports_of_stages_that_did_not_complete_are_not_this_runs(tmp_path):
    """A stage that failed or did not run left an earlier run's report: the summary and
    the parent run leave it out. A gate that was up to date decided nothing in this run."""
    import json

    from flows.summary import read_metrics, summary_markdown

    (tmp_path / "metrics").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "metrics/sft.json").write_text(json.dumps({"accuracy": 0.5}))
    gate = {"promoted": True, "promote": "dpo", "champion": "dpo", "candidates": {}}
    (tmp_path / "reports/gate.json").write_text(json.dumps(gate))
    assert read_metrics(tmp_path)["gate"] == gate
    current = read_metrics(tmp_path, current={"sft"})
    assert current["sft"] == {"accuracy": 0.5} and current["gate"] is None
    skipped = [{"stage": "gate", "status": "skipped", "seconds": 1.0}]
    assert "## Gate: not run, its inputs are unchanged (champion: dpo)" in summary_markdown(skipped, {"gate": gate})
    ran = [{"stage": "gate", "status": "ran", "seconds": 1.0}]
    assert "## Gate: promoted **dpo** (champion: dpo)" in summary_markdown(ran, {"gate": gate})


def test_the_flow_checks_params_and_the_tracking_uri_before_reading_them(tmp_path, monkeypatch):
    """The flow reads params.yaml (the default --jobs, DVC's stage graph) before stage
    check_params runs: a wrong type there failed with DVC's or Python's traceback; a bare
    path as MLFLOW_TRACKING_URI with MLflow's."""
    import shutil

    import pytest
    import yaml

    from flows.pipeline import check_inputs
    from rlhf.params import ParamsError
    from rlhf.tracking.runs import TrackingURIError
    from tests.conftest import REPO

    shutil.copytree(REPO / "stages", tmp_path / "stages")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["policy"]["offline"] = "dpo"
    params["compute"]["processes"] = "two"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParamsError, match=r"compute.processes: .*\n.*policy.offline: "):
        check_inputs(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "store"))
    with pytest.raises(TrackingURIError, match="MLFLOW_TRACKING_URI=.*store: a path, not a URI"):
        check_inputs(tmp_path)
