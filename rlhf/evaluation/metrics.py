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


def completion_batches(tokenizer, prompts: Sequence, completions: Sequence[str], batch_size: int, device):
    """Prompt + completion, right-padded, in batches: (batch, mask) where mask (B, T - 1) is 1
    at the positions that predict a completion token (position t predicts token t + 1, so
    from prompt length - 1 on)."""
    tokenizer.padding_side = "right"
    for start in range(0, len(prompts), batch_size):
        heads = [format_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        tails = list(completions[start : start + batch_size])
        head_lengths = [len(tokenizer(h, add_special_tokens=False)["input_ids"]) for h in heads]
        batch = tokenizer(
            [h + t for h, t in zip(heads, tails)], return_tensors="pt", padding=True, add_special_tokens=False
        ).to(device)
        mask = torch.zeros(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1)
        for row, (head, total) in enumerate(zip(head_lengths, batch["attention_mask"].sum(-1).tolist())):
            mask[row, head - 1 : total - 1] = 1.0
        yield batch, mask
    tokenizer.padding_side = "left"


# The float32 vocabulary-wide tensors one KL forward may hold at once, in bytes: the two
# models' log-probs and their temporaries, about six rows x T x vocabulary each.
KL_BUDGET = 2**30


@torch.inference_mode()
def completion_kl(
    policy,
    reference,
    tokenizer,
    prompts: Sequence,
    completions: Sequence[str],
    batch_size: int = 32,
    budget: int = KL_BUDGET,
) -> torch.Tensor:
    """Per-prompt sum over completion tokens of KL(policy || reference). The rows of a batch
    go through both models a few at a time, so that their full-vocabulary log-probs stay
    within `budget` bytes whatever the batch, the length and the vocabulary (32 sequences of
    400 tokens over a 150k vocabulary would otherwise hold some 40 GB)."""
    policy.eval()
    reference.eval()
    vocab = policy.get_output_embeddings().weight.shape[0]
    results = []
    for batch, mask in completion_batches(tokenizer, prompts, completions, batch_size, policy.device):
        length = batch["input_ids"].shape[1]
        rows = max(1, budget // (6 * length * vocab * 4))
        for start in range(0, batch["input_ids"].shape[0], rows):
            part = {key: value[start : start + rows] for key, value in batch.items()}
            logp = F.log_softmax(policy(**part).logits.float()[:, :-1], -1)
            logq = F.log_softmax(reference(**part).logits.float()[:, :-1], -1)
            logq.neg_().add_(logp)  # logp - logq, in place
            per_token = (logp.exp_() * logq).sum(-1)  # (rows, T - 1): KL of the next-token distributions
            del logp, logq
            results.append((per_token.cpu() * mask[start : start + rows]).sum(-1))
    return torch.cat(results) if results else torch.empty(0)
