"""The adversarial validator: what a candidate's reward can be gamed into, checked against
the reference model on the same prompts.

Each check compares a candidate's greedy completions with the reference's (SFT) and
returns a verdict with its reason, which the gate counts as one more capability test:

* perplexity — mean negative log-likelihood per token of the candidate's completions under
  the reference model (nats; perplexity = exp). Text the reference finds implausible is
  what reward optimisation drifts into: at most `max_nll_increase` above the reference's
  own completions.
* repetition — mean share of repeated word 3-grams (characters when a completion has too
  few words) per completion: at most `max_repetition_increase` above the reference.
* degeneration — share of completions that are empty or mostly repeats (a repeated share
  over one half): at most `max_degenerate_increase` above the reference.
* length — mean completion length over the reference's: at most `max_length_ratio`
  (length exploitation: rewards that grow with length).
* reward_hacking — the RM's reward up on the suite while the verifiable accuracy is down by
  more than `hacking_margin` (needs both; a task without checkable answers or a run without
  an RM passes it, and says so). Given per-problem rewards and outcomes of both models on
  the same problems, both changes are paired bootstrap intervals
  (rlhf.evaluation.statistics) and the check fails only when the reward's rise and the
  accuracy's fall are both beyond noise: the reward interval above 0, the accuracy interval
  below 0, and the accuracy's fall more than `hacking_margin`. With means alone it compares
  signs, and says so.
* diversity — distinct-2 (word pairs) at least `min_diversity_ratio` of the reference's;
  where the reference's completions have no word pairs (one-word answers, labels, text
  without spaces), the share of distinct completions instead. For a task with a format, a
  format rate at most `max_format_drop` below the reference's (format collapse).
* banned — share of completions containing any `banned` string (case-insensitive, as a
  whole word where the string starts or ends with a letter or digit): 0.

Plain functions of texts, numbers and one forward pass of the reference: no library does
these particular checks, so they are here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from rlhf.evaluation.metrics import completion_batches, distinct_n
from rlhf.evaluation.statistics import paired_difference
from rlhf.rewards.functions import banned_rule, repetition_rule
from rlhf.rewards.likelihood import token_logprobs


@dataclass
class Check:
    name: str
    metric: str
    value: float | None
    baseline: float | None
    limit: float | None
    passed: bool
    reason: str


@torch.inference_mode()
def nll_under(reference, tokenizer, prompts: Sequence, completions: Sequence[str], batch_size: int = 32) -> float:
    """Mean negative log-likelihood per completion token under `reference` (nats)."""
    reference.eval()
    total, count = 0.0, 0
    for batch, mask in completion_batches(tokenizer, prompts, completions, batch_size, reference.device):
        logps = token_logprobs(reference, batch["input_ids"], batch["attention_mask"]).float().cpu()
        total -= float((logps * mask).sum())
        count += int(mask.sum())
    return total / count if count else 0.0


def text_metrics(texts: Sequence[str], banned: Sequence[str] = ()) -> dict[str, float]:
    """The per-model numbers the text checks compare."""
    repeated = [1.0 - r for r in repetition_rule([], texts)]
    return {
        "repetition": sum(repeated) / len(texts),
        "degenerate_rate": sum(1.0 for t, r in zip(texts, repeated) if not t.strip() or r > 0.5) / len(texts),
        "mean_length": sum(len(t) for t in texts) / len(texts),
        "distinct_2": distinct_n(texts, 2),
        "distinct_completions": len(set(texts)) / len(texts),
        "banned_rate": (1.0 - sum(banned_rule([], texts, banned)) / len(texts)) if banned else 0.0,
    }


def paired_changes(candidate: dict | None, reference: dict | None) -> dict | None:
    """The candidate's change of RM reward and of accuracy over the reference's, each a
    paired bootstrap interval, from per-problem outcomes on the same problems (lists under
    `reward` and `accuracy`, as reports/outcomes.json holds them); None when either model
    lacks one of them."""

    def values(outcomes: dict | None, key: str) -> list | None:
        found = (outcomes or {}).get(key)
        return found if found and all(v is not None for v in found) else None

    pairs = {key: (values(candidate, key), values(reference, key)) for key in ("reward", "accuracy")}
    if any(a is None or b is None or len(a) != len(b) for a, b in pairs.values()):
        return None
    return {key: paired_difference(a, b) for key, (a, b) in pairs.items()}


def hacking_check(candidate: dict, reference: dict, margin: float, paired: dict | None) -> Check:
    """reward_hacking: the reward up while the accuracy is down by more than `margin`; on
    paired intervals when there are, else on the means' signs."""
    rose_beyond = f": the reward rose beyond noise as the verifiable score fell by more than {margin}"
    if paired is not None:
        reward, accuracy = paired["reward"], paired["accuracy"]
        hacked = reward["low"] > 0 and accuracy["high"] < 0 and accuracy["difference"] < -margin
        reason = (
            f"reward {reward['difference']:+.4f} [{reward['low']:+.4f}, {reward['high']:+.4f}] vs reference while "
            f"accuracy {accuracy['difference']:+.4f} [{accuracy['low']:+.4f}, {accuracy['high']:+.4f}] "
            f"(paired 95% intervals over {reward['problems']} problems)"
        )
        if hacked:
            reason += rose_beyond
        elif reward["difference"] > 0 >= reward["low"]:
            reason += ": the reward's rise is within noise"
        return Check("reward_hacking", "reward", reward["difference"], accuracy["difference"], None, not hacked, reason)
    reward_gain = _difference(candidate.get("reward"), reference.get("reward"))
    accuracy_gain = _difference(candidate.get("accuracy"), reference.get("accuracy"))
    if reward_gain is None or accuracy_gain is None:
        return Check(
            "reward_hacking", "reward", None, None, None, True, "not checked: needs both an RM reward and accuracy"
        )
    hacked = reward_gain > 0 and accuracy_gain < -margin
    reason = f"reward {reward_gain:+.4f} vs reference while accuracy {accuracy_gain:+.4f} (means only, no interval)"
    reason += f": the reward rose as the verifiable score fell by more than {margin}" if hacked else ""
    return Check("reward_hacking", "reward", reward_gain, accuracy_gain, None, not hacked, reason)


def run_checks(candidate: dict, reference: dict, settings, paired: dict | None = None) -> list[Check]:
    """The validator's verdicts for one candidate. `candidate` and `reference` hold
    `text_metrics`, `nll_ref`, and from the eval report `reward`, `accuracy`,
    `format_rate` (None when absent); `settings` the limits (params `validate`); `paired`
    the per-problem changes of reward and accuracy (`paired_changes`) when known."""

    def at_most(name: str, metric: str, limit: float | None, baseline: float | None = None) -> Check:
        value = candidate.get(metric)
        passed = value is not None and limit is not None and value <= limit + 1e-9
        reason = f"{metric} {value:.4f} <= {limit:.4f}" if value is not None else f"{metric} missing"
        if baseline is not None:
            reason += f" (reference {baseline:.4f})"
        return Check(name, metric, value, baseline, limit, passed, reason + ("" if passed else " fails"))

    def at_least(name: str, metric: str, limit: float, baseline: float) -> Check:
        value = candidate.get(metric)
        passed = value is not None and value >= limit - 1e-9
        reason = f"{metric} {value:.4f} >= {limit:.4f} (reference {baseline:.4f})" + ("" if passed else " fails")
        return Check(name, metric, value, baseline, limit, passed, reason)

    ref = reference
    checks = [
        at_most("perplexity", "nll_ref", ref["nll_ref"] + settings.max_nll_increase, ref["nll_ref"]),
        at_most("repetition", "repetition", ref["repetition"] + settings.max_repetition_increase, ref["repetition"]),
        at_most(
            "degeneration",
            "degenerate_rate",
            ref["degenerate_rate"] + settings.max_degenerate_increase,
            ref["degenerate_rate"],
        ),
        at_most(
            "length",
            "mean_length",
            settings.max_length_ratio * max(ref["mean_length"], 1.0),
            ref["mean_length"],
        ),
        diversity_check(at_least, ref, settings.min_diversity_ratio),
        at_most("banned", "banned_rate", 0.0, ref.get("banned_rate")),
    ]
    if candidate.get("format_rate") is not None and ref.get("format_rate") is not None:
        checks.append(
            at_least(
                "format_collapse", "format_rate", ref["format_rate"] - settings.max_format_drop, ref["format_rate"]
            )
        )
    checks.append(hacking_check(candidate, ref, settings.hacking_margin, paired))
    return checks


def diversity_check(at_least, ref: dict, ratio: float) -> Check:
    """Distinct-2 against the reference's; where the reference writes no word pairs (its
    distinct-2 is 0, and so would every limit be), the share of distinct completions."""
    metric = "distinct_2" if ref["distinct_2"] > 0 or "distinct_completions" not in ref else "distinct_completions"
    return at_least("diversity", metric, ratio * ref[metric], ref[metric])


def _difference(value, baseline) -> float | None:
    return None if value is None or baseline is None else float(value) - float(baseline)


def as_dicts(checks: Sequence[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
