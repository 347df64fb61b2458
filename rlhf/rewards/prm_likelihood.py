"""A likelihood process reward model: a causal LM's own surprise at each step, calibrated.

The token-classification PRM (rlhf.rewards.prm_classifier) has to learn to verify a step from its labels. A
small model trained on a few thousand rows does not learn to check arithmetic that way
(held-out step accuracy stays at the share of good steps). But the SFT model that wrote the
solutions already predicts every token: a step whose tokens it finds improbable (a result
it would not have written, a number not copied from the previous line, an answer that does
not match the last result) is suspect. This PRM reads three features per step from a
frozen causal LM's log-probs of the solution's tokens:

    f1 = min_t log p(token_t | prefix)   over the step's tokens and the token ending it
    f2 = min over steps 1..i of f1        (Math-Shepherd labels: after a bad step, all bad)
    f3 = mean_t log p(token_t | prefix)  over the same tokens

and fits P(good) = sigmoid(w . f + b) to the PRM data's step labels (logistic regression,
L-BFGS with a small L2 penalty). The token that ends a step is the first separator token,
or EOS after the final step: a number cut short ("answer 6" for 64) shows there.

It has the same interface as `ClassifierPRM` (score_steps, score_completions), so
best-of-n, MCTS and the PRM reward take either. Saved as the LM (models/prm/) plus
prm.json holding the kind, the separator and the fitted weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from rlhf.models.generation import format_prompt
from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
from rlhf.rewards.likelihood import fit_logistic, token_logprobs
from rlhf.rewards.steps import DEFAULT_SEPARATOR, StepScorer, locate_steps

KIND = "likelihood"
FEATURES = ("step_min_logprob", "running_min_logprob", "step_mean_logprob")


def encode(
    tokenizer, prompt, steps: Sequence[str], separator: str, finished: bool = True
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of prompt + steps (each followed by the separator, the last by EOS when the
    solution is `finished`, else by the separator too: a partial path, as MCTS scores one)
    and, per step, the span [start, end) of the tokens whose log-probs describe it: the
    step's own tokens and the first token after it."""
    prompt_text = format_prompt(tokenizer, prompt)
    located = locate_steps(tokenizer, prompt_text, steps, separator, closed=not finished) if steps else None
    if located is not None:  # the completion as one text, then EOS
        ids, spans = located
        return ids + ([tokenizer.eos_token_id] if finished else []), [(first, end + 1) for first, end, _ in spans]
    ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    separator_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    spans = []
    for index, step in enumerate(steps):
        step_ids = tokenizer(step, add_special_tokens=False)["input_ids"]
        tail = [tokenizer.eos_token_id] if finished and index == len(steps) - 1 else separator_ids
        start = len(ids)
        ids += step_ids + tail
        spans.append((start, start + len(step_ids) + 1))
    return ids, spans


@torch.inference_mode()
def likelihood_features(
    lm,
    tokenizer,
    prompts: Sequence,
    steps: Sequence[Sequence[str]],
    separator: str = DEFAULT_SEPARATOR,
    batch_size=64,
    finished: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """A (steps, 3) feature tensor per row (FEATURES), from one forward pass per batch;
    `finished` (default: every row) as for `encode`."""
    lm.eval()
    finished = [True] * len(steps) if finished is None else finished
    encoded = [encode(tokenizer, p, s, separator, f) for p, s, f in zip(prompts, steps, finished)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result: list[torch.Tensor] = [torch.empty(0, len(FEATURES))] * len(encoded)
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = len(encoded[batch[0]][0])
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, i in enumerate(batch):
            ids = encoded[i][0]
            input_ids[j, : len(ids)] = torch.tensor(ids)
            mask[j, : len(ids)] = 1
        token_logps = token_logprobs(lm, input_ids.to(lm.device), mask.to(lm.device)).cpu()
        for j, i in enumerate(batch):
            rows, running = [], 0.0
            for begin, end in encoded[i][1]:
                span = token_logps[j, begin - 1 : end - 1]
                step_min = float(span.min())
                running = min(running, step_min)
                rows.append([step_min, running, float(span.mean())])
            result[i] = torch.tensor(rows, dtype=torch.float32).reshape(-1, len(FEATURES))
    return result


class LikelihoodPRM(StepScorer):
    """P(good) per step from a frozen causal LM's log-probs (see the module docstring)."""

    def __init__(self, lm, tokenizer, weights: torch.Tensor, bias: float, separator: str = DEFAULT_SEPARATOR):
        self.model = lm
        self.tokenizer = tokenizer
        self.weights = torch.as_tensor(weights, dtype=torch.float32)
        self.bias = float(bias)
        self.separator = separator

    @classmethod
    def fit(cls, lm, tokenizer, batches, separator: str = DEFAULT_SEPARATOR, batch_size: int = 64):
        """Fit the calibration on labelled rows given as `batches` of columns (`prompt`,
        `completions` = the steps, `labels`: a dataset's `iter(batch_size)`), one batch at a
        time: what is held is each step's features and label, not the rows."""
        features, targets = [torch.empty(0, len(FEATURES))], [torch.empty(0, dtype=torch.bool)]
        for batch in batches:
            rows = likelihood_features(lm, tokenizer, batch["prompt"], batch["completions"], separator, batch_size)
            features.append(torch.cat(rows))  # a batch of a dataset's `iter` has rows
            targets.append(torch.tensor([bool(label) for row in batch["labels"] for label in row], dtype=torch.bool))
        features, targets = torch.cat(features), torch.cat(targets)
        weights, bias, curve = fit_logistic(features, targets)
        prm = cls(lm, tokenizer, weights, bias, separator)
        prm.curve = curve
        return prm

    def score_steps(
        self, prompts: Sequence, steps: Sequence[Sequence[str]], batch_size: int = 64, finished=None
    ) -> list[list[float]]:
        """P(good) of every step, for each (prompt, steps) row. `finished` (default: all):
        whether each row is a whole solution, whose last step the EOS ends, or a partial
        path, whose last step the separator ends (scored as it is inside a whole one)."""
        if len(prompts) != len(steps):
            raise ValueError(f"{len(prompts)} prompts but {len(steps)} step lists")
        rows = likelihood_features(self.model, self.tokenizer, prompts, steps, self.separator, batch_size, finished)
        return [torch.sigmoid(row @ self.weights + self.bias).tolist() for row in rows]

    def settings(self) -> dict:
        return {
            "kind": KIND,
            "step_separator": self.separator,
            "features": list(FEATURES),
            "weights": self.weights.tolist(),
            "bias": self.bias,
        }

    def save(self, path: str | Path, settings_file: str) -> None:
        save_model(self.model, self.tokenizer, path)
        (Path(path) / settings_file).write_text(json.dumps(self.settings(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, settings: dict, trust_remote_code: bool = False) -> LikelihoodPRM:
        lm = load_causal_lm(path, trust_remote_code, what="likelihood process reward model")
        tokenizer = load_tokenizer(path, trust_remote_code)
        return cls(lm, tokenizer, torch.tensor(settings["weights"]), settings["bias"], settings["step_separator"])
