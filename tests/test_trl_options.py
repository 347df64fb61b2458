"""The `trl:` mapping of a training block: any option of the method's TRL config, checked
before any compute against that config's fields (recorded in rlhf/training/trl_fields.json,
so that the check imports no TRL), and passed to the trainer unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, assert_each_once, params_problems, tiny_params


def test_the_recorded_fields_are_the_installed_trls():
    """trl_fields.json was written from the installed TRL and transformers: the same
    versions, and for every config class the same fields as the imported class has."""
    from rlhf.training import trl_options

    recorded = json.loads(trl_options.SNAPSHOT.read_text())
    assert recorded["versions"] == trl_options.installed_versions()
    for name in trl_options.CONFIG_MODULES:
        assert recorded["configs"][name] == trl_options.imported_fields(name), name
    # Every training block names a config the file holds (or none: our own trainer).
    from rlhf.training.methods import METHODS
    from stages import all_configs

    blocks = [module.Params for module in METHODS.values()] + [all_configs()[s] for s in ("rm", "prm")]
    assert {b.TRL_CONFIG for b in blocks} - {None} <= set(recorded["configs"])


def test_other_installed_versions_read_the_fields_from_trl_itself(monkeypatch):
    """A TRL or transformers other than the recorded one: the check imports the config
    class instead of trusting the file (a field added or removed is then seen)."""
    from rlhf.training import trl_options

    trl_options.config_fields.cache_clear()
    monkeypatch.setattr(trl_options, "installed_versions", lambda: {"trl": "9.9.9", "transformers": "9.9.9"})
    imported = []
    original = trl_options.imported_fields
    monkeypatch.setattr(trl_options, "imported_fields", lambda name: imported.append(name) or original(name))
    try:
        assert "use_vllm" in trl_options.config_fields("GRPOConfig")
        assert imported == ["GRPOConfig"]
    finally:
        trl_options.config_fields.cache_clear()


def test_a_bad_trl_key_is_named_with_its_method_before_any_stage(tmp_path):
    """An option unknown to the method's TRL config (with the close ones), one the pipeline
    owns, one the block sets from its own key, one SimPO fixes, and epochs beside a step
    budget: each named by its section and key, all at once."""
    params = tiny_params()
    params["policy"]["offline"] = ["dpo", "simpo"]
    params["policy"]["dpo"]["trl"] = {"bta": 0.2, "output_dir": "/tmp/x", "learning_rate": 1e-3}
    params["policy"]["simpo"] = {"trl": {"cpo_alpha": 1.0}}
    params["policy"]["grpo"]["trl"] = {"num_train_epochs": 2}
    params["sft"]["trl"] = {"packing": True, "seeed": 1}
    problems = params_problems(tmp_path, params)
    assert_each_once(
        problems,
        [
            "policy.dpo.trl: bta: not an option of TRL's DPOConfig (did you mean beta",
            "sft.trl: seeed: not an option of TRL's SFTConfig",
            "policy.simpo.trl: cpo_alpha: the method fixes it (0.0); remove it from trl",
            "policy.grpo: trl.num_train_epochs: max_steps (100) overrides it in TRL; set max_steps: null",
        ],
    )
    dpo = next(p for p in problems if p.startswith("policy.dpo.trl"))
    assert "output_dir: the pipeline sets it (checkpoints go to checkpoints/" in dpo
    assert "learning_rate: set by this section's own key 'learning_rate'" in dpo
    assert len(problems) == 4


def test_trl_keys_validate_without_importing_trl(tmp_path):
    """A params file with `trl:` keys in every TRL-backed block validates in a fresh process
    that never imports TRL, transformers or torch (the check reads trl_fields.json)."""
    params = tiny_params()
    params["policy"]["offline"] = ["dpo", "simpo", "orpo", "kto"]
    params["policy"]["online"] = ["grpo", "rloo"]
    for method in ("dpo", "simpo", "orpo", "kto", "grpo", "rloo"):
        params["policy"].setdefault(method, {})["trl"] = {"optim": "adafactor", "save_total_limit": 2}
    params["sft"]["trl"] = {"packing": True}
    params["rm"]["trl"] = {"optim": "adafactor"}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    code = (
        "import sys, stages; stages.load_all(sys.argv[1]); "
        "print([m for m in ('trl', 'transformers', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_trl_options_reach_the_trainer_args(in_project, monkeypatch):
    """DPO with `trl:` options (epochs instead of steps, an optimizer, how many checkpoints
    to keep) and model.gradient_checkpointing: the built trainer's args carry them, and
    the trainer trains with that optimizer. GRPO's use_vllm and vllm_mode reach the
    GRPOConfig the stage builds; without vLLM installed the stage stops before any model
    loads, naming the key."""
    import rlhf.models.settings as model_settings
    import stages.base
    import stages.policy
    import stages.prepare
    import stages.sft
    from rlhf.tasks import get_task
    from rlhf.training import trl_training
    from stages import load_config

    stages.prepare.main()
    stages.base.main()
    stages.sft.main()
    config = load_config("policy")
    dpo = config.dpo.model_copy(
        update={
            "max_steps": None,
            "trl": {"num_train_epochs": 1, "optim": "adafactor", "save_total_limit": 3},
            "per_device_train_batch_size": 32,
        }
    )
    seen = {}
    original = trl_training.consolidate_on_sft

    def capture(model, examples, params, accumulation=1, trainer=None, ewc=None):
        seen["trainer"] = trainer
        return original(model, examples, params, accumulation, trainer, ewc)

    monkeypatch.setattr(trl_training, "consolidate_on_sft", capture)
    model_settings.configure(model_settings.ModelSettings(gradient_checkpointing=True))
    try:
        metrics, _ = stages.policy.run(config.model_copy(update={"dpo": dpo}), get_task(), "dpo", in_project / "out")
    finally:
        model_settings.configure(None)
    args = seen["trainer"].args
    assert (args.num_train_epochs, args.max_steps, args.optim, args.save_total_limit) == (1, -1, "adafactor", 3)
    assert args.activation_checkpointing is True
    assert type(seen["trainer"].optimizer.optimizer).__name__ == "Adafactor"
    assert metrics["steps"] == 2  # one epoch of the tiny project's 64 pairs, 32 a step

    from trl import GRPOConfig

    from rlhf.training.trainer_setup import trl_config

    grpo = config.grpo.model_copy(update={"trl": {"use_vllm": True, "vllm_mode": "colocate"}})
    args = trl_config(GRPOConfig, grpo, in_project / "checkpoints" / "grpo", key="policy.grpo")
    assert (args.use_vllm, args.vllm_mode, args.num_generations) == (True, "colocate", grpo.num_generations)
    if __import__("importlib").util.find_spec("vllm") is None:
        online = config.model_copy(update={"online": ["grpo"], "grpo": grpo})
        with pytest.raises(ImportError, match=r"policy.grpo.trl.use_vllm: TRL generates with vLLM, which is not"):
            stages.policy.run(online, get_task(), "grpo", in_project / "never")
        assert not (in_project / "never").exists()


@pytest.mark.slow
def test_a_value_trl_refuses_names_the_block(in_project):
    """A `trl:` value TRL's own config refuses (a known key, a bad value) fails when the
    stage builds the config, before the model loads, naming the block's key."""
    from trl import DPOConfig

    from rlhf.training.methods.dpo import Params
    from rlhf.training.trainer_setup import TrainingConfigError, trl_config

    params = Params(trl={"optim": "no-such-optimizer"})
    with pytest.raises(TrainingConfigError, match=r"^policy.dpo.trl: TRL's DPOConfig refused these options"):
        trl_config(DPOConfig, params, in_project / "checkpoints", key="policy.dpo")
