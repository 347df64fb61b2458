"""Elastic weight consolidation (rlhf.training.ewc): the Fisher diagonal is the mean of
per-example squared gradients, the hooks add exactly the penalty's gradient, and training
on new data with EWC forgets less of the old data than the same training without it."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from rlhf.training.ewc import attach, completion_examples, consolidate, ewc_examples, fisher_diagonal
from rlhf.training.params import EwcParams


@pytest.fixture
def micro():
    from rlhf.models.loading import build_tiny_model, build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    return build_tiny_model("micro", tokenizer, seed=0), tokenizer


def test_completion_examples_mask_the_prompt_and_append_eos(micro):
    _, tokenizer = micro
    [example] = completion_examples(tokenizer, ["2+3\n"], ["2+3=5\nanswer: 5"], max_length=96)
    prompt_len = len(tokenizer("2+3\n", add_special_tokens=False)["input_ids"])
    assert example["labels"][:prompt_len] == [-100] * prompt_len
    assert example["labels"][prompt_len:] == example["input_ids"][prompt_len:]
    assert example["input_ids"][-1] == tokenizer.eos_token_id


def test_fisher_is_the_mean_of_per_example_squared_gradients(micro):
    model, tokenizer = micro
    examples = completion_examples(tokenizer, ["1+2\n", "7-3\n"], ["1+2=3\nanswer: 3", "7-3=4\nanswer: 4"], 96)
    fisher = fisher_diagonal(model, examples)
    name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("q_proj.weight"))
    expected = torch.zeros_like(param)
    for example in examples:
        loss = model(input_ids=torch.tensor([example["input_ids"]]), labels=torch.tensor([example["labels"]])).loss
        (grad,) = torch.autograd.grad(loss, param)
        expected += grad**2
    torch.testing.assert_close(fisher[name], expected / 2)
    assert all(p.grad is None for p in model.parameters()), "measuring leaves no gradients behind"


def test_hooks_add_the_gradient_of_the_penalty(micro):
    model, _ = micro
    params = dict(model.named_parameters())
    fisher = {name: torch.rand_like(p) for name, p in params.items()}
    ewc = attach(model, fisher, strength=3.0, scale=0.5)
    moved = {}
    with torch.no_grad():
        for name, p in params.items():
            moved[name] = torch.randn_like(p) * 0.01
            p += moved[name]
    # A loss that is zero but touches every parameter: the gradient is EWC's alone.
    sum(p.sum() * 0.0 for p in params.values()).backward()
    for name, p in params.items():
        torch.testing.assert_close(p.grad, 3.0 * 0.5 * fisher[name] * moved[name], rtol=1e-4, atol=1e-7)
    expected = 3.0 / 2 * sum(float((fisher[n] * moved[n] ** 2).sum()) for n in params)
    assert ewc.penalty() == pytest.approx(expected, rel=1e-4)
    ewc.remove()
    model.zero_grad()
    sum(p.sum() * 0.0 for p in params.values()).backward()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in params.values()), "removed hooks add nothing"


def test_under_fp16_loss_scaling_the_optimizer_sees_the_penalty_gradient_unscaled(micro):
    """fp16 training scales the loss (accelerate's GradScaler), so the gradients the hooks
    see are scaled and are divided by the scale before the optimizer step: the pull is
    multiplied by the scale (`loss_scale`), else it reached the optimizer 65536 times too weak."""
    model, _ = micro
    params = dict(model.named_parameters())
    fisher = {name: torch.rand_like(p) for name, p in params.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    attach(model, fisher, strength=3.0, loss_scale=scaler.get_scale)
    moved = {}
    with torch.no_grad():
        for name, p in params.items():
            moved[name] = torch.randn_like(p) * 0.01
            p += moved[name]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(sum(p.sum() * 0.0 for p in params.values())).backward()
    scaler.unscale_(optimizer)
    for name, p in params.items():
        torch.testing.assert_close(p.grad, 3.0 * fisher[name] * moved[name], rtol=1e-4, atol=1e-7)


def _loss(model, examples) -> float:
    with torch.no_grad():
        return sum(
            float(model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])).loss)
            for e in examples
        ) / len(examples)


def _train(model, examples, steps: int, lr: float) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        example = examples[step % len(examples)]
        optimizer.zero_grad()
        model(input_ids=torch.tensor([example["input_ids"]]), labels=torch.tensor([example["labels"]])).loss.backward()
        optimizer.step()


def test_ewc_forgets_less_of_the_old_data(micro):
    """Fit the micro model to old data A, then train on new data B with and without EWC
    (the same steps from the same weights): with EWC the loss on A rises less."""
    model, tokenizer = micro
    old = completion_examples(tokenizer, [f"{a}+{a}\n" for a in range(1, 9)], [f"{2 * a}" for a in range(1, 9)], 32)
    new = completion_examples(tokenizer, [f"{a}-1\n" for a in range(2, 10)], [f"{a - 1}" for a in range(2, 10)], 32)
    torch.manual_seed(0)
    _train(model, old, steps=120, lr=0.05)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    fisher = fisher_diagonal(model, old)

    def forgetting(strength: float) -> tuple[float, float]:
        model.load_state_dict(start)
        before = _loss(model, old)
        handle = attach(model, fisher, strength) if strength else None
        _train(model, new, steps=60, lr=0.05)
        if handle:
            handle.remove()
        return _loss(model, old) - before, _loss(model, new)

    plain_forgot, plain_new = forgetting(0.0)
    # lr * strength * max(F) stays below 2 here (plain SGD on the penalty would diverge above).
    ewc_forgot, ewc_new = forgetting(30.0)
    assert plain_forgot > 0.05, "the shift must make plain training forget for the test to mean anything"
    assert ewc_forgot < 0.6 * plain_forgot
    assert ewc_new < _loss_at(model, start, new), "with EWC the model still learns the new data"


def _loss_at(model, state, examples) -> float:
    current = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    value = _loss(model, examples)
    model.load_state_dict(current)
    return value


def test_consolidate_samples_the_table_and_reads_conversations(micro):
    model, tokenizer = micro
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    table = pd.DataFrame(
        {
            "messages": [
                [{"role": "user", "content": f"{a}+1"}, {"role": "assistant", "content": f"{a + 1}"}] for a in range(10)
            ]
        }
    )
    examples = ewc_examples(tokenizer, table, EwcParams(strength=1.0, samples=4), 32, 0, "sft.max_length", "t")
    assert len(examples) == 4
    ewc = consolidate(model, examples, strength=1.0)
    assert ewc.handles and ewc.penalty() == 0.0, "anchored at the current weights"
    assert any(float(f.sum()) > 0 for f in ewc.fisher.values())
    ewc.remove()


def test_rows_with_no_room_for_a_completion_are_counted_and_none_fitting_names_the_key(micro, capsys):
    """EWC measures on the SFT rows at the training method's max_length: a row whose
    prompt fills it has nothing to measure. It is left out and counted; none fitting fails,
    before the model would load, naming the key and the file."""
    from rlhf.training.trainer_setup import TrainingDataError

    _, tokenizer = micro
    table = pd.DataFrame({"prompt": ["1+1\n", "1+1+1+1+1+1+1+1+1+1+1+1\n"], "completion": ["2", "12"]})
    params = EwcParams(strength=1.0)
    assert len(ewc_examples(tokenizer, table, params, 12, 0, "policy.dpo.max_length", "sft.parquet")) == 1
    assert "policy.dpo.max_length 12: 1 of the 2 rows of sft.parquet that EWC measures on" in capsys.readouterr().out
    with pytest.raises(TrainingDataError, match=r"^policy.dpo.max_length 3: every one of the 2 rows of sft.parquet"):
        ewc_examples(tokenizer, table, params, 3, 0, "policy.dpo.max_length", "sft.parquet")


def test_policy_params_take_ewc_and_ppo_refuses_it_with_lora():
    from rlhf.training.methods.dpo import Params as DPOParams
    from rlhf.training.methods.ppo import Params as PPOMethodParams

    assert DPOParams(ewc={"strength": 10.0}).ewc.strength == 10.0
    with pytest.raises(ValueError, match="ewc.strength with lora.enabled"):
        PPOMethodParams(ewc={"strength": 1.0}, lora={"enabled": True})
