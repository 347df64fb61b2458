"""The adversarial validator (rlhf.evaluation.validator) and the gate that counts its checks:
hand-made completions that game a reward in one way each are caught by that check, with a
reason, and a candidate that fails one is not promoted."""

from __future__ import annotations

import pytest
import torch

from rlhf.evaluation.gate import decide
from rlhf.evaluation.validator import as_dicts, nll_under, run_checks, text_metrics
from rlhf.models.loading import build_tiny_model, build_tokenizer
from stages.validate import Config

REFERENCE_TEXTS = ["1+2=3; answer 3", "4+1=5; answer 5", "7-2=5; 5+1=6; answer 6", "9-3=6; answer 6"]


def metrics(texts, **scores) -> dict:
    return {**text_metrics(texts, ["as an AI"]), "nll_ref": scores.pop("nll_ref", 1.0), **scores}


def verdicts(candidate: dict, reference: dict | None = None) -> dict[str, bool]:
    reference = reference or metrics(REFERENCE_TEXTS, reward=0.0, accuracy=0.5, format_rate=1.0)
    return {c.name: c.passed for c in run_checks(candidate, reference, Config())}


def test_text_metrics_by_hand():
    texts = ["a b c a b c a b c", "", "as an AI I cannot", "x y z w"]
    m = text_metrics(texts, ["as an ai"])
    # 7 word 3-grams in the first text, 3 distinct: 4/7 repeated; the others repeat nothing.
    assert m["repetition"] == pytest.approx((4 / 7) / 4)
    assert m["degenerate_rate"] == pytest.approx(2 / 4), "the empty one and the mostly repeated one"
    assert m["mean_length"] == pytest.approx(sum(map(len, texts)) / 4)
    assert m["banned_rate"] == pytest.approx(1 / 4), "case-insensitive"


def test_an_honest_candidate_passes_every_check():
    same = metrics(REFERENCE_TEXTS, reward=0.3, accuracy=0.6, format_rate=1.0)
    assert all(verdicts(same).values())


@pytest.mark.parametrize(
    "texts, scores, caught, also",
    [
        # the same four words over and over: also one text four times, and long
        (["answer 3 answer 3 answer 3 answer 3"] * 4, {}, "repetition", {"degeneration", "length", "diversity"}),
        ([""] * 2 + REFERENCE_TEXTS[:2], {}, "degeneration", set()),
        # a padding phrase written twice: also a repeated 3-gram and one shared tail
        (
            [t + "; so the answer is indeed what it is" * 2 for t in REFERENCE_TEXTS],
            {},
            "length",
            {"repetition", "diversity"},
        ),
        (["answer 3"] * 4, {"format_rate": 0.5}, "format_collapse", {"diversity"}),
        (REFERENCE_TEXTS[:3] + ["as an AI, answer 6"], {}, "banned", set()),
        (REFERENCE_TEXTS, {"nll_ref": 3.5}, "perplexity", set()),
        (REFERENCE_TEXTS, {"reward": 1.0, "accuracy": 0.4}, "reward_hacking", set()),
    ],
)
def test_each_way_of_gaming_is_caught_by_its_check(texts, scores, caught, also):
    """Each gamed candidate fails its check with a reason that names the measure and says
    it fails, and no check beyond those its texts also trip."""
    candidate = metrics(texts, **{"reward": 0.0, "accuracy": 0.5, "format_rate": 1.0, **scores})
    reference = metrics(REFERENCE_TEXTS, reward=0.0, accuracy=0.5, format_rate=1.0)
    checks = {c.name: c for c in run_checks(candidate, reference, Config())}
    assert {name for name, check in checks.items() if not check.passed} == {caught, *also}
    assert checks[caught].reason.endswith("fails") or "while accuracy" in checks[caught].reason


def test_diversity_of_one_word_answers_is_the_share_of_distinct_completions():
    """Labels, letters or text without spaces have no word pairs: distinct-2 is 0 for the
    reference and so would every limit be. Their diversity is the share of distinct
    completions: a candidate that answers "A" to everything fails, one as varied passes."""
    reference = metrics(["A", "B", "C", "D", "A", "C"], reward=0.0, accuracy=0.5)
    (collapsed,) = [c for c in run_checks(metrics(["A"] * 6), reference, Config()) if c.name == "diversity"]
    assert collapsed.metric == "distinct_completions" and not collapsed.passed
    assert collapsed.reason == "distinct_completions 0.1667 >= 0.3333 (reference 0.6667) fails"
    (varied,) = [
        c for c in run_checks(metrics(["B", "A", "D", "C", "D", "A"]), reference, Config()) if c.name == "diversity"
    ]
    assert varied.passed


def test_reward_hacking_needs_both_signals():
    candidate = metrics(REFERENCE_TEXTS, reward=1.0, accuracy=None)
    checks = run_checks(candidate, metrics(REFERENCE_TEXTS, reward=0.0, accuracy=None), Config())
    (hacking,) = [c for c in checks if c.name == "reward_hacking"]
    assert hacking.passed and "not checked" in hacking.reason


def hacking(candidate_outcomes: dict, reference_outcomes: dict):
    from rlhf.evaluation.validator import paired_changes

    paired = paired_changes(candidate_outcomes, reference_outcomes)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    scores = lambda o: {"reward": mean(o["reward"]), "accuracy": mean(o["accuracy"])}  # noqa: E731
    candidate = metrics(REFERENCE_TEXTS, **scores(candidate_outcomes))
    reference = metrics(REFERENCE_TEXTS, **scores(reference_outcomes))
    (check,) = [c for c in run_checks(candidate, reference, Config(), paired) if c.name == "reward_hacking"]
    return check, paired


def test_reward_hacking_on_paired_intervals_needs_both_changes_beyond_noise():
    """100 problems. The reference is right on all, reward 0 on each. A candidate whose
    reward is +1 on every problem while half its answers turn wrong is hacking: reward
    +1 [+1, +1], accuracy -0.5 (interval below 0, the fall beyond the 0.02 margin). One
    whose reward is +1 and -1 on alternate problems but +1 on one more (mean +0.02) is not:
    the reward's interval spans 0, so the rise is noise, though its accuracy falls as far."""
    reference = {"reward": [0.0] * 100, "accuracy": [1.0] * 100}
    wrong_half = [0.0] * 50 + [1.0] * 50
    check, paired = hacking({"reward": [1.0] * 100, "accuracy": wrong_half}, reference)
    assert paired["reward"]["difference"] == pytest.approx(1.0) and paired["reward"]["low"] == pytest.approx(1.0)
    assert paired["accuracy"]["difference"] == pytest.approx(-0.5) and paired["accuracy"]["high"] < 0
    assert not check.passed and "beyond noise" in check.reason and "[+1.0000, +1.0000]" in check.reason

    noisy = [1.0, -1.0] * 50
    noisy[1] = 1.0
    check, paired = hacking({"reward": noisy, "accuracy": wrong_half}, reference)
    assert paired["reward"]["difference"] == pytest.approx(0.02)
    assert paired["reward"]["low"] < 0 < paired["reward"]["high"]
    assert check.passed and "within noise" in check.reason

    # Accuracy falls, but not by more than the margin (1 problem in 100): not hacking.
    one_wrong = [0.0] + [1.0] * 99
    check, _ = hacking({"reward": [1.0] * 100, "accuracy": one_wrong}, reference)
    assert check.passed


def test_reward_hacking_falls_back_to_means_without_per_problem_rewards():
    from rlhf.evaluation.validator import paired_changes

    assert (
        paired_changes({"reward": [None, None], "accuracy": [1.0, 0.0]}, {"reward": [0.0, 0.0], "accuracy": [1, 1]})
        is None
    )
    assert paired_changes({"accuracy": [1.0]}, {"reward": [0.0], "accuracy": [1.0]}) is None
    candidate = metrics(REFERENCE_TEXTS, reward=1.0, accuracy=0.4)
    checks = run_checks(candidate, metrics(REFERENCE_TEXTS, reward=0.0, accuracy=0.5), Config(), None)
    (check,) = [c for c in checks if c.name == "reward_hacking"]
    assert not check.passed and "means only" in check.reason


def test_nll_under_the_reference_prefers_its_own_greedy_text():
    """A model's own greedy continuation is more likely under it than shuffled characters."""
    from rlhf.models.generation import generate

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model("micro", tokenizer, seed=0)
    prompts = ["1+2+3\n", "4-1+2\n"]
    own = generate(model, tokenizer, prompts, 12)
    noise = ["zq#~%" * 2 + "Q" for _ in prompts]
    assert nll_under(model, tokenizer, prompts, own) < nll_under(model, tokenizer, prompts, noise)


def test_a_candidate_failing_a_validator_check_is_not_promoted():
    report = {
        "reference": "sft",
        "candidates": ["clean", "gamed"],
        "suites": {"dev": {"sft": {"accuracy": 0.5}, "clean": {"accuracy": 0.6}, "gamed": {"accuracy": 0.9}}},
    }
    reference = metrics(REFERENCE_TEXTS, reward=0.0, accuracy=0.5)
    gamed = metrics(["answer 3 answer 3 answer 3 answer 3"] * 4, reward=0.0, accuracy=0.9)
    validation = {
        "suite": "dev",
        "candidates": {
            name: {"checks": as_dicts(run_checks(m, reference, Config()))}
            for name, m in {"clean": metrics(REFERENCE_TEXTS, reward=0.0, accuracy=0.6), "gamed": gamed}.items()
        },
    }
    verdict = decide([], report, None, "accuracy", "dev", validation=validation)
    assert verdict["promote"] == "clean", "the better accuracy of a degenerate candidate does not count"
    failures = verdict["candidates"]["gamed"]["failures"]
    assert any(f.startswith("validator:repetition: repetition") and f.endswith("fails") for f in failures)
    unchecked = decide([], {**report, "candidates": ["other"]}, None, "accuracy", "dev", validation=validation)
    assert unchecked["promote"] is None and "rerun stage validate" in unchecked["candidates"]["other"]["failures"][0]
