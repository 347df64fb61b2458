"""A likelihood reward model: a causal LM's log-probs of the response, as one scalar reward.

A sequence classifier (TRL's default reward model) scores a response from the hidden state
of its last token. On the built-in task the rejected response differs from the chosen one by
one arithmetic slip, a miscopied number or a wrong final answer, somewhere in the middle; a
small classifier trained on a few thousand pairs does not learn to find it (held-out pairwise
accuracy 0.55-0.57, whatever the initial model). The causal LM it starts from already
predicts every token of the response, and a slip is a token it finds improbable. This reward
model reads two features of the response tokens (the EOS included) from the LM:

    f_min  = min_t  log p(y_t | x, y_<t)
    f_mean = mean_t log p(y_t | x, y_<t)

and scores r(x, y) = w . f + b. The head starts from a Bradley-Terry fit on the frozen LM's
features (logistic regression on chosen-minus-rejected differences, `fit_head`); TRL's
`RewardTrainer` then trains the LM and the head together on the same loss,
-log sigmoid(r_chosen - r_rejected).

`RewardTrainer` passes every tensor its collator makes to the model, so
`ResponseMaskCollator` adds `response_mask` (1 on the response's tokens) to TRL's
preference collator; the rows are tokenized (`encode`) with the index where the response
starts. The collator, the trainer and the head's fit are in
rlhf/rewards/likelihood_rm_training.py, so that scoring imports neither TRL nor datasets.
Saved as the LM's own directory plus `reward_head.json` (the weights), so the LM stays
readable by every other tool.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from transformers.modeling_outputs import SequenceClassifierOutput

from rlhf.models.generation import encode_response as encode
from rlhf.models.loading import load_causal_lm, save_model
from rlhf.rewards.likelihood import token_logprobs

KIND = "likelihood"
HEAD_FILE = "reward_head.json"
FEATURES = ("min_logprob", "mean_logprob")


def response_mask(starts: Sequence[int], attention_mask: torch.Tensor) -> torch.Tensor:
    """1 from each row's response start to its last token."""
    positions = torch.arange(attention_mask.shape[1])
    return ((positions[None, :] >= torch.tensor(list(starts))[:, None]) & attention_mask.bool()).long()


def response_batch(encoded: Sequence[tuple[list[int], int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and response_mask of (ids, start) rows."""
    ids = [torch.tensor(row) for row, _ in encoded]
    attention_mask = pad_sequence([torch.ones_like(row) for row in ids], batch_first=True, padding_value=0)
    return {
        "input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_token_id),
        "attention_mask": attention_mask,
        "response_mask": response_mask([start for _, start in encoded], attention_mask),
    }


def response_features(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 2) features from per-token log-probs (B, T) and a mask of the tokens to read."""
    mask = mask.bool()
    lowest = token_logps.masked_fill(~mask, float("inf")).min(1).values
    mean = (token_logps * mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.stack([lowest, mean], dim=1)


class LikelihoodRewardModel(nn.Module):
    """r(x, y) = w . features(log p_LM(y | x)) + b, with the LM trainable (see the module docstring)."""

    def __init__(self, lm, weights: Sequence[float] = (1.0, 1.0), bias: float = 0.0):
        super().__init__()
        self.lm = lm
        # RewardTrainer and Trainer read the config (num_labels, pad token, use_cache).
        self.config = copy.deepcopy(lm.config)
        self.config.num_labels = 1
        self.head = nn.Linear(len(FEATURES), 1, device=next(lm.parameters()).device)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([list(weights)], dtype=torch.float32))
            self.head.bias.fill_(float(bias))

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def add_model_tags(self, tags) -> None:  # RewardTrainer tags the model it trains
        if hasattr(self.lm, "add_model_tags"):
            self.lm.add_model_tags(tags)

    def activation_checkpointing_enable(self, **kwargs) -> None:  # Trainer, with activation_checkpointing
        self.lm.activation_checkpointing_enable(**kwargs)
        if hasattr(self.lm, "enable_input_require_grads"):  # LoRA: frozen embeddings need grad-carrying inputs
            self.lm.enable_input_require_grads()

    @property
    def _keys_to_ignore_on_save(self) -> list[str]:  # read by Trainer's resume
        return tied_aliases(self)

    def tie_weights(self) -> None:
        self.lm.tie_weights()

    def features(self, input_ids, attention_mask=None, response_mask=None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if response_mask is None:  # no prompt boundary: read every token but the first
            response_mask = attention_mask
        logps = token_logprobs(self.lm, input_ids, attention_mask)
        return response_features(logps, response_mask[:, 1:] * attention_mask[:, 1:])

    def forward(self, input_ids, attention_mask=None, response_mask=None, **_) -> SequenceClassifierOutput:
        features = self.features(input_ids, attention_mask, response_mask)
        # In fp32 even under bf16 autocast: bf16 would round nearby rewards (and their margins) together.
        with torch.autocast(device_type=features.device.type, enabled=False):
            return SequenceClassifierOutput(logits=self.head(features.float()))

    @torch.inference_mode()
    def score(self, tokenizer, prompts: Sequence, completions: Sequence, batch_size: int = 64) -> torch.Tensor:
        self.eval()
        encoded = [encode(tokenizer, p, c) for p, c in zip(prompts, completions)]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        scores = []
        for begin in range(0, len(encoded), batch_size):
            batch = response_batch(encoded[begin : begin + batch_size], pad)
            scores.append(self(**{k: v.to(self.device) for k, v in batch.items()}).logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.empty(0)

    def settings(self) -> dict:
        return {
            "kind": KIND,
            "features": list(FEATURES),
            "weights": self.head.weight[0].detach().tolist(),
            "bias": float(self.head.bias.detach()),
        }

    def save(self, tokenizer, path: str | Path, lm=None) -> None:
        """Write the LM (`lm`, e.g. with a LoRA adapter merged, else self.lm) and the head."""
        save_model(lm if lm is not None else self.lm, tokenizer, path)
        (Path(path) / HEAD_FILE).write_text(json.dumps(self.settings(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, trust_remote_code: bool = False, what: str = "reward model"):
        settings = json.loads((Path(path) / HEAD_FILE).read_text())
        lm = load_causal_lm(path, trust_remote_code, what=what)
        return cls(lm, settings["weights"], settings["bias"])


def tied_aliases(module: nn.Module) -> list[str]:
    """State-dict names whose tensor an earlier name already holds (tied weights)."""
    seen, aliases = set(), []
    for name, tensor in module.state_dict().items():
        key = (tensor.data_ptr(), tensor.shape)
        if key in seen:
            aliases.append(name)
        seen.add(key)
    return aliases


def is_likelihood_rm(path: str | Path) -> bool:
    return (Path(path) / HEAD_FILE).is_file()
