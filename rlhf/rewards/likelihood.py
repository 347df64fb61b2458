"""What the likelihood verifiers share (rlhf.rewards.prm_likelihood, rlhf.rewards.likelihood_rm): a causal
LM's log-prob of every token given the ones before it, and the small logistic fit that
calibrates features of those log-probs."""

from __future__ import annotations

import torch


def token_logprobs(lm, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T - 1): entry t - 1 is log p(token t | tokens < t), differentiable."""
    logits = lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()[:, :-1]
    chosen = logits.gather(2, input_ids[:, 1:, None])[..., 0]
    return chosen - logits.logsumexp(-1)


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
