"""The UI check's own parts (tests/ui_check.py). The check itself runs last in
tests/test_pipeline_e2e.py, on the servers that hold that module's first flow run: a second
run that differs in one param, both checked through the servers' APIs and photographed in a
headless Chromium."""

from __future__ import annotations

import pytest


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
