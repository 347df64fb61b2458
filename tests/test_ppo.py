"""PPO (rlhf.training.ppo): every step against numbers worked out by hand, the log-prob and value
alignment against an unpadded computation, and the trainer for 2-3 iterations on the micro
model (full, LoRA, killed-and-resumed), plus one slow run that must raise a learnable reward."""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from rlhf.models.generation import format_prompt
from rlhf.models.loading import build_tiny_model, build_tokenizer, load_causal_lm, save_model
from rlhf.tasks.arithmetic import TaskSpec, sample_problem
from rlhf.training.methods.ppo import Params as PPOParams
from rlhf.training.params import TrainingParams
from rlhf.training.ppo import (
    AdaptiveKLController,
    FixedKLController,
    clipped_policy_loss,
    clipped_value_loss,
    gae_advantages,
    generate_rollouts,
    kl_adjusted_rewards,
    latest_checkpoint,
    load_value_model,
    per_token_kl,
    response_mask,
    score_completions,
    td_errors,
    token_logprobs,
    token_values,
    train_ppo,
    value_adapters,
    value_returns,
    whiten,
)
from tests.test_stages import changed

T = torch.tensor
LOG_1_5 = math.log(1.5)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- rewards and KL


def test_per_token_kl_is_the_k1_log_ratio():
    close(per_token_kl(T([[-1.0, -2.0]]), T([[-1.5, -1.0]])), [[0.5, -1.0]])


def test_kl_adjusted_rewards_penalise_every_token_and_add_the_score_at_the_last():
    """kl = [0.2, -0.1, 0.3], beta = 0.1, score 2: r = [-0.02, 0.01, -0.03 + 2 = 1.97].
    Row 2 has 2 real tokens (mask [1, 1, 0]), kl = [0.2, 0.4, 5], score 1:
    r = [-0.02, -0.04 + 1 = 0.96, 0] (the padding's KL and the score never land on padding)."""
    kl = T([[0.2, -0.1, 0.3], [0.2, 0.4, 5.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    close(kl_adjusted_rewards(T([2.0, 1.0]), kl, 0.1, mask), [[-0.02, 0.01, 1.97], [-0.02, 0.96, 0.0]])


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(100.0, 64)
    assert controller.value == 0.05


def test_adaptive_kl_controller_follows_ziegler_et_al():
    """target 6, horizon 10000, 64 responses:
    KL 6.6 -> e = 0.1,  beta = 0.1 * (1 + 0.1 * 64/10000) = 0.1 * 1.00064 = 0.100064;
    KL 9   -> e = 0.5 clipped to 0.2:  beta *= 1 + 0.2 * 0.0064 = 1.00128;
    KL 3   -> e = -0.5 clipped to -0.2: beta *= 1 - 0.00128 = 0.99872 (the same step down)."""
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    controller.update(6.6, 64)
    assert controller.value == pytest.approx(0.100064)
    up = AdaptiveKLController(0.1, 6.0, 10000)
    up.update(9.0, 64)
    down = AdaptiveKLController(0.1, 6.0, 10000)
    down.update(3.0, 64)
    assert up.value == pytest.approx(0.100128) and down.value == pytest.approx(0.099872)


# ----------------------------------------------------------------------------- advantages

REWARDS, VALUES = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.2, 0.4]])


def test_td_errors_bootstrap_from_the_next_value_and_zero_after_the_end():
    """delta_0 = 0 + 0.2 - 0.5 = -0.3; delta_1 = 0 + 0.4 - 0.2 = 0.2; delta_2 = 1 + 0 - 0.4 = 0.6.
    With gamma = 0.5: delta_0 = 0.1 - 0.5 = -0.4, delta_1 = 0.2 - 0.2 = 0, delta_2 = 0.6."""
    close(td_errors(REWARDS, VALUES, torch.ones(1, 3), gamma=1.0), [[-0.3, 0.2, 0.6]])
    close(td_errors(REWARDS, VALUES, torch.ones(1, 3), gamma=0.5), [[-0.4, 0.0, 0.6]])


def test_gae_sums_discounted_td_errors_backwards():
    """gamma = 1, lam = 0.5, deltas [-0.3, 0.2, 0.6] (above):
    A_2 = 0.6; A_1 = 0.2 + 0.5 * 0.6 = 0.5; A_0 = -0.3 + 0.5 * 0.5 = -0.05.
    Returns A + V = [0.45, 0.7, 1.0]."""
    mask = torch.ones(1, 3)
    advantages = gae_advantages(REWARDS, VALUES, mask, gamma=1.0, lam=0.5)
    close(advantages, [[-0.05, 0.5, 0.6]])
    close(value_returns(advantages, VALUES, mask), [[0.45, 0.7, 1.0]])


def test_gae_ignores_a_padding_position():
    """The same response with a padding position whose value (9) and reward (5) are garbage:
    mask [1, 1, 1, 0] gives the same A as above and 0 at the padding (V_3 is not bootstrapped)."""
    rewards, values = T([[0.0, 0.0, 1.0, 5.0]]), T([[0.5, 0.2, 0.4, 9.0]])
    mask = T([[1, 1, 1, 0]])
    advantages = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)  # the garbage reward passed in
    close(advantages, [[-0.05, 0.5, 0.6, 0.0]])
    close(value_returns(advantages, values, mask), [[0.45, 0.7, 1.0, 0.0]])


def test_returns_with_lambda_one_are_the_discounted_reward_to_go():
    """lam = 1: the deltas telescope, R_t = sum_l gamma^l r_{t+l} whatever V is.
    gamma = 0.9, r = [0, 0, 1]: R = [0.81, 0.9, 1]."""
    advantages = gae_advantages(REWARDS, VALUES, torch.ones(1, 3), gamma=0.9, lam=1.0)
    close(value_returns(advantages, VALUES, torch.ones(1, 3)), [[0.81, 0.9, 1.0]])


def test_whiten_over_masked_positions():
    """x = [1, 2, 3 | 100 masked]: mean 2, variance (1 + 0 + 1) / 3 = 2/3, so
    whitened = [-1, 0, 1] / sqrt(2/3) = [-1.2247, 0, 1.2247], 0 at the padding; without the
    mean shift, 2 is added back: [0.7753, 2, 3.2247]."""
    x, mask = T([[1.0, 2.0], [3.0, 100.0]]), T([[1, 1], [1, 0]])
    out = whiten(x, mask)
    close(out, [[-1.224745, 0.0], [1.224745, 0.0]])
    real = out[mask.bool()]
    assert real.mean().abs() < 1e-6 and (real**2).mean() == pytest.approx(1.0, abs=1e-5)
    close(whiten(x, mask, shift_mean=False), [[0.775255, 2.0], [3.224745, 0.0]])


# ----------------------------------------------------------------------------- losses


def test_policy_loss_clips_when_the_ratio_overshoots_in_the_advantage_direction():
    """ratio = 1.5, A = +1, eps 0.2: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped, and no gradient
    (the clipped term is constant in log pi). approx_kl = 0.5 * ln(1.5)^2 = 0.0822."""
    logprobs = T([[LOG_1_5]], requires_grad=True)
    loss, clipfrac, approx_kl = clipped_policy_loss(logprobs, T([[0.0]]), T([[1.0]]), T([[1]]), cliprange=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and clipfrac.item() == 1.0
    assert approx_kl.item() == pytest.approx(0.5 * LOG_1_5**2)
    assert logprobs.grad.item() == 0.0


def test_policy_loss_does_not_clip_against_the_advantage_and_averages_over_tokens():
    """Token 1: ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5, unclipped -> +1.5, whose gradient
    in log pi is -A * ratio = 1.5, over 2 real tokens = 0.75. Token 2: ratio 1, A = 2 -> -2
    (gradient -2 / 2 = -1). Token 3 is padding (its huge ratio would clip): no loss, no
    gradient. Loss = (1.5 - 2) / 2 = -0.25, clipfrac 0; approx_kl = (0.5 * ln(1.5)^2 + 0) / 2
    = 0.25 * ln(1.5)^2."""
    logprobs = T([[LOG_1_5, 0.0, 5.0]], requires_grad=True)
    loss, clipfrac, approx_kl = clipped_policy_loss(
        logprobs, torch.zeros(1, 3), T([[-1.0, 2.0, 1.0]]), T([[1, 1, 0]]), cliprange=0.2
    )
    loss.backward()
    assert loss.item() == pytest.approx(-0.25) and clipfrac.item() == 0.0
    assert approx_kl.item() == pytest.approx(0.25 * LOG_1_5**2)
    close(logprobs.grad, [[0.75, -1.0, 0.0]])


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    """eps 0.2. Token 1: V_old 1, V 2, R 2: unclipped 0, clipped V = 1.2 -> 0.64: the clipped
    branch is the max. Token 2: V_old 1, V 0.5, R 2: unclipped 2.25, clipped V = 0.8 -> 1.44:
    unclipped is the max. Loss = 0.5 * (0.64 + 2.25) / 2 = 0.7225; clipfrac (the share of
    tokens where the clipped error is the larger) 1/2."""
    loss, clipfrac = clipped_value_loss(T([[2.0, 0.5]]), T([[1.0, 1.0]]), T([[2.0, 2.0]]), T([[1, 1]]), 0.2)
    assert loss.item() == pytest.approx(0.7225) and clipfrac.item() == pytest.approx(0.5)


# ----------------------------------------------------------------------------- params


def test_params_name_the_keys_of_an_impossible_batch_split():
    with pytest.raises(ValidationError, match=r"rollout_batch_size \(10\).*mini_batch_size \(4\)"):
        PPOParams(rollout_batch_size=10, mini_batch_size=4)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        PPOParams(max_new_tokens=200, max_length=128)
    with pytest.raises(ValidationError, match="cliprange"):
        PPOParams(cliprange=0)
    params = PPOParams()
    assert params.value_learning_rate is None and not params.lora.enabled and params.value_init == "sft"
    assert (params.max_steps, params.temperature) == (60, 0.7)


@pytest.mark.parametrize("key", ["per_device_train_batch_size", "gradient_accumulation_steps"])
def test_params_reject_an_inherited_key_ppo_ignores(key):
    """PPOParams inherits TrainingParams' keys, but its batches are rollout_batch_size and
    mini_batch_size: setting a key it would ignore is an error naming the key, even at its
    default value; keys it reads are accepted."""
    value = TrainingParams.model_fields[key].default
    with pytest.raises(ValidationError, match=rf"{key}: not read by PPO") as error:
        PPOParams(**{key: value})
    assert "remove it" in str(error.value)


def test_params_name_every_ignored_key_and_accept_the_keys_ppo_reads():
    ignored = "gradient_accumulation_steps, per_device_train_batch_size: not read by PPO.*remove them"
    with pytest.raises(ValidationError, match=ignored):
        PPOParams(per_device_train_batch_size=8, gradient_accumulation_steps=2)
    with pytest.raises(ValidationError, match="optim: this trainer is the pipeline's own, with no TRL config"):
        PPOParams(trl={"optim": "adamw_torch"})
    params = PPOParams(max_steps=5, learning_rate=1e-4, max_length=96, seed=3, save_steps=1)
    assert (params.max_steps, params.learning_rate, params.max_length, params.seed) == (5, 1e-4, 96, 3)


# ----------------------------------------------------------------------------- the micro model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("ppo") / "sft"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def task_prompts(n: int, seed: int = 0) -> tuple[list[str], dict[str, list[str]]]:
    rng = random.Random(seed)
    problems = [sample_problem(rng, TaskSpec()) for _ in range(n)]
    return [p.prompt for p in problems], {"answer": [str(p.answer) for p in problems]}


def digit_share(prompts, completions, answer, **kwargs) -> list[float]:
    """A reward the micro model can learn from scratch: the share of digits in a completion."""
    assert len(answer) == len(completions) == len(prompts)
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def test_value_model_loads_from_a_causal_lm_with_a_zero_head_or_from_a_reward_model_keeping_its_head(
    model_dir, tokenizer, tmp_path
):
    from transformers import AutoModelForSequenceClassification

    from_sft = load_value_model(model_dir)
    assert from_sft.config.num_labels == 1 and not from_sft.score.weight.any() and not from_sft.score.bias.any()
    reward_model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1)
    save_model(reward_model, tokenizer, tmp_path / "rm")
    from_rm = load_value_model(tmp_path / "rm")
    assert torch.equal(from_rm.score.weight, reward_model.score.weight) and from_rm.score.weight.any()
    ids = T([[5, 6, 7]])
    assert from_rm(ids).logits.shape == (1, 3, 1)


def test_an_architecture_without_a_token_classification_class_gets_a_value_head(tokenizer, tmp_path):
    """transformers has no token-classification class for Gemma 3 (nor OLMo, OPT, GPT-J):
    the value model is its decoder body with a new, zeroed linear head, V = 0 at the start
    on every position, and the value loss trains head and body."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from rlhf.training.ppo import ValueHeadModel, token_values

    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    save_model(Gemma3ForCausalLM(config), tokenizer, tmp_path / "gemma")
    value_model = load_value_model(tmp_path / "gemma")
    assert isinstance(value_model, ValueHeadModel)
    ids, mask = T([[5, 6, 7, 8], [0, 5, 6, 7]]), T([[1, 1, 1, 1], [0, 1, 1, 1]])
    values = token_values(value_model, ids, mask, response_start=2)
    assert values.shape == (2, 2) and not values.any()
    ((values - 1.0) ** 2).mean().backward()
    assert value_model.score.weight.grad.any() and value_model.score.bias.grad.any()
    assert not value_model.body.embed_tokens.weight.grad.any(), "a zero head passes no gradient to the body yet"
    torch.optim.SGD(value_model.parameters(), lr=0.1).step()
    value_model.zero_grad()
    ((token_values(value_model, ids, mask, response_start=2) - 1.0) ** 2).mean().backward()
    assert value_model.body.embed_tokens.weight.grad.any(), "once the head has moved, the loss trains the body too"


def test_response_mask_keeps_the_first_eos_and_masks_what_follows():
    eos, pad = 2, 0
    ids = T([[5, 6, eos, pad, pad], [5, eos, eos, eos, eos], [5, 6, 7, 8, 9]])
    expected = [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]  # row 2: pad id == EOS id
    assert response_mask(ids, eos).tolist() == expected
    assert response_mask(ids, [eos, 99]).tolist() == expected


def test_logprobs_and_values_of_a_left_padded_batch_match_each_sequence_alone(model_dir, tokenizer):
    """The response token at column Q + t is scored by the logits and the value at Q + t - 1
    (the state before it): recompute both from each sequence alone, with no padding."""
    policy, value_model = load_causal_lm(model_dir).eval(), load_value_model(model_dir).eval()
    queries, responses = ["1+2\n", "12+34-5\n"], ["3; ans", "41"]
    q = tokenizer(queries, return_tensors="pt", padding=True, add_special_tokens=False)
    r_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
    r_len = max(map(len, r_ids))
    response = T([ids + [tokenizer.pad_token_id] * (r_len - len(ids)) for ids in r_ids])
    mask = T([[1] * len(ids) + [0] * (r_len - len(ids)) for ids in r_ids])
    input_ids, attention = torch.cat([q["input_ids"], response], 1), torch.cat([q["attention_mask"], mask], 1)
    start = q["input_ids"].shape[1]
    with torch.no_grad():
        logprobs, entropy = token_logprobs(policy, input_ids, attention, start, temperature=0.7, entropy=True)
        values = token_values(value_model, input_ids, attention, start)
        for row, (query, ids) in enumerate(zip(queries, r_ids)):
            alone = T([tokenizer(query, add_special_tokens=False)["input_ids"] + ids])
            n_query = alone.shape[1] - len(ids)
            logits = policy(alone).logits[0, n_query - 1 : -1] / 0.7
            expected = logits.log_softmax(-1).gather(-1, T(ids)[:, None]).squeeze(-1)
            close(logprobs[row, : len(ids)], expected)
            close(entropy[row, : len(ids)], torch.distributions.Categorical(logits=logits).entropy())
            close(values[row, : len(ids)], value_model(alone).logits[0, n_query - 1 : -1, 0])


def test_rollouts_mask_after_eos_and_record_the_sampling_logprobs(model_dir, tokenizer):
    policy = load_causal_lm(model_dir)
    prompts = ["1+2\n", "12+34-5\n", [{"role": "user", "content": "7-3"}]]
    torch.manual_seed(0)
    rollout = generate_rollouts(policy, tokenizer, prompts, max_new_tokens=6, temperature=1.5)
    assert rollout.query_ids.shape[0] == 3 and rollout.response_ids.shape[1] <= 6
    mask = rollout.response_mask
    assert torch.equal(mask, response_mask(rollout.response_ids, tokenizer.eos_token_id))
    assert (rollout.response_ids[mask == 0] == tokenizer.pad_token_id).all()
    assert torch.equal(rollout.attention_mask[:, rollout.response_start :], mask)
    assert rollout.completions == tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
    assert tokenizer.decode(rollout.query_ids[2], skip_special_tokens=False).endswith("<|assistant|>")
    assert (rollout.logprobs[mask == 1] < 0).all() and (rollout.logprobs[mask == 0] == 0).all()

    # The same draw from `generate` itself: its tempered scores give the same log-probs.
    torch.manual_seed(0)
    texts = [format_prompt(tokenizer, p) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = policy.generate(
        **batch, do_sample=True, temperature=1.5, top_k=0, top_p=1.0, max_new_tokens=6, output_scores=True,
        return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    sampled = out.sequences[:, rollout.response_start :]
    assert torch.equal(sampled * mask, rollout.response_ids * mask)
    expected = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, sampled[..., None]).squeeze(-1)
    close(rollout.logprobs, expected * mask)


def test_rollouts_ignore_a_penalty_or_truncation_in_the_models_generation_config(model_dir, tokenizer):
    """PPO's old log-probs are those of the tempered distribution: a repetition penalty,
    top-k or min-p in the model's generation_config.json (chat models ship them) would
    sample from another one. The same seed draws the same tokens with them as without."""
    policy = load_causal_lm(model_dir)
    prompts = ["1+2\n", "12+34-5\n"]
    torch.manual_seed(0)
    plain = generate_rollouts(policy, tokenizer, prompts, max_new_tokens=8, temperature=1.5)
    policy.generation_config.repetition_penalty = 5.0
    policy.generation_config.top_k = 2
    policy.generation_config.min_p = 0.99  # the untrained model is near uniform: only its top tokens
    torch.manual_seed(0)
    shipped = generate_rollouts(policy, tokenizer, prompts, max_new_tokens=8, temperature=1.5)
    assert torch.equal(shipped.response_ids, plain.response_ids)
    close(shipped.logprobs, plain.logprobs)


def test_score_completions_passes_row_fields_and_wraps_conversational_completions():
    seen = {}

    def reward(prompts, completions, answer, **kwargs):
        seen.update(completions=completions, answer=answer)
        return [1.0, 0.5]

    conversation = [{"role": "user", "content": "1+1"}]
    scores = score_completions(reward, [conversation, conversation], ["2", "3"], {"answer": ["2", "2"]})
    close(scores, [1.0, 0.5])
    assert seen["completions"][0] == [{"role": "assistant", "content": "2"}] and seen["answer"] == ["2", "2"]
    with pytest.raises(ValueError, match="returned 2 scores for 3 completions"):
        score_completions(reward, ["a", "b", "c"], ["x", "y", "z"], {"answer": ["1"] * 3})


# ----------------------------------------------------------------------------- training

TRAIN = {"rollout_batch_size": 4, "mini_batch_size": 2, "max_new_tokens": 8, "learning_rate": 1e-3, "logging_steps": 1}
METRICS = ("score", "kl", "kl_coef", "policy_loss", "value_loss", "clipfrac", "approx_kl", "entropy", "response_length")


def fresh_models(model_dir):
    return load_causal_lm(model_dir), load_causal_lm(model_dir), load_value_model(model_dir)


def run_ppo(model_dir, tokenizer, checkpoints, models=None, **overrides):
    policy, ref, value = models or fresh_models(model_dir)
    prompts, fields = task_prompts(6)
    logged = []
    params = PPOParams(**{**TRAIN, "max_steps": 2, **overrides})
    history = train_ppo(
        policy, ref, value, tokenizer, prompts, fields, digit_share, params, checkpoints, lambda m, s: logged.append(s)
    )
    return history, logged


@pytest.mark.slow
def test_ppo_updates_policy_and_value_and_reports_finite_metrics(model_dir, tokenizer, tmp_path):
    policy, ref, value = fresh_models(model_dir)
    before = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in zip("prv", (policy, ref, value))}
    history, logged = run_ppo(model_dir, tokenizer, tmp_path / "ckpt", models=(policy, ref, value))
    assert [row["step"] for row in history] == logged == [1, 2]
    assert all(math.isfinite(row[key]) for row in history for key in METRICS)
    assert all(0 < row["response_length"] <= 8 for row in history)
    assert changed(before["p"], policy.state_dict()) and changed(before["v"], value.state_dict())
    assert not changed(before["r"], ref.state_dict()), "the reference stays frozen"
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-2"], "only the last checkpoint is kept"


@pytest.mark.slow
def test_ppo_with_lora_returns_a_merged_plain_policy(model_dir, tokenizer, tmp_path):
    """With LoRA the policy's adapters are merged on return; the reference is the policy with
    its adapters disabled (no second copy), and the run equals one against a separate copy."""
    policy, ref, value = fresh_models(model_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    lora = PPOParams().lora.model_copy(update={"enabled": True, "r": 4})
    history, _ = run_ppo(model_dir, tokenizer, tmp_path / "ckpt", models=(policy, None, value), lora=lora)
    assert len(history) == 2 and all(math.isfinite(row["policy_loss"]) for row in history)
    assert set(policy.state_dict()) == set(before), "adapters are merged: no lora_ keys remain"
    assert changed(before, policy.state_dict(), "model.layers")
    with_copy, _ = run_ppo(model_dir, tokenizer, tmp_path / "ckpt-copy", models=(load_causal_lm(model_dir), ref,
                                                                                   load_value_model(model_dir)),
                           lora=lora)  # fmt: skip
    for row, other in zip(history, with_copy):
        assert row["kl"] == pytest.approx(other["kl"], abs=1e-6) and row["policy_loss"] == pytest.approx(
            other["policy_loss"], abs=1e-6
        )


@pytest.fixture
def bf16_compute():
    """This process computing in bfloat16 on the CPU (autocast; LoRA bases load in bf16)."""
    from rlhf.models import compute

    compute.configure(compute.ComputeConfig(device="cpu", dtype="bfloat16"))
    yield
    compute.configure(None)


def test_value_adapters_leave_the_body_frozen_in_the_compute_dtype_and_train_a_float32_head(model_dir, bf16_compute):
    """Under LoRA the value model trains adapters and its head, not 16 bytes a weight: its
    frozen weights load in the compute dtype (bf16 here) and the head, trained in full, in
    float32, reading the bf16 hidden state without a dtype error."""
    value = load_value_model(model_dir, adapters=True)
    assert value.model.embed_tokens.weight.dtype == torch.bfloat16
    wrapped = value_adapters(value, PPOParams().lora.model_copy(update={"enabled": True, "r": 4}))
    trainable = {name: p for name, p in wrapped.named_parameters() if p.requires_grad}
    head = [name for name in trainable if "lora_" not in name]
    assert head and all(".score." in name for name in head), head
    assert all(p.dtype == torch.float32 for p in trainable.values())
    ids, mask = T([[5, 6, 7, 8], [0, 5, 6, 7]]), T([[1, 1, 1, 1], [0, 1, 1, 1]])
    values = token_values(wrapped, ids, mask, response_start=2)
    assert values.dtype == torch.float32 and not values.any(), "a zeroed head: V = 0 at the start"
    ((values - 1.0) ** 2).mean().backward()
    assert all(trainable[name].grad.any() for name in head)


@pytest.mark.slow
def test_ppo_with_lora_in_bf16_trains_value_adapters_and_returns_plain_models(
    model_dir, tokenizer, tmp_path, bf16_compute
):
    """A LoRA run under bf16 autocast on the CPU: finite metrics, and both the policy and the
    value model come back plain (adapters merged) and changed, the value head included."""
    policy = load_causal_lm(model_dir, adapters=True)
    value = load_value_model(model_dir, adapters=True)
    before = {k: v.clone() for k, v in value.state_dict().items()}
    lora = PPOParams().lora.model_copy(update={"enabled": True, "r": 4})
    history, _ = run_ppo(model_dir, tokenizer, tmp_path / "ckpt", models=(policy, None, value), lora=lora)
    assert all(math.isfinite(row[key]) for row in history for key in METRICS)
    assert set(value.state_dict()) == set(before), "the value model's adapters are merged too"
    assert changed(before, value.state_dict(), "model.layers") and changed(before, value.state_dict(), "score")


def test_a_shared_trunk_value_is_a_separate_lora_value_model_without_the_copy(model_dir):
    """Under LoRA from SFT the value model is a second adapter and a head on the policy's
    weights: its values equal those of a separate copy of the weights carrying the same
    adapter and head; its parameters are its adapter and head only, apart from the
    policy's; a value step leaves the policy's log-probs as they were, and a policy step
    the values."""
    from peft import get_peft_model

    from rlhf.training.ppo import SharedTrunkValue, trained_parameters

    lora = PPOParams().lora.model_copy(update={"enabled": True, "r": 4})
    torch.manual_seed(0)
    policy = get_peft_model(load_causal_lm(model_dir), lora.peft_config())
    value = SharedTrunkValue(policy, lora)
    ids, mask = T([[5, 6, 7, 8, 9], [0, 5, 6, 7, 8]]), T([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert not token_values(value, ids, mask, response_start=2).any(), "a zeroed head: V = 0 at the start"
    mine, its = trained_parameters(value), trained_parameters(policy)
    assert set(mine) == {"score.weight", "score.bias", *(n for n in mine if ".value." in n)} and len(mine) > 2
    assert not set(mine) & set(its) and all(".default." in n for n in its)
    with torch.no_grad():  # a trained-looking value adapter and head
        for parameter in mine.values():
            parameter.normal_(0, 0.1)

    separate = get_peft_model(load_causal_lm(model_dir), lora.peft_config())
    adapter = {n.replace(".value.", ".default."): p for n, p in mine.items() if ".value." in n}
    with torch.no_grad():
        for name, parameter in separate.named_parameters():
            if "lora_" in name:
                parameter.copy_(adapter[name])
    hidden = separate.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = value.score(hidden)[:, 1:-1, 0]
    torch.testing.assert_close(token_values(value, ids, mask, response_start=2), expected, atol=1e-5, rtol=1e-5)

    logprobs = token_logprobs(policy, ids, mask, response_start=2)
    values = token_values(value, ids, mask, response_start=2)
    token_values(value, ids, mask, response_start=2).pow(2).mean().backward()
    assert all(p.grad is None for p in its.values()) and all(p.grad is not None for p in mine.values())
    torch.optim.SGD(mine.values(), lr=1.0).step()
    assert torch.equal(token_logprobs(policy, ids, mask, response_start=2), logprobs)
    moved = token_values(value, ids, mask, response_start=2).detach()
    assert not torch.equal(moved, values)
    token_logprobs(policy, ids, mask, response_start=2).sum().backward()
    torch.optim.SGD(its.values(), lr=1.0).step()
    assert not torch.equal(token_logprobs(policy, ids, mask, response_start=2), logprobs)
    assert torch.equal(token_values(value, ids, mask, response_start=2), moved)


def test_a_shared_trunk_value_pass_is_not_recomputed_with_the_policys_adapter(model_dir):
    """Under gradient checkpointing a layer runs again in the backward pass, when the
    policy's adapter is the active one: a value pass is therefore not checkpointed, and its
    gradients equal those of a run without checkpointing."""
    from peft import get_peft_model

    from rlhf.training.ppo import SharedTrunkValue, checkpointed_in_eval, trained_parameters

    lora = PPOParams().lora.model_copy(update={"enabled": True, "r": 4})
    ids, mask = T([[5, 6, 7, 8, 9], [0, 5, 6, 7, 8]]), T([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    grads = []
    for checkpointing in (False, True):
        policy = get_peft_model(load_causal_lm(model_dir), lora.peft_config())
        value = SharedTrunkValue(policy, lora)
        torch.manual_seed(0)
        with torch.no_grad():  # both adapters and the head away from their zero start
            for parameter in [*trained_parameters(policy).values(), *trained_parameters(value).values()]:
                parameter.normal_(0, 0.1)
        policy.eval()
        if checkpointing:
            checkpointed_in_eval(policy)
        token_values(value, ids, mask, response_start=2).pow(2).mean().backward()
        grads.append({n: p.grad for n, p in trained_parameters(value).items()})
    plain, checkpointed = grads
    assert all(g is not None for g in checkpointed.values())
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad)


@pytest.mark.slow
def test_ppo_with_lora_from_sft_needs_no_value_model_and_returns_a_plain_policy(model_dir, tokenizer, tmp_path):
    """With LoRA and no value model given, PPO trains a value adapter and head on the
    policy's weights; the policy comes back plain (its adapter merged, the value adapter
    gone) and changed."""
    policy = load_causal_lm(model_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    lora = PPOParams().lora.model_copy(update={"enabled": True, "r": 4})
    history, _ = run_ppo(model_dir, tokenizer, tmp_path / "ckpt", models=(policy, None, None), lora=lora)
    assert all(math.isfinite(row[key]) for row in history for key in METRICS)
    assert history[-1]["value_loss"] > 0
    assert set(policy.state_dict()) == set(before) and changed(before, policy.state_dict(), "model.layers")


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_the_layers_and_trains_the_same(model_dir, tokenizer, tmp_path):
    """params model.gradient_checkpointing: PPO keeps its models in eval mode (no dropout),
    where transformers would not recompute; the layers run again in the backward pass (the
    attention of the first layer is called more often) and the run ends with the same
    weights and metrics. (A value model on the policy's trunk is not recomputed: its test
    is test_a_shared_trunk_value_pass_is_not_recomputed_with_the_policys_adapter.)"""
    from rlhf.models import settings

    lora = PPOParams().lora.model_copy(update={"enabled": True, "r": 4})
    runs = []
    for checkpointing in (False, True):
        settings.configure(settings.ModelSettings(gradient_checkpointing=checkpointing))
        try:
            policy, _, value_model = fresh_models(model_dir)
            calls = []
            policy.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
            history, _ = run_ppo(model_dir, tokenizer, tmp_path / f"ckpt-{checkpointing}",
                                 models=(policy, None, value_model), lora=lora)  # fmt: skip
        finally:
            settings.configure(None)
        runs.append((history, policy.state_dict(), len(calls)))
    (plain, plain_weights, plain_calls), (checkpointed, weights, checkpointed_calls) = runs
    assert checkpointed_calls > plain_calls
    for row, other in zip(plain, checkpointed):
        assert row["policy_loss"] == pytest.approx(other["policy_loss"], abs=1e-5)
        assert row["value_loss"] == pytest.approx(other["value_loss"], abs=1e-5)
    for key, tensor in plain_weights.items():
        torch.testing.assert_close(weights[key], tensor, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_resumed_run_continues_from_its_checkpoint_and_reproduces(model_dir, tokenizer, tmp_path):
    """Run 2 iterations checkpointing every one, then restart with max_steps 3: only iteration
    3 runs, and it ends where a 3-iteration run that was never stopped ends."""
    first, _ = run_ppo(model_dir, tokenizer, tmp_path / "resumed", save_steps=1)
    assert latest_checkpoint(tmp_path / "resumed").name == "step-2"
    policy, ref, value = fresh_models(model_dir)
    resumed, logged = run_ppo(model_dir, tokenizer, tmp_path / "resumed", models=(policy, ref, value), max_steps=3)
    assert logged == [3] and len(resumed) == 3 and resumed[:2] == first

    straight_policy, *rest = fresh_models(model_dir)
    straight, _ = run_ppo(model_dir, tokenizer, tmp_path / "straight", models=(straight_policy, *rest), max_steps=3)
    assert resumed[2] == pytest.approx(straight[2])
    for key, tensor in straight_policy.state_dict().items():
        torch.testing.assert_close(policy.state_dict()[key], tensor)


@pytest.mark.slow
def test_ppo_raises_mean_reward_on_the_builtin_prompts(model_dir, tokenizer, tmp_path):
    """From the untrained micro model (about 1 in 10 tokens is a digit), PPO on the share of
    digits must clearly raise the mean score within 30 iterations."""
    prompts, fields = task_prompts(64)
    params = PPOParams(
        max_steps=30, rollout_batch_size=16, mini_batch_size=8, max_new_tokens=8, learning_rate=3e-3,
        kl_coef=0.01, logging_steps=5, save_steps=1000,
    )  # fmt: skip
    policy, ref, value = fresh_models(model_dir)
    history = train_ppo(policy, ref, value, tokenizer, prompts, fields, digit_share, params, tmp_path / "ckpt")
    first = sum(row["score"] for row in history[:5]) / 5
    last = sum(row["score"] for row in history[-5:]) / 5
    assert last > first + 0.3, f"mean digit share {first:.3f} -> {last:.3f}"


def test_rollouts_and_generation_stop_at_the_models_end_of_turn_token():
    """A chat model's end-of-turn token is often an EOS of its generation config only, not
    the tokenizer's EOS. A model that emits token X at once, with X among its configured
    EOS ids: evaluate's generation stops after X (1 token, not the 8 of the budget) and a
    PPO rollout's response mask ends at X, as TRL's GRPO and RLOO stop."""
    from rlhf.models.generation import generate

    tokenizer = build_tokenizer()
    model = build_tiny_model("micro", tokenizer, seed=0)
    x = tokenizer.convert_tokens_to_ids("=")
    bias = torch.zeros(len(tokenizer))
    bias[x] = 100.0
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    prompts = ["1+2\n", "3+4+5\n"]
    assert generate(model, tokenizer, prompts, 8) == ["========"] * 2, "only the tokenizer's EOS: runs to the budget"
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, x]
    assert generate(model, tokenizer, prompts, 8) == ["="] * 2
    rollout = generate_rollouts(model, tokenizer, prompts, max_new_tokens=8)
    assert rollout.response_mask.sum(1).tolist() == [1, 1]


def test_conversations_stop_at_the_chat_templates_end_of_turn_token():
    """The built-in template ends an assistant turn with `<|end|>`, which is no EOS of the
    built-in model's generation config: generation from conversations stops there (a model
    fine-tuned on conversations writes its answer, then `<|end|>`), from text runs on."""
    from rlhf.models.generation import generate, turn_end_ids

    tokenizer = build_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert turn_end_ids(tokenizer) == [end]
    model = build_tiny_model("micro", tokenizer, seed=0)
    bias = torch.zeros(len(tokenizer))
    bias[end] = 100.0
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    chat = generate(model, tokenizer, [[{"role": "user", "content": "1+2"}]], 6, details=True)
    assert chat.tokens == [1] and chat.finished == [True]
    text = generate(model, tokenizer, ["1+2\n"], 6, details=True)
    assert text.tokens == [6] and text.finished == [False]
