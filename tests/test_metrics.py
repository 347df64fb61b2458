"""Evaluation metrics (rlhf.evaluation.metrics) and the reward ensemble's pairwise accuracy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml

from rlhf.evaluation.metrics import completion_kl, distinct_n, wins
from rlhf.models.loading import build_tiny_model, build_tokenizer
from rlhf.rewards.ensemble import pairwise_accuracy

PROMPTS = ["23+58-17\n", "5+3\n", [{"role": "user", "content": "9-4"}]]
COMPLETIONS = ["23+58=81; 81-17=64; answer 64", "5+3=9; answer 9", "9-4=5; answer 5"]


# ----------------------------------------------------------------------------- distinct-n


@pytest.mark.parametrize(
    ("texts", "n", "expected"),
    [
        # a b a b: unigrams a, b, a, b -> 2 unique of 4.
        (["a b a b"], 1, 2 / 4),
        # bigrams (a b), (b a), (a b) -> 2 unique of 3.
        (["a b a b"], 2, 2 / 3),
        # Across texts: (a b), (b c) and (a b), (b d) -> 3 unique of 4; no bigram spans
        # the boundary between the two texts.
        (["a b c", "a b d"], 2, 3 / 4),
        # Trigrams: "x y z" has one, "x y" has none -> 1 unique of 1.
        (["x y z", "x y"], 3, 1.0),
        # Whitespace tokens: "a  b\nb" is a, b, b -> 2 unique of 3.
        (["a  b\nb"], 1, 2 / 3),
        # Identical texts: 3 bigrams each, (p q), (q r), (r s) -> 3 unique of 6.
        (["p q r s", "p q r s"], 2, 3 / 6),
        # No n-gram at all (texts shorter than n, or no texts) -> 0.
        (["a b"], 3, 0.0),
        ([], 1, 0.0),
    ],
)
def test_distinct_n(texts, n, expected):
    assert distinct_n(texts, n) == pytest.approx(expected)


# ----------------------------------------------------------------------------- win-rate


def test_win_rate_with_ties():
    """candidate [3, 1, 2, 2, 7] vs reference [1, 1, 5, 0, 7]: win, tie, loss, win, tie
    -> (1 + 0.5 + 0 + 1 + 0.5) / 5 = 3 / 5 = 0.6."""
    candidate = torch.tensor([3.0, 1.0, 2.0, 2.0, 7.0])
    reference = torch.tensor([1.0, 1.0, 5.0, 0.0, 7.0])
    assert float(wins(candidate, reference).mean()) == pytest.approx(0.6)
    # Swapped: loss, tie, win, loss, tie -> (0 + 0.5 + 1 + 0 + 0.5) / 5 = 0.4 = 1 - 0.6.
    assert float(wins(reference, candidate).mean()) == pytest.approx(0.4)


def test_wins_per_problem():
    """The per-problem outcomes behind win-rate (what reports/outcomes.json keeps for the
    gate's paired tests): candidate [3, 1, 2, 2, 7] vs reference [1, 1, 5, 0, 7] is win,
    tie, loss, win, tie -> [1, 0.5, 0, 1, 0.5], whose mean is the win-rate 0.6."""
    candidate = torch.tensor([3.0, 1.0, 2.0, 2.0, 7.0])
    reference = torch.tensor([1.0, 1.0, 5.0, 0.0, 7.0])
    outcome = wins(candidate, reference)
    assert outcome.tolist() == [1.0, 0.5, 0.0, 1.0, 0.5]
    assert float(outcome.mean()) == pytest.approx(0.6)


def test_win_rate_extremes():
    """All ties -> 0.5 each; all wins -> 1 each; no pairs -> no outcomes."""
    scores = torch.tensor([0.5, -2.0])
    assert wins(scores, scores.clone()).tolist() == [0.5, 0.5]
    assert wins(scores + 1, scores).tolist() == [1.0, 1.0]
    assert wins(torch.empty(0), torch.empty(0)).numel() == 0


def test_pairwise_accuracy_with_ties():
    """chosen [2, 0, 1, 4] vs rejected [1, 0, 3, 4]: right, tie, wrong, tie ->
    (1 + 0.5 + 0 + 0.5) / 4 = 0.5. A tie is half, not a win: `>=` would give 3/4."""
    chosen = torch.tensor([2.0, 0.0, 1.0, 4.0])
    rejected = torch.tensor([1.0, 0.0, 3.0, 4.0])
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(0.5)
    # chosen [1, 2, 3] vs rejected [0, 2, 5]: right, tie, wrong -> 1.5 / 3 = 0.5;
    # chosen [5, 5, 5] vs rejected [0, 5, 1]: right, tie, right -> 2.5 / 3.
    assert pairwise_accuracy(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 2.0, 5.0])) == pytest.approx(0.5)
    assert pairwise_accuracy(torch.tensor([5.0, 5.0, 5.0]), torch.tensor([0.0, 5.0, 1.0])) == pytest.approx(2.5 / 3)


# ----------------------------------------------------------------------------- KL


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def sharpened_model(tokenizer, seed: int):
    """A micro model whose tied embeddings are scaled by 5. Freshly initialised, its
    next-token distributions are near uniform and the KL is about the same at every
    position, so a window off by one position would change the sum by less than 1e-3;
    5x larger logits make the distributions, and the per-position KL, differ."""
    model = build_tiny_model("micro", tokenizer, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def policy(tokenizer):
    return sharpened_model(tokenizer, seed=0)


@pytest.fixture(scope="module")
def reference(tokenizer):
    return sharpened_model(tokenizer, seed=1)


def as_text(tokenizer, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def kl_by_hand(policy, reference, tokenizer, prompt, completion, window_shift: int = 0) -> float:
    """sum over completion tokens y_t of KL(pi(.|x, y<t) || pi_ref(.|x, y<t)), one
    unpadded sequence at a time. The logits at position i predict token i+1, so with a
    prompt of P tokens and T tokens in all, positions P-1 .. T-2 predict the completion.
    `window_shift` moves that window (to show that an off-by-one would be caught)."""
    text = as_text(tokenizer, prompt)
    prompt_len = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([tokenizer(text + completion, add_special_tokens=False)["input_ids"]])
    total = ids.shape[1]
    logp = F.log_softmax(policy(input_ids=ids).logits[0].float(), -1)
    logq = F.log_softmax(reference(input_ids=ids).logits[0].float(), -1)
    kl = 0.0
    for position in range(prompt_len - 1 + window_shift, total - 1 + window_shift):
        p, q = logp[position], logq[position]
        kl += float((p.exp() * (p - q)).sum())
    return kl


def test_two_seeds_give_two_models(policy, reference):
    assert not torch.equal(policy.model.embed_tokens.weight, reference.model.embed_tokens.weight)


def test_kl_of_a_model_to_itself_is_zero(policy, tokenizer):
    """KL(pi || pi) = sum p (log p - log p) = 0 at every position."""
    kl = completion_kl(policy, policy, tokenizer, PROMPTS, COMPLETIONS)
    assert kl.shape == (3,)
    assert torch.allclose(kl, torch.zeros(3), atol=1e-6)


def test_kl_matches_the_hand_computation(policy, reference, tokenizer):
    """Batched (batch_size 2, so a full and a partial batch, right-padded to different
    lengths, one conversational prompt) equals the sequence-by-sequence sum above, within
    1e-4; it is positive, and the reverse KL(pi_ref || pi) is a different number."""
    kl = completion_kl(policy, reference, tokenizer, PROMPTS, COMPLETIONS, batch_size=2)
    expected = torch.tensor([kl_by_hand(policy, reference, tokenizer, p, c) for p, c in zip(PROMPTS, COMPLETIONS)])
    assert torch.all(expected > 0)
    torch.testing.assert_close(kl, expected, atol=1e-4, rtol=0)
    # The tolerance is tight enough to catch an off-by-one window or swapped arguments.
    shifted = torch.tensor(
        [kl_by_hand(policy, reference, tokenizer, p, c, window_shift=1) for p, c in zip(PROMPTS, COMPLETIONS)]
    )
    reverse = completion_kl(reference, policy, tokenizer, PROMPTS, COMPLETIONS, batch_size=2)
    assert torch.all((shifted - expected).abs() > 1e-3)
    assert torch.all((reverse - expected).abs() > 1e-3)


def test_kl_does_not_depend_on_batching(policy, reference, tokenizer):
    one_by_one = completion_kl(policy, reference, tokenizer, PROMPTS, COMPLETIONS, batch_size=1)
    together = completion_kl(policy, reference, tokenizer, PROMPTS, COMPLETIONS, batch_size=32)
    torch.testing.assert_close(one_by_one, together, atol=1e-4, rtol=0)
    # A memory budget of one byte: every row of the batch goes through the models alone.
    within_budget = completion_kl(policy, reference, tokenizer, PROMPTS, COMPLETIONS, batch_size=32, budget=1)
    torch.testing.assert_close(within_budget, together, atol=1e-4, rtol=0)


def test_kl_of_an_empty_completion_is_zero(policy, reference, tokenizer):
    """No completion tokens: the sum over completion positions is empty, so 0 — while the
    other row of the batch still gets its own nonzero KL."""
    kl = completion_kl(policy, reference, tokenizer, ["5+3\n", "23+58-17\n"], ["", COMPLETIONS[0]])
    assert kl[0] == 0.0
    assert kl[1] == pytest.approx(kl_by_hand(policy, reference, tokenizer, "23+58-17\n", COMPLETIONS[0]), abs=1e-4)


def test_kl_prompts_zero_leaves_the_kl_unmeasured_not_zero(policy, reference, tokenizer, tmp_path):
    """evaluate.kl_prompts 0 ("skip") reported a KL of 0.0 for every candidate, as if each
    were SFT itself, and the gate's KL bound passed it. It is None (not measured) for a
    candidate, still 0 for the reference against itself; the default gate tests then hold no
    KL bound, and an explicit one is refused by check_params."""
    import pandas as pd

    from rlhf.evaluation.suites import evaluate_model
    from rlhf.tasks.arithmetic import ArithmeticTask
    from stages import load_all
    from stages.evaluate import Config
    from stages.gate import Config as GateConfig
    from stages.gate import resolve, resolved_config
    from tests.conftest import params_problems, tiny_params

    suite = pd.DataFrame({"prompt": PROMPTS[:2], "answer": ["64", "8"]})
    task = ArithmeticTask()

    def kl(config, model):
        return evaluate_model(config, task, model, reference, tokenizer, None, suite, None)[0]["kl_to_ref"]

    measured = Config(kl_prompts=2, max_new_tokens=8, bootstrap_samples=100)
    skipped = measured.model_copy(update={"kl_prompts": 0})
    assert kl(measured, policy) > 0
    assert kl(skipped, policy) is None and kl(skipped, reference) == 0.0
    assert "kl_to_ref" in [t.metric for t in resolve(GateConfig(), task, "dev").tests]
    data = tiny_params()
    data["gate"]["tests"] = None  # the defaults, resolved from params as the gate does
    for kl_prompts, bounded in ((8, True), (0, False)):
        data["evaluate"]["kl_prompts"] = kl_prompts
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(data))
        tests = resolved_config(load_all(str(path))).tests
        assert ("kl_to_ref" in [t.metric for t in tests]) is bounded, kl_prompts
    data["evaluate"]["kl_prompts"] = 0
    data["gate"]["tests"] = [{"metric": "kl_to_ref", "relative_to": "absolute", "op": "<=", "threshold": 1.0}]
    assert "gate.tests[0]: kl_to_ref is not measured with evaluate.kl_prompts 0" in " ".join(
        params_problems(tmp_path, data)
    )
