"""Every offline policy method for 2 steps on the micro model, full fine-tuning and LoRA:
the saved candidate is a plain model (adapters merged) whose weights differ from SFT's, and
the loss is finite."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import make_project
from tests.test_stages import changed, weights


@pytest.fixture(scope="module")
def sft_project(tmp_path_factory):
    import stages.base
    import stages.prepare
    import stages.sft

    root = make_project(tmp_path_factory.mktemp("methods") / "project")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for name in ("RLHF_PARENT_RUN_ID", "DVC_STAGE", "DVC_ROOT"):
            mp.delenv(name, raising=False)
        stages.prepare.main()
        stages.base.main()
        stages.sft.main()
    return root


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("method", ["dpo", "simpo", "orpo", "kto"])
def test_method_trains_and_saves_a_plain_model(sft_project, monkeypatch, method, lora):
    import stages.policy
    from stages import load_config

    monkeypatch.chdir(sft_project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sft_project / 'mlflow.db'}")
    config = load_config("policy")
    updates = {"max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1, "learning_rate": 1e-3}
    if lora:
        # LoRA's B starts at zero: a larger step makes the merged change visible at 2 steps.
        updates["lora"] = getattr(config, method).lora.model_copy(update={"enabled": True, "r": 4})
    params = getattr(config, method).model_copy(update=updates)
    config = config.model_copy(update={"methods": [method], method: params})

    out = sft_project / f"models/policy/{method}-{'lora' if lora else 'full'}"
    metrics, curve = stages.policy.run(config, method, out)
    assert metrics["steps"] == 2 and math.isfinite(metrics["train_loss"])
    assert len(curve) == 2 and all(math.isfinite(row["loss"]) for row in curve)
    assert not any(p.name.startswith("adapter") for p in out.iterdir()), "adapters are merged on save"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert changed(weights(sft_project / "models/sft"), weights(out))
