"""What the likelihood verifiers share (rlhf.rewards.prm_likelihood, rlhf.rewards.likelihood_rm): a causal
LM's log-prob of every token given the ones before it, and the small logistic fit that
calibrates features of those log-probs."""

from __future__ import annotations

import torch

# Bytes of float32 vocabulary-wide tensors one forward may hold: the logits and the
# temporaries of their log-softmax, about three rows x T x vocabulary each (a 150k
# vocabulary: about 2k tokens a forward).
LOGITS_BUDGET = 2**30


def token_logprobs(
    lm, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_budget: int = LOGITS_BUDGET
) -> torch.Tensor:
    """(B, T - 1): entry t - 1 is log p(token t | tokens < t), differentiable. The rows go
    through the LM a few at a time, so that their float32 logits and the log-softmax's
    temporaries (about 3 x rows x T x vocabulary) stay within `logits_budget` bytes
    whatever the batch: a large vocabulary's full logits would otherwise take tens of GB
    for one scoring batch."""
    vocab = lm.get_output_embeddings().weight.shape[0]
    rows = max(1, logits_budget // (3 * input_ids.shape[1] * vocab * 4))
    parts = []
    for start in range(0, input_ids.shape[0], rows):
        ids, mask = input_ids[start : start + rows], attention_mask[start : start + rows]
        logits = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()[:, :-1]
        parts.append(logits.gather(2, ids[:, 1:, None])[..., 0] - logits.logsumexp(-1))
        del logits
    return torch.cat(parts)


def fit_logistic(features: torch.Tensor, labels: torch.Tensor, l2: float = 1e-3, steps: int = 100):
    """Weights and bias of P(good) = sigmoid(features @ w + b), by L-BFGS on the mean
    binary cross-entropy plus l2 * |w|^2, and the loss at every evaluation (the curve)."""
    weights = torch.zeros(features.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], max_iter=steps, line_search_fn="strong_wolfe")
    targets = labels.float()
    curve: list[dict] = []

    def closure():
        optimizer.zero_grad()
        logits = features @ weights + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets) + l2 * weights.pow(2).sum()
        loss.backward()
        curve.append({"step": len(curve) + 1, "loss": float(loss.detach())})
        return loss

    optimizer.step(closure)
    return weights.detach(), float(bias.detach()), curve
