"""The reward-model stage and the likelihood reward model: response boundaries, features
checked by hand, the Bradley-Terry head fit, training (full and LoRA), resume, both kinds
through the stage, and the ensemble loading either kind. Training runs use the micro model
for 2-4 steps."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from rlhf.models.loading import build_tokenizer, load_causal_lm
from rlhf.rewards.ensemble import RewardEnsemble, pairwise_accuracy
from rlhf.rewards.likelihood_rm import HEAD_FILE, LikelihoodRewardModel, encode, response_features
from rlhf.rewards.likelihood_rm_training import LikelihoodRewardTrainer, ResponseMaskCollator, fit_head, pairs_dataset
from rlhf.tasks import TaskConfig, get_task
from rlhf.tasks.arithmetic import FLAW_KINDS, TaskSizes, TaskSpec, generate_datasets
from rlhf.training.params import TrainingParams
from rlhf.training.trainer_setup import train_resumable, trl_config
from tests.conftest import REPO


@pytest.mark.slow  # a fresh Python importing torch and transformers: 10 s of the quick tier's minute
def test_scoring_with_reward_models_imports_no_training_library():
    """Evaluate, infer and improve score with the reward ensemble and the PRMs: the modules
    they import for it load no TRL (about 2 s a stage process, as the likelihood RM's
    trainer was once imported with its model)."""
    code = (
        "import sys, rlhf.rewards.ensemble, rlhf.rewards.likelihood_rm, rlhf.inference.strategies, "
        "rlhf.evaluation.suites; print(sorted(m for m in ('trl', 'transformers.trainer') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def weights(model_dir) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(str(file)).items()}


def write_pairs(root, train_rows: int = 16, eval_rows: int = 8):
    sizes = TaskSizes(
        **{**dict.fromkeys(TaskSizes.__dataclass_fields__, 0), "prefs": train_rows, "prefs_eval": eval_rows}
    )
    data = generate_datasets(TaskSpec(), sizes, seed=0)
    folder = Path(root) / "data/prepared"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("prefs", "prefs_eval"):
        pd.DataFrame(data[name]).to_parquet(folder / f"{name}.parquet")
    return folder / "prefs.parquet", folder / "prefs_eval.parquet"


def test_the_response_starts_where_the_prompt_ends():
    """Char-level tokens: "1+2\\n" is positions 0-3, so the response starts at 4; the reward
    text ends with EOS. A conversational prompt starts it after the assistant marker."""
    tokenizer = build_tokenizer()
    ids, start = encode(tokenizer, "1+2\n", "1+2=3; answer 3")
    assert tokenizer.decode(ids) == "1+2\n1+2=3; answer 3</s>" and start == 4
    chat_ids, chat_start = encode(
        tokenizer, [{"role": "user", "content": "1+2"}], [{"role": "assistant", "content": "answer 3"}]
    )
    assert tokenizer.decode(chat_ids[:chat_start]) == "<|user|>1+2<|end|><|assistant|>"
    assert tokenizer.decode(chat_ids[chat_start:]).startswith("answer 3")


def test_response_features_by_hand():
    """Row 1 reads tokens 1-2 of [-1, -3, -0.5, -2]: min -3, mean -1.75. Row 2 reads all
    four of [-0.1, -0.2, -0.3, -0.4]: min -0.4, mean -0.25."""
    logps = torch.tensor([[-1.0, -3.0, -0.5, -2.0], [-0.1, -0.2, -0.3, -0.4]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    expected = torch.tensor([[-3.0, -1.75], [-0.4, -0.25]])
    assert torch.allclose(response_features(logps, mask), expected)


def test_the_reward_is_the_head_over_the_lms_response_logprobs(micro_dir):
    """r = 2 * min + 0.5 * mean - 1 over log p(token_t | tokens < t) of the response's tokens
    (and EOS), computed here by hand from one forward pass; padding a batch changes nothing."""
    tokenizer, lm = build_tokenizer(), load_causal_lm(micro_dir)
    model = LikelihoodRewardModel(lm, (2.0, 0.5), -1.0)
    ids, start = encode(tokenizer, "1+2\n", "1+2=3; answer 3")
    with torch.inference_mode():
        logps = lm(torch.tensor([ids])).logits[0].log_softmax(-1)
    token = torch.tensor([float(logps[t - 1, ids[t]]) for t in range(start, len(ids))])
    expected = 2.0 * token.min() + 0.5 * token.mean() - 1.0
    padded, _ = model.score(tokenizer, ["1+2\n", "12+2+7\n"], ["1+2=3; answer 3", "12+2=14; 14+7=21; answer 21"])
    (alone,) = model.score(tokenizer, ["1+2\n"], ["1+2=3; answer 3"])
    assert abs(float(alone) - float(expected)) < 1e-4
    assert abs(float(padded) - float(alone)) < 1e-4


@pytest.mark.slow
def test_the_head_fit_beats_the_initial_head_and_centres_rewards(micro_dir, tmp_path):
    """The Bradley-Terry fit on the frozen LM lowers the pairwise loss below the initial
    head's (1, 1, 0) and puts the mean reward of the training responses at 0."""
    tokenizer = build_tokenizer()
    data, _ = write_pairs(tmp_path, train_rows=32)
    dataset, dropped = pairs_dataset(tokenizer, pd.read_parquet(data))
    assert dropped == 0 and len(dataset) == 32
    model = LikelihoodRewardModel(load_causal_lm(micro_dir))
    pairs = pd.read_parquet(data)

    def loss_and_mean():
        chosen = model.score(tokenizer, pairs["prompt"], pairs["chosen"])
        rejected = model.score(tokenizer, pairs["prompt"], pairs["rejected"])
        loss = float(-torch.nn.functional.logsigmoid(chosen - rejected).mean())
        return loss, float(torch.cat([chosen, rejected]).mean())

    before, _ = loss_and_mean()
    curve = fit_head(model, dataset, tokenizer.pad_token_id)
    after, mean = loss_and_mean()
    assert after < before and curve[-1]["loss"] <= curve[0]["loss"]
    assert abs(mean) < 1e-3


def test_pairs_longer_than_max_length_are_dropped_and_none_left_is_an_error(tmp_path):
    tokenizer = build_tokenizer()
    pairs = pd.read_parquet(write_pairs(tmp_path)[0])
    longest = max(len(encode(tokenizer, p, c)[0]) for p, c in zip(pairs["prompt"], pairs["chosen"]))
    _, dropped = pairs_dataset(tokenizer, pairs, max_length=longest - 1)
    assert dropped >= 1
    with pytest.raises(ValueError, match="raise rm.max_length"):
        pairs_dataset(tokenizer, pairs, max_length=3)


def test_collator_marks_each_rows_response(micro_dir):
    collate = ResponseMaskCollator(pad_token_id=0)
    batch = collate([{"chosen_ids": [5, 6, 7], "rejected_ids": [5, 8], "chosen_start": 1, "rejected_start": 1}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 8, 0]]
    assert batch["response_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]


def likelihood_trainer(micro_dir, tmp_path, out, max_steps=4, stop_at=None, **training):
    from transformers import TrainerCallback, set_seed
    from trl import RewardConfig

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == stop_at

    tokenizer = build_tokenizer()
    dataset, _ = pairs_dataset(tokenizer, pd.read_parquet(write_pairs(tmp_path)[0]))
    params = TrainingParams(
        max_steps=max_steps, per_device_train_batch_size=4, save_steps=2, learning_rate=1e-2, **training
    )
    args = trl_config(RewardConfig, params, out, remove_unused_columns=False)
    set_seed(0)
    trainer = LikelihoodRewardTrainer(
        model=LikelihoodRewardModel(load_causal_lm(micro_dir)),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        data_collator=ResponseMaskCollator(pad_token_id=tokenizer.pad_token_id),
    )
    if stop_at:
        trainer.add_callback(Stop())
    return trainer


@pytest.mark.slow
def test_a_resumed_likelihood_rm_run_reproduces_an_uninterrupted_one(micro_dir, tmp_path, mlflow_store):
    """Stop after step 2 (checkpoint-2, the tied embeddings stored once), resume in a fresh
    trainer to step 4: LM and head equal those of a run that was never stopped."""
    straight = likelihood_trainer(micro_dir, tmp_path, tmp_path / "straight")
    straight.train()
    stopped = likelihood_trainer(micro_dir, tmp_path, tmp_path / "resumed", stop_at=2)
    stopped.train()
    assert stopped.state.global_step == 2 and (tmp_path / "resumed/checkpoint-2/model.safetensors").is_file()
    resumed = likelihood_trainer(micro_dir, tmp_path, tmp_path / "resumed")
    assert train_resumable(resumed, "rm", "test").endswith("checkpoint-2")
    assert resumed.state.global_step == 4
    for name, value in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value)


@pytest.mark.slow
def test_activation_checkpointing_trains_the_lm(micro_dir, tmp_path, mlflow_store):
    """Trainer enables activation checkpointing through the wrapper, on the LM inside it."""
    trainer = likelihood_trainer(
        micro_dir, tmp_path, tmp_path / "ckpt", max_steps=2, model={"gradient_checkpointing": True}
    )
    before = {k: v.clone() for k, v in trainer.model.lm.state_dict().items()}
    trainer.train()
    assert trainer.model.lm.is_activation_checkpointing
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.lm.state_dict().items())


def test_the_head_runs_in_fp32_under_bf16_autocast(micro_dir):
    """bf16 would round rewards 0.0065 apart to one value: the head computes in fp32 (its own
    output, seen by a hook, is fp32: not a bf16 result cast afterwards)."""
    model = LikelihoodRewardModel(load_causal_lm(micro_dir), (1.0, 1.0), 0.0)
    ids = torch.tensor([encode(build_tokenizer(), "1+2\n", "1+2=3; answer 3")[0]] * 2)
    computed = []
    model.head.register_forward_hook(lambda module, inputs, output: computed.append(output.dtype))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
        close = model.head(torch.tensor([[-3.1234, -0.4123], [-3.1299, -0.4123]]))
    assert computed[0] == torch.float32 and logits.dtype == torch.float32
    assert close.dtype == torch.bfloat16 and close[0] == close[1], "what the fp32 guard avoids"


def test_centring_defaults_to_the_kind():
    import stages.rm as stage

    assert stage.Config().center_rewards_coefficient is None
    assert stage.Config(kind="classifier").center_rewards_coefficient == 0.01
    assert stage.Config(kind="classifier", center_rewards_coefficient=None).center_rewards_coefficient is None


def run_stage(tmp_path, monkeypatch, **config):
    import stages.rm as stage

    monkeypatch.chdir(tmp_path)
    write_pairs(tmp_path)
    settings = {"max_steps": 2, "num_members": 2, "per_device_train_batch_size": 4, "save_steps": 2, **config}
    config = stage.Config(logging_steps=1, **settings)

    def load_model_stage(*args, **kwargs):  # as the stage's own: the rm's `model:` block configures loading
        import rlhf.models.settings as model_settings

        monkeypatch.setattr(model_settings, "_current", model_settings._current)  # restored after the test
        model_settings.configure(None, config.model)
        return {"rm": config, "task": TaskConfig()}

    monkeypatch.setattr(stage, "load_model_stage", load_model_stage)
    stage.main()
    return json.loads((tmp_path / "metrics/rm.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_likelihood_stage_trains_members_that_load_and_score(tmp_path, monkeypatch, mlflow_store, micro_dir, lora):
    """Each member's LM is trained (and differs from the other's: a different data order),
    the head is saved beside it, adapters are merged, and the ensemble scores with it."""
    metrics = run_stage(tmp_path, monkeypatch, lora={"enabled": lora})
    assert set(metrics["members"]) == {"member_0", "member_1"} and metrics["eval_pairs"] == 8
    assert 0.0 <= metrics["ensemble_accuracy"] <= 1.0 and math.isfinite(metrics["head_fit_loss"])
    by_flaw = metrics["accuracy_by_flaw"]  # named by the task's classify_error
    assert by_flaw and set(by_flaw) <= set(FLAW_KINDS) and all(0.0 <= a <= 1.0 for a in by_flaw.values())
    members = [tmp_path / f"models/rm/member_{i}" for i in range(2)]
    for member in members:
        head = json.loads((member / HEAD_FILE).read_text())
        assert head["kind"] == "likelihood" and len(head["weights"]) == 2
        assert not any(p.name.startswith("adapter") for p in member.iterdir()), "adapters are merged on save"
    initial, first, second = weights(micro_dir), weights(members[0]), weights(members[1])
    layers = [k for k in initial if k.startswith("model.layers")]
    assert any(not torch.equal(initial[k], first[k]) for k in layers), "the LM is trained, not only the head"
    assert any(not torch.equal(first[k], second[k]) for k in layers), "members differ"
    ensemble = RewardEnsemble.load(tmp_path / "models/rm")
    scores = ensemble.score(["1+2\n"] * 2, ["1+2=3; answer 3", "1+2=4; answer 4"])
    assert scores.members.shape == (2, 2) and torch.isfinite(scores.members).all()
    one_at_a_time = RewardEnsemble.load(tmp_path / "models/rm", resident=False)  # evaluate's judge
    assert all(isinstance(member, Path) for member in one_at_a_time.models), "no member held between calls"
    assert torch.equal(one_at_a_time.score(["1+2\n"] * 2, ["1+2=3; answer 3", "1+2=4; answer 4"]).members,
                       scores.members)  # fmt: skip
    assert not (tmp_path / "checkpoints/rm").exists()


@pytest.mark.slow
def test_classifier_stage_trains_differing_score_heads(tmp_path, monkeypatch, mlflow_store, micro_dir):
    metrics = run_stage(tmp_path, monkeypatch, kind="classifier", learning_rate=1e-3)
    assert math.isfinite(metrics["members"]["member_0"]["train_loss"]) and "head_fit_loss" not in metrics
    first, second = weights(tmp_path / "models/rm/member_0"), weights(tmp_path / "models/rm/member_1")
    assert not torch.equal(first["score.weight"], second["score.weight"]), "different seeds: different heads"
    assert not (tmp_path / "models/rm/member_0" / HEAD_FILE).exists()
    scores = RewardEnsemble.load(tmp_path / "models/rm").score(["1+2\n"], ["1+2=3; answer 3"])
    assert scores.members.shape == (2, 1)
    lazy = RewardEnsemble.load(tmp_path / "models/rm", resident=False).score(["1+2\n"], ["1+2=3; answer 3"])
    assert torch.equal(lazy.members, scores.members), "a member at a time scores as the loaded ensemble"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["likelihood", "classifier"])
def test_a_qlora_member_is_merged_into_its_base_unquantized(tmp_path, monkeypatch, mlflow_store, kind):
    """QLoRA members (a 4-bit base through bitsandbytes' CPU backend, LoRA r 4): what is
    saved is the unquantized init plus the adapter's low-rank update. Merged into the 4-bit
    weights and quantized again, every weight of an adapted layer would move by its
    quantization error (a full-rank difference), and updates below a quantization step
    would round away. The tiny model, not the micro one: bitsandbytes' AVX512-BF16 CPU
    kernel cannot run the micro model's 32-wide layers in inference."""
    pytest.importorskip("bitsandbytes")
    from rlhf.models.loading import build_tiny_model, save_model

    tokenizer = build_tokenizer()
    micro_dir = tmp_path / "models/sft"
    save_model(build_tiny_model("tiny", tokenizer, seed=0), tokenizer, micro_dir)
    run_stage(tmp_path, monkeypatch, kind=kind, num_members=1, learning_rate=1e-2,
              model={"quantization": {"bits": 4}}, lora={"enabled": True, "r": 4})  # fmt: skip
    member = tmp_path / "models/rm/member_0"
    assert "quantization_config" not in json.loads((member / "config.json").read_text())
    initial, trained = weights(micro_dir), weights(member)
    name = "model.layers.0.mlp.up_proj.weight"
    assert trained[name].dtype == torch.float32  # the compute dtype on this CPU
    update = trained[name] - initial[name]
    assert update.abs().max() > 1e-4, "the adapter trained and was merged"
    assert torch.linalg.matrix_rank(update, atol=1e-6) <= 4, "the difference is the adapter's rank-4 update"
    scores = RewardEnsemble.load(tmp_path / "models/rm").score(["1+2\n"] * 2, ["1+2=3; answer 3", "1+2=4; answer 4"])
    assert torch.isfinite(scores.members).all()


def test_a_missing_init_model_fails_naming_the_param(tmp_path, monkeypatch, mlflow_store):
    """rm.init: verifier without models/verifier: one error naming the param and the path,
    before anything is loaded (no hub lookup)."""
    import stages.rm as stage

    monkeypatch.chdir(tmp_path)
    data, eval_data = write_pairs(tmp_path)
    config = stage.Config(init="verifier")
    with pytest.raises(FileNotFoundError, match=r"rm.init 'verifier' \(models/verifier\) directory models/verifier"):
        stage.run(config, get_task(), stage.init_dir(config), data, eval_data, tmp_path / "out")


def test_pairwise_accuracy_counts_ties_as_half():
    assert pairwise_accuracy(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 1.0, 2.0])) == pytest.approx(0.5)


def test_accuracy_by_flaw_groups_pairs_by_the_tasks_error_kind():
    """Rejected 1 and 3 are slips (23+58=82; 81-17=63), rejected 2 states a wrong answer after
    right steps. Scores chosen/rejected 1/0 (win), 0/1 (loss), 2/2 (tie, 1/2):
    slip (1 + 1/2) / 2 = 0.75, answer 0. A task that names no errors (the base Task), or a
    prompt the built-in task cannot read, gives no groups."""
    import stages.rm as stage
    from rlhf.tasks.base import Task

    pairs = pd.DataFrame(
        {
            "prompt": ["23+58-17\n"] * 3,
            "rejected": [
                "23+58=82; 82-17=65; answer 65",
                "23+58=81; 81-17=64; answer 65",
                "23+58=81; 81-17=63; answer 63",
            ],
        }
    )
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 1.0, 2.0])

    def kinds(task, table):
        return [task.classify_error(p, r) for p, r in zip(table["prompt"], table["rejected"])]

    assert stage.accuracy_by_flaw(kinds(get_task(), pairs), chosen, rejected) == {"answer": 0.0, "slip": 0.75}
    assert stage.accuracy_by_flaw(kinds(Task(), pairs), chosen, rejected) == {}
    words = pairs.assign(prompt=["capital of France?\n"] * 3)
    assert stage.accuracy_by_flaw(kinds(get_task(), words), chosen, rejected) == {}


def test_pairs_counted_over_max_length_are_the_ones_trls_reward_trainer_leaves_out(tmp_path):
    """The classifier kind trains with TRL's RewardTrainer, which drops pairs longer than
    max_length silently; the stage counts them with pairs_dataset and reports the number.
    Here two of four pairs are too long, and TRL keeps exactly the other two."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    from trl import RewardConfig, RewardTrainer

    tokenizer = build_tokenizer()
    pairs = pd.DataFrame(
        {
            "prompt": ["1+2\n", "3+4\n", "1+2+3+4+5+6\n", "2+2\n"],
            "chosen": ["answer 3", "answer 7", "1+2=3; 3+3=6; 6+4=10; 10+5=15; 15+6=21; answer 21", "answer 4"],
            "rejected": ["answer 4", "answer 8", "answer 20", "2+2=4; 4+0=4; 4+0=4; 4+0=4; 4+0=4; 4+0=4; answer 4"],
        }
    )
    _, dropped = pairs_dataset(tokenizer, pairs, max_length=24)
    assert dropped == 2
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = AutoModelForSequenceClassification.from_config(config)
    args = RewardConfig(output_dir=str(tmp_path), max_length=24, report_to=[], use_cpu=True)
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=Dataset.from_pandas(pairs), processing_class=tokenizer
    )
    assert len(trainer.train_dataset) == len(pairs) - dropped


def test_members_are_read_in_number_order(tmp_path):
    """Twelve members: member_10 and member_11 come after member_9 (sorted as text they came
    after member_1, and the per-member metrics named the wrong ones)."""
    from rlhf.rewards.ensemble import member_dirs

    for index in range(12):
        (tmp_path / f"member_{index}").mkdir()
    assert [p.name for p in member_dirs(tmp_path)] == [f"member_{i}" for i in range(12)]


def test_a_classifier_rm_on_an_architecture_without_a_sequence_head_fails_naming_the_kind(tmp_path, monkeypatch):
    """transformers has no sequence-classification class for Granite: the classifier RM says
    to use the likelihood kind before any training (it was transformers' raw error)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    import stages.rm as stage
    from rlhf.models.folders import UnusableModelError
    from rlhf.models.loading import build_tokenizer, save_model

    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer()
    config = GraniteConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    save_model(GraniteForCausalLM(config), tokenizer, tmp_path / "models/sft")
    data, eval_data = write_pairs(tmp_path)
    with pytest.raises(UnusableModelError, match=r"model type 'granite'; set rm.kind: likelihood"):
        stage.run(stage.Config(kind="classifier"), get_task(), tmp_path / "models/sft", data, eval_data, tmp_path / "o")
