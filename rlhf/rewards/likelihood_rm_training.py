"""Training a likelihood reward model (rlhf/rewards/likelihood_rm.py): the tokenized pairs,
TRL's preference collator with the response mask, TRL's RewardTrainer checkpointing the
model, and the head's Bradley-Terry start. Apart from the model so that scoring with it
(evaluate, infer, improve, rewards) imports neither TRL nor datasets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import safetensors.torch
import torch
from datasets import Dataset
from transformers.trainer import SAFE_WEIGHTS_NAME, TRAINING_ARGS_NAME
from trl import RewardTrainer
from trl.trainer.reward_trainer import DataCollatorForPreference

from rlhf.rewards.likelihood import fit_logistic
from rlhf.rewards.likelihood_rm import LikelihoodRewardModel, encode, response_mask, tied_aliases


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


@dataclass
class ResponseMaskCollator(DataCollatorForPreference):
    """TRL's preference collator (chosen rows, then rejected rows, right-padded) plus
    `response_mask`."""

    def torch_call(self, examples):
        batch = super().torch_call(examples)
        starts = [e["chosen_start"] for e in examples] + [e["rejected_start"] for e in examples]
        batch["response_mask"] = response_mask(starts, batch["attention_mask"])
        return batch


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
