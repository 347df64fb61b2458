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
preference collator; the rows are tokenized here (`encode`) with the index where the
response starts. Saved as the LM's own directory plus `reward_head.json` (the weights), so
the LM stays readable by every other tool.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from datasets import Dataset
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.trainer import SAFE_WEIGHTS_NAME, TRAINING_ARGS_NAME
from trl import RewardTrainer
from trl.trainer.reward_trainer import DataCollatorForPreference
from trl.trainer.utils import pad

from rlhf.models.generation import encode_response as encode
from rlhf.models.loading import load_causal_lm, save_model
from rlhf.rewards.likelihood import fit_logistic, token_logprobs

KIND = "likelihood"
HEAD_FILE = "reward_head.json"
FEATURES = ("min_logprob", "mean_logprob")


def pairs_dataset(tokenizer, pairs, max_length: int | None = None) -> tuple[Dataset, int]:
    """Pre-tokenized preference rows for `RewardTrainer` (chosen_ids, rejected_ids and where
    each response starts), and how many pairs were dropped for exceeding max_length.
    `pairs`: a `datasets.Dataset` (a prepared table, memory-mapped: the tokens are cached
    with it) or a frame with prompt, chosen and rejected."""
    if not isinstance(pairs, Dataset):
        pairs = Dataset.from_pandas(pairs[["prompt", "chosen", "rejected"]], preserve_index=False)
    encoded = pairs.map(
        encoded_pair, fn_kwargs={"tokenizer": tokenizer}, remove_columns=pairs.column_names, desc="Tokenizing pairs"
    )
    if max_length is not None:
        encoded = encoded.filter(fits_length, fn_kwargs={"max_length": max_length}, desc="Pairs within max_length")
    if not len(encoded):
        raise ValueError(f"every preference pair is longer than max_length={max_length} tokens; raise rm.max_length")
    return encoded, len(pairs) - len(encoded)


def encoded_pair(row: dict, tokenizer) -> dict:
    """One pair's `pairs_dataset` row (a `map` function)."""
    chosen_ids, chosen_start = encode(tokenizer, row["prompt"], row["chosen"])
    rejected_ids, rejected_start = encode(tokenizer, row["prompt"], row["rejected"])
    return {"chosen_ids": chosen_ids, "rejected_ids": rejected_ids, "chosen_start": chosen_start,
            "rejected_start": rejected_start}  # fmt: skip


def fits_length(row: dict, max_length: int) -> bool:
    return max(len(row["chosen_ids"]), len(row["rejected_ids"])) <= max_length


def response_mask(starts: Sequence[int], attention_mask: torch.Tensor) -> torch.Tensor:
    """1 from each row's response start to its last token."""
    positions = torch.arange(attention_mask.shape[1])
    return ((positions[None, :] >= torch.tensor(list(starts))[:, None]) & attention_mask.bool()).long()


@dataclass
class ResponseMaskCollator(DataCollatorForPreference):
    """TRL's preference collator (chosen rows, then rejected rows, right-padded) plus
    `response_mask`."""

    def torch_call(self, examples):
        batch = super().torch_call(examples)
        starts = [e["chosen_start"] for e in examples] + [e["rejected_start"] for e in examples]
        batch["response_mask"] = response_mask(starts, batch["attention_mask"])
        return batch


def response_batch(encoded: Sequence[tuple[list[int], int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and response_mask of (ids, start) rows."""
    ids = [torch.tensor(row) for row, _ in encoded]
    attention_mask = pad([torch.ones_like(row) for row in ids], padding_value=0, padding_side="right")
    return {
        "input_ids": pad(ids, padding_value=pad_token_id, padding_side="right"),
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


class LikelihoodRewardTrainer(RewardTrainer):
    """TRL's RewardTrainer, checkpointing a `LikelihoodRewardModel`. It is not a transformers
    model, and Trainer's plain state-dict save refuses the LM's tied embeddings (two names,
    one tensor): the checkpoint stores each tensor once, and Trainer's resume, which loads
    with `strict=False`, finds the aliases it lacks in `_keys_to_ignore_on_save` and re-ties."""

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        aliases = set(tied_aliases(self.model))
        state = {k: v.contiguous() for k, v in self.model.state_dict().items() if k not in aliases}
        safetensors.torch.save_file(state, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


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


def fit_head(model: LikelihoodRewardModel, dataset: Dataset, pad_token_id: int, batch_size: int = 64):
    """Bradley-Terry fit of the head on the frozen LM's features: logistic regression on
    (f_chosen - f_rejected) with label 1 and its mirror with label 0, so the fit has no
    bias; the bias then centres the rewards of the training responses at 0. Sets the head
    and returns the fit's loss curve."""
    model.eval()
    collate = ResponseMaskCollator(pad_token_id=pad_token_id)
    chosen, rejected = [], []
    with torch.no_grad():
        for begin in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(begin, min(begin + batch_size, len(dataset)))])
            inputs = {k: batch[k].to(model.device) for k in ("input_ids", "attention_mask", "response_mask")}
            features = model.features(**inputs).cpu()
            chosen.append(features[: len(features) // 2])
            rejected.append(features[len(features) // 2 :])
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    difference = chosen - rejected
    labels = torch.cat([torch.ones(len(difference)), torch.zeros(len(difference))])
    weights, _, curve = fit_logistic(torch.cat([difference, -difference]), labels)
    with torch.no_grad():
        model.head.weight.copy_(weights[None, :])
        model.head.bias.fill_(-float((torch.cat([chosen, rejected]) @ weights).mean()))
    return curve
