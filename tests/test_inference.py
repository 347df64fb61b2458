"""Inference-time strategies on micro models built in the test: speculative decoding and
logit ensembles reproduce plain greedy decoding exactly, votes stop early by the rule,
best-of-n keeps the best-scored sample, and the tree search's pieces behave as specified."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rlhf.models.generation import generate
from rlhf.inference.strategies import (
    Node,
    answer_key,
    best_of_n,
    ensemble_logits,
    ensemble_vote,
    mcts,
    puct,
    self_consistency,
    speculative,
    vote_is_decided,
)
from rlhf.models.loading import build_tiny_model, build_tokenizer

PROMPTS = ["12+7-3\n", "4+4+4+4\n", "29-9\n"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    torch.manual_seed(0)
    return [build_tiny_model("micro", tokenizer, seed=seed).eval() for seed in (0, 1)]


def test_speculative_output_equals_the_targets_greedy_output(models, tokenizer):
    target, draft = models
    plain = [generate(target, tokenizer, [p], max_new_tokens=20)[0] for p in PROMPTS]
    assisted = speculative(target, draft, tokenizer, PROMPTS, max_new_tokens=20, num_assistant_tokens=4)
    assert [a.completion for a in assisted] == plain
    assert all(0 < a.tokens <= 20 for a in assisted)


def test_logit_ensemble_of_one_model_is_its_greedy_decoding(models, tokenizer):
    plain = generate(models[0], tokenizer, PROMPTS, max_new_tokens=20)
    assert [a.completion for a in ensemble_logits(models[:1], tokenizer, PROMPTS, 20)] == plain
    # The same model twice averages to itself.
    assert [a.completion for a in ensemble_logits([models[0], models[0]], tokenizer, PROMPTS, 20)] == plain


def test_logit_ensemble_follows_the_mean_log_probs(models, tokenizer):
    """First token of the two-model ensemble = argmax of the mean of the two log-softmaxes."""
    batch = tokenizer([PROMPTS[0]], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        mean = sum(m(**batch).logits[0, -1].log_softmax(-1) for m in models) / 2
    first = tokenizer.decode([int(mean.argmax())], skip_special_tokens=True)
    assert ensemble_logits(models, tokenizer, PROMPTS[:1], 1)[0].completion == first


def test_vote_is_decided_by_the_rule():
    """Leader 3, runner-up 1, 1 vote left: 3 > 1 + 1 -> decided. Leader 2, runner-up 1, 2
    left: 2 > 3 is false, share 2/3 < 0.9 -> not decided; with stop_share 0.6 -> decided."""
    assert vote_is_decided(Counter({"5": 3, "6": 1}), remaining=1, stop_share=1.0, taken=4)
    assert not vote_is_decided(Counter({"5": 2, "6": 1}), remaining=2, stop_share=0.9, taken=3)
    assert vote_is_decided(Counter({"5": 2, "6": 1}), remaining=2, stop_share=0.6, taken=3)
    assert not vote_is_decided(Counter(), remaining=2, stop_share=0.5, taken=2)


def test_self_consistency_stops_early_when_the_vote_is_unanimous(models, tokenizer):
    """At a very low temperature every sample is the greedy one: the first round of 4 is
    unanimous, 4 > 0 + 12 is false, but the share 4/4 >= 0.75 stops it."""
    kwargs = {"max_samples": 16, "round_size": 4, "max_new_tokens": 12, "temperature": 1e-4}
    early = self_consistency(models[0], tokenizer, PROMPTS, stop_share=0.75, **kwargs)
    full = self_consistency(models[0], tokenizer, PROMPTS, early_stop=False, **kwargs)
    assert [a.samples for a in full] == [16, 16, 16]
    for e, f in zip(early, full):
        assert answer_key(e.completion) == answer_key(f.completion)
        if e.extra["votes"]:
            assert e.samples == 4


def test_best_of_n_returns_the_best_scored_sample(models, tokenizer):
    """A scorer that prefers long completions: the chosen one is the longest of its N."""
    answers = best_of_n(models[0], tokenizer, PROMPTS, scorer=lambda p, c: [len(x) for x in c], n=4, max_new_tokens=12)
    assert all(a.samples == 4 and a.extra["score"] == len(a.completion) for a in answers)


def test_answer_key():
    assert answer_key("1+2=3; answer 3") == "3"
    assert answer_key("The capital.\nAnswer: Paris ") == "paris"
    assert answer_key("") is None


def test_puct_prefers_unvisited_children_with_prior():
    """Parent visits 4: child a (Q 0.5, P 0.5, N 1) scores 0.5 + 1*0.5*2/2 = 1.0; child b
    (unvisited, P 0.5) scores 0 + 0.5*2/1 = 1.0 + 0 -> tie broken by value elsewhere; with
    c 2: a = 0.5 + 1.0 = 1.5, b = 2.0."""
    parent = Node(steps=(), visits=4)
    a = Node(steps=("x",), prior=0.5, visits=1, total=0.5)
    b = Node(steps=("y",), prior=0.5)
    assert puct(parent, a, 1.0) == pytest.approx(1.0) and puct(parent, b, 1.0) == pytest.approx(1.0)
    assert puct(parent, a, 2.0) == pytest.approx(1.5) and puct(parent, b, 2.0) == pytest.approx(2.0)


def test_mcts_runs_its_simulations_and_returns_a_path(models, tokenizer):
    """On the micro model, with a scorer that likes steps containing '=': the answer is made
    of sampled steps and the search stops at the simulation budget."""

    def scorer(prompts, steps_lists):
        return [[float("=" in s) for s in steps] for steps in steps_lists]

    answer = mcts(models[0], tokenizer, PROMPTS[0], scorer, simulations=4, expand=3, max_depth=3, max_step_tokens=6)
    assert answer.samples == 4 and answer.tokens > 0 and isinstance(answer.completion, str)


def test_ensemble_vote_counts_each_models_answer(models, tokenizer):
    answers = ensemble_vote(models, tokenizer, PROMPTS, max_new_tokens=8)
    assert all(a.samples == 2 for a in answers)


def test_mcts_widens_a_node_whose_children_all_score_low(models, tokenizer):
    """A scorer that rejects every step: with widening below 0.5 and at most 3 expansions,
    the root is expanded 3 times (then the search descends); without widening, once."""

    def reject(prompts, steps_lists):
        return [[0.0] * len(steps) for steps in steps_lists]

    kwargs = {"simulations": 5, "expand": 2, "max_depth": 2, "max_step_tokens": 6, "temperature": 1.0}
    widened = mcts(models[0], tokenizer, PROMPTS[0], reject, widen_below=0.5, max_expansions=3, **kwargs)
    plain = mcts(models[0], tokenizer, PROMPTS[0], reject, **kwargs)
    assert widened.extra["root_expansions"] == 3 and plain.extra["root_expansions"] == 1
