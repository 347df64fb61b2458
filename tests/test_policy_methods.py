"""Every TRL-backed policy method for 2 steps on the micro model, full fine-tuning and LoRA:
the saved candidate is a plain model (adapters merged) whose weights differ from SFT's, and
the loss is finite."""

from __future__ import annotations

import functools
import json
import math

import pytest

from tests.conftest import make_project, run_stages_in
from tests.test_stages import changed, weights

pytestmark = pytest.mark.slow  # trains real models: the full suite runs it, the quick tier does not


@pytest.fixture(scope="module")
def sft_project(tmp_path_factory):
    import stages.base
    import stages.prepare
    import stages.rm
    import stages.sft

    root = make_project(tmp_path_factory.mktemp("methods") / "project")
    with pytest.MonkeyPatch.context() as mp:
        run_stages_in(mp, root, f"sqlite:///{root / 'mlflow.db'}")
        stages.prepare.main()
        stages.base.main()
        stages.sft.main()
        stages.rm.main()
    return root


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("method", ["dpo", "simpo", "orpo", "kto", "grpo", "rloo", "ppo"])
def test_method_trains_and_saves_a_plain_model(sft_project, monkeypatch, method, lora):
    import stages.policy
    from rlhf.tasks import get_task
    from stages import load_config

    monkeypatch.chdir(sft_project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sft_project / 'mlflow.db'}")
    config = load_config("policy")
    updates = {"max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1, "learning_rate": 1e-3}
    if method in ("grpo", "rloo"):
        # Two prompts of two completions per step, scored by the (micro) RM ensemble: a
        # reward that varies continuously, so that the advantages are not all zero.
        rewards = [{"name": "reward_model"}, {"name": "answer_match", "weight": 0.0}]  # the second: accuracy
        updates |= {"num_generations": 2, "max_completion_length": 8, "rewards": rewards}
    if method == "ppo":
        del updates["per_device_train_batch_size"]  # PPO's batches are rollout_batch_size and mini_batch_size
        updates |= {
            "rollout_batch_size": 4,
            "mini_batch_size": 2,
            "max_new_tokens": 8,
            "rewards": [{"name": "reward_model"}],
        }
    if lora:
        # LoRA's B starts at zero: the merged change is B·A, small after 2 steps (the test asserts it is not 0).
        updates["lora"] = {"enabled": True, "r": 4}
    params = getattr(config, method)
    params = type(params).model_validate({**params.model_dump(exclude_unset=True), **updates})
    listed = "offline" if method in stages.policy.OFFLINE_METHODS else "online"
    config = config.model_copy(update={"offline": [], "online": [], listed: [method], method: params})

    out = sft_project / f"models/policy/{method}-{'lora' if lora else 'full'}"
    metrics, curve = stages.policy.run(config, get_task(), method, out)
    assert metrics["steps"] == 2 and math.isfinite(metrics["train_loss"])
    assert len(curve) == 2 and all(math.isfinite(row["loss"]) for row in curve)
    # The curves `dvc plots show` draws: the loss always, a reward where the method has one.
    plotted = stages.policy.plotted_curves(curve)
    assert [row["loss"] for row in plotted["loss"]] == [row["loss"] for row in curve]
    if method in ("dpo", "grpo", "rloo", "ppo"):
        (name,) = set(plotted["reward"][0]) - {"step"}
        assert name == {"dpo": "rewards/margins", "ppo": "score"}.get(method, "reward")
        assert len(plotted["reward"]) == 2 and all(math.isfinite(row[name]) for row in plotted["reward"])
    if method in ("grpo", "rloo"):
        assert set(plotted["accuracy"][0]) == {"step", "rewards/1_answer_match/mean"}, "TRL's name for the reward"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert changed(weights(sft_project / "models/sft"), weights(out))
    if method != "ppo":  # PPO, our own loop, merges its adapter and keeps none
        assert (out / "adapter").is_dir() == lora, "a LoRA run keeps its adapter beside the merged model"
    if lora and method != "ppo":
        assert_adapter_loads_back(out, sft_project / "models/sft")


def assert_adapter_loads_back(out, base_dir):
    """The adapter in out/adapter loads onto the base with peft, and merged, it gives the
    saved (merged) weights; the merged folder loads with plain transformers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(out / "adapter")).merge_and_unload().state_dict()
    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert merged.keys() == plain.keys()
    assert all(torch.allclose(merged[k], plain[k], atol=1e-6) for k in plain)


def test_reference_logps_are_computed_once_per_reference_and_data(sft_project, monkeypatch, tmp_path):
    """A beta sweep computes DPO's reference log-probs once: the second run (another beta)
    loads them; changing the tokenisation (max_length) is a new entry; and recomputing an
    entry after deleting it gives the same numbers (the key is stable, the values exact)."""
    import pyarrow.parquet as pq

    import stages.policy
    from rlhf.tasks import get_task
    from rlhf.training.ref_logprobs import CACHE_DIR_ENV
    from stages import load_config

    monkeypatch.chdir(sft_project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sft_project / 'mlflow.db'}")
    cache = tmp_path / "ref-cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache))
    config = load_config("policy")

    def run_dpo(**updates):
        params = config.dpo.model_copy(update={"max_steps": 1, "per_device_train_batch_size": 4, **updates})
        out = tmp_path / "dpo"
        metrics, _ = stages.policy.run(config.model_copy(update={"dpo": params}), get_task(), "dpo", out)
        return metrics

    # One step of 4 rows draws under half of the 64 pairs: `auto` scores the reference per batch.
    small = run_dpo(beta=0.1, precompute_ref_log_probs="auto")
    assert small["reference_precomputed"] is False and "ref_logps_cache_hit" not in small
    assert not cache.exists() or not list(cache.glob("*.parquet"))
    assert run_dpo(beta=0.1, max_steps=8, precompute_ref_log_probs="auto")["reference_precomputed"] is True
    for entry in cache.glob("*.parquet"):
        entry.unlink()

    run_dpo = functools.partial(run_dpo, precompute_ref_log_probs=True)  # a sweep asks for the cache
    assert run_dpo(beta=0.1)["ref_logps_cache_hit"] is False
    entries = sorted(cache.glob("*.parquet"))
    assert len(entries) == 1
    first = pq.read_table(entries[0])
    assert first.column_names == ["ref_chosen_logps", "ref_rejected_logps"]
    assert first.num_rows == 64  # every preference pair of the tiny project

    assert run_dpo(beta=0.5)["ref_logps_cache_hit"] is True
    assert sorted(cache.glob("*.parquet")) == entries

    assert run_dpo(beta=0.5, max_length=48)["ref_logps_cache_hit"] is False
    assert len(list(cache.glob("*.parquet"))) == 2

    entries[0].unlink()
    assert run_dpo(beta=0.3)["ref_logps_cache_hit"] is False
    assert pq.read_table(entries[0]).equals(first)


def test_auto_precomputes_reference_logps_when_the_run_draws_half_the_rows_or_more():
    from rlhf.training.methods.dpo import Params as DPOParams
    from rlhf.training.params import precompute_reference

    ten_steps = DPOParams(max_steps=10, per_device_train_batch_size=32)  # 320 rows a process
    assert precompute_reference(ten_steps, rows=169_000, processes=1) is False
    assert precompute_reference(ten_steps, rows=640, processes=1) is True  # 320 is half
    assert precompute_reference(ten_steps, rows=641, processes=1) is False
    assert precompute_reference(ten_steps, rows=1280, processes=2) is True
    accumulated = ten_steps.model_copy(update={"gradient_accumulation_steps": 4})
    assert precompute_reference(accumulated, rows=2560, processes=1) is True
    assert precompute_reference(ten_steps.model_copy(update={"max_steps": None}), rows=10**9, processes=1) is True
    for asked in (True, False):
        forced = ten_steps.model_copy(update={"precompute_ref_log_probs": asked})
        assert precompute_reference(forced, rows=169_000, processes=1) is asked
    assert DPOParams().precompute_ref_log_probs == "auto"


@pytest.mark.parametrize("method", ["simpo", "orpo", "dpo", "kto"])
def test_rows_whose_prompt_fills_max_length_are_left_out_and_counted(sft_project, monkeypatch, method):
    """max_length at the median prompt length: TRL's CPO (SimPO) and ORPO would cut those
    rows' completions to nothing (their mean log-prob 0/0 turned every weight into NaN),
    DPO and KTO drop them without a count. They are left out before training and counted in
    `dropped_rows`; the saved weights are finite. A max_length no prompt fits in fails
    naming its key, before any training."""
    import torch
    from safetensors.torch import load_file

    import stages.policy
    from rlhf.models.generation import format_prompt
    from rlhf.models.loading import load_tokenizer
    from rlhf.tasks import get_task
    from stages import load_config

    monkeypatch.chdir(sft_project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sft_project / 'mlflow.db'}")
    tokenizer = load_tokenizer(sft_project / "models/sft")
    table = "unpaired" if method == "kto" else "prefs"
    prompts = __import__("pandas").read_parquet(sft_project / f"data/prepared/{table}.parquet")["prompt"]
    lengths = sorted(
        len(tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts
    )
    max_length = lengths[len(lengths) // 2]
    config = load_config("policy")
    updates = {"max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1, "learning_rate": 1e-3}
    params = getattr(config, method)
    params = type(params).model_validate({**params.model_dump(exclude_unset=True), **updates, "max_length": max_length})
    config = config.model_copy(update={"offline": [method], "online": [], method: params})
    out = sft_project / f"models/policy/{method}-short"
    metrics, _ = stages.policy.run(config, get_task(), method, out)
    assert metrics["dropped_rows"] == sum(n >= max_length for n in lengths) > 0
    assert all(torch.isfinite(t).all() for t in load_file(out / "model.safetensors").values())

    short = type(params).model_validate({**params.model_dump(), "max_length": lengths[0]})
    with pytest.raises(ValueError, match=rf"policy.{method}.max_length {lengths[0]}: every prompt of .* fills it"):
        stages.policy.run(config.model_copy(update={method: short}), get_task(), method, sft_project / "unused")


def test_ppo_leaves_out_prompts_that_leave_no_room_for_a_response(sft_project, monkeypatch):
    """PPO's rollouts keep max_new_tokens of max_length for the response and cut a longer
    prompt's start (its question gone, a silent change of the task). Such prompts are left
    out before any model loads and counted in `dropped_rows`; none fitting fails naming
    policy.ppo.max_length and the least value that fits."""
    import pandas as pd

    import stages.policy
    from rlhf.models.generation import format_prompt
    from rlhf.models.loading import load_tokenizer
    from rlhf.tasks import get_task
    from stages import load_config

    monkeypatch.chdir(sft_project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sft_project / 'mlflow.db'}")
    tokenizer = load_tokenizer(sft_project / "models/sft")
    prompts = pd.read_parquet(sft_project / "data/prepared/prompts.parquet")["prompt"]
    lengths = sorted(
        len(tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts
    )
    new_tokens, median = 8, lengths[len(lengths) // 2]
    config = load_config("policy")
    updates = {"max_steps": 1, "rollout_batch_size": 4, "mini_batch_size": 2, "max_new_tokens": new_tokens}
    updates |= {"logging_steps": 1, "rewards": [{"name": "reward_model"}], "max_length": median + new_tokens}
    params = type(config.ppo).model_validate({**config.ppo.model_dump(exclude_unset=True), **updates})
    config = config.model_copy(update={"offline": [], "online": ["ppo"], "ppo": params})
    metrics, _ = stages.policy.run(config, get_task(), "ppo", sft_project / "models/policy/ppo-short")
    assert metrics["dropped_rows"] == sum(n > median for n in lengths) > 0

    short = type(params).model_validate(
        {**params.model_dump(exclude_unset=True), "max_length": lengths[0] + new_tokens - 1}
    )
    with pytest.raises(
        ValueError, match=rf"policy.ppo.max_length {lengths[0] + new_tokens - 1}: every prompt .* at least "
        rf"{lengths[0] + new_tokens}"
    ):  # fmt: skip
        stages.policy.run(config.model_copy(update={"ppo": short}), get_task(), "ppo", sft_project / "unused")


def test_the_ewc_penalty_of_a_lora_run_is_reported_before_the_merge(sft_project, monkeypatch):
    """With LoRA, EWC pulls the adapter's weights; the reported penalty is read before the
    adapter is merged away (after the merge the parameters it names are gone and it read 0)."""
    import stages.policy
    from rlhf.tasks import get_task
    from stages import load_config

    monkeypatch.chdir(sft_project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{sft_project / 'mlflow.db'}")
    config = load_config("policy")
    updates = {
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "lora": {"enabled": True, "r": 4},
        "ewc": {"strength": 1000.0, "samples": 16},
    }
    params = type(config.dpo).model_validate({**config.dpo.model_dump(exclude_unset=True), **updates})
    config = config.model_copy(update={"offline": ["dpo"], "online": [], "dpo": params})
    metrics, _ = stages.policy.run(config, get_task(), "dpo", sft_project / "models/policy/dpo-lora-ewc")
    assert metrics["ewc_penalty"] > 0


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.parametrize("bos_default", [False, True], ids=["no-bos", "llama-bos"])
@pytest.mark.parametrize("method", ["simpo", "orpo"])
def test_simpo_and_orpo_train_on_the_prompt_tokens_generation_reads(method, bos_default, chat):
    """TRL's CPO and ORPO put a BOS before every prompt that lacks one, whatever the
    tokenizer's default. The pipeline samples a prompt as the tokenizer reads text by
    default (`format_prompt`): no BOS for the built-in tokenizer, one for a Llama-style
    tokenizer. The trainers' tokenized prompts match that, with the tokenizer the stage
    gives them (`without_forced_bos`)."""
    import pandas as pd
    from datasets import Dataset
    from tokenizers import processors

    from rlhf.models.generation import format_prompt
    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.training.trl_training import without_forced_bos

    tokenizer = build_tokenizer()
    if bos_default:
        tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)]
        )
    table = pd.DataFrame(
        {"prompt": ["12+7\n", "3+4+5\n"], "chosen": ["answer 19", "answer 12"], "rejected": ["answer 1", "answer 2"]}
    )
    if chat:  # a template that writes the BOS itself (Llama 3's, Gemma's): the trained prompt keeps it
        tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template

        def turn(role, text):
            return [{"role": role, "content": text}]

        table = pd.DataFrame(
            {
                "prompt": [turn("user", p) for p in table["prompt"]],
                "chosen": [turn("assistant", c) for c in table["chosen"]],
                "rejected": [turn("assistant", r) for r in table["rejected"]],
            }
        )
    trainer_tokenizer, trained = without_forced_bos(tokenizer, Dataset.from_pandas(table, preserve_index=False))
    if method == "simpo":
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    args = Config(output_dir="unused", max_length=64, report_to=[], use_cpu=True)
    model = build_tiny_model("micro", tokenizer, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=trained, processing_class=trainer_tokenizer)
    for row, prompt in zip(trainer.train_dataset, table["prompt"]):
        read = tokenizer(format_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        assert row["prompt_input_ids"] == read
        assert (read[0] == tokenizer.bos_token_id) == (bos_default or chat)
        assert row["chosen_input_ids"][: len(read)] == read
