"""Evaluation metrics for generated completions.

* task accuracy and format compliance — exact checks of the built-in task (rlhf.tasks.arithmetic), or
  any answer checker for user suites;
* KL to the reference — the mean over prompts of sum_t KL(pi(.|x, y<t) || pi_ref(.|x, y<t)),
  the full-distribution KL at every generated position of the candidate's own completion
  (the quantity the RLHF objective's KL penalty bounds);
* win-rate — how often a judge (the RM ensemble) scores the candidate's completion above
  the reference's for the same prompt, ties counting half;
* distinct-n — unique n-grams over all n-grams of all completions (Li et al. 2016).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from rlhf.models.generation import format_prompt


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Unique n-grams / total n-grams over the whitespace tokens of `texts`."""
    total, unique = 0, set()
    for text in texts:
        tokens = text.split()
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        unique.update(grams)
    return len(unique) / total if total else 0.0


def wins(candidate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per problem: 1 where the candidate's reward beats the reference's, 0.5 on a tie."""
    return (candidate > reference).float() + 0.5 * (candidate == reference).float()


@torch.inference_mode()
def completion_kl(
    policy, reference, tokenizer, prompts: Sequence, completions: Sequence[str], batch_size: int = 32
) -> torch.Tensor:
    """Per-prompt sum over completion tokens of KL(policy || reference)."""
    policy.eval()
    reference.eval()
    tokenizer.padding_side = "right"
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk_prompts = [format_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        chunk_completions = list(completions[start : start + batch_size])
        prompt_lens = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in chunk_prompts]
        batch = tokenizer(
            [p + c for p, c in zip(chunk_prompts, chunk_completions)],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        ).to(policy.device)
        logp = F.log_softmax(policy(**batch).logits.float(), -1)
        logq = F.log_softmax(reference(**batch).logits.float(), -1)
        per_token = (logp.exp() * (logp - logq)).sum(-1)  # (B, T): KL of the next-token distributions
        # Position t predicts token t+1: completion tokens are predicted from prompt_len-1 on.
        mask = torch.zeros_like(per_token)
        lengths = batch["attention_mask"].sum(-1)
        for row, (plen, total) in enumerate(zip(prompt_lens, lengths.tolist())):
            mask[row, plen - 1 : total - 1] = 1.0
        results.append((per_token * mask).sum(-1).cpu())
    return torch.cat(results) if results else torch.empty(0)
