"""What the flow shows: a summary row per self-improvement round, the parent run's
headline metrics, and the tables it publishes as Prefect artifacts (flows/pipeline.py)."""

from __future__ import annotations


def test_the_flow_summary_has_a_row_per_round():
    from flows.pipeline import rounds_table

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
    from flows.pipeline import headline_metrics

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
    from flows.pipeline import table_artifacts

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
