"""Preference pairs sampled from the policy itself, labelled by a verifiable answer check.

Offline pairs (a correct solution against a synthetic flaw) teach the model to avoid
mistakes it may never make; on small models DPO on them drifts and loses accuracy. Pairs
built from the model's own samples target the mistakes it does make: for each prompt, draw
`k` completions at `temperature`, keep the prompt if at least one is correct and one is
wrong, and pair a correct completion (chosen) with a wrong one (rejected). This is the
rejection-sampling recipe of iterative / on-policy DPO (e.g. Xu et al. 2023, "Some things
are more CRINGE than others"; Pang et al. 2024, "Iterative Reasoning Preference
Optimization").
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rlhf.generation import generate
from rlhf.task import is_correct


def sample_pairs(
    model,
    tokenizer,
    prompts: Sequence,
    answers: Sequence[str],
    k: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 64,
) -> tuple[list[dict], dict]:
    """(pairs, stats): one {prompt, chosen, rejected} per prompt with mixed outcomes."""
    completions = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        batch_size=batch_size,
        do_sample=True,
        temperature=temperature,
        num_return_sequences=k,
        seed=seed,
    )
    rng = random.Random(seed)
    pairs, correct_total = [], 0
    for index, (prompt, answer) in enumerate(zip(prompts, answers)):
        samples = completions[index * k : (index + 1) * k]
        good = [c for c in samples if is_correct(c, answer)]
        bad = [c for c in samples if not is_correct(c, answer)]
        correct_total += len(good)
        if good and bad:
            pairs.append({"prompt": prompt, "chosen": rng.choice(good), "rejected": rng.choice(bad)})
    stats = {
        "sampled": len(completions),
        "sample_accuracy": correct_total / max(len(completions), 1),
        "pairs": len(pairs),
    }
    return pairs, stats
