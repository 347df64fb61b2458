"""Elastic weight consolidation (Kirkpatrick et al., 2017): while a model trains on new
data, a quadratic pull keeps each weight near its value before training, in proportion to
how much that weight mattered on the previous data,

    penalty = strength / 2 * sum_i F_i * (theta_i - theta*_i) ** 2

where theta* are the weights at the start and F the diagonal of the empirical Fisher
information of the previous data under theta*: the mean over examples of the squared
gradient of the example's log-likelihood (`fisher_diagonal`), here its mean over the
example's completion tokens, the loss the trainers minimise, so that examples of every
length weigh alike (the sum over tokens, as the paper writes it for one output, gives an
example's Fisher times the square of its completion's length; `strength` is on this scale).

It is applied as gradient hooks (`attach`): each trainable parameter's gradient gets
`strength * F * (theta - theta*)` added, which is the penalty's gradient. So EWC works
under any trainer that calls `backward` (TRL's SFT, DPO, KTO, GRPO ... and our PPO) without
subclassing it; `scale` divides the added gradient when a trainer accumulates several
backward passes into one step, and `loss_scale` multiplies it by fp16 training's loss scale
(the gradients a hook sees are scaled, and are divided by it before the optimizer step).

Why our own: neither TRL, PEFT nor transformers has EWC; continual-learning libraries that
do (avalanche) own the training loop, which the pipeline's trainers already do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def completion_examples(tokenizer, prompts: Sequence[str], completions: Sequence[str], max_length: int) -> list[dict]:
    """Token ids and labels of prompt + completion (+ EOS), the loss on the completion only,
    as the SFT trainer sees an example."""
    examples = []
    for prompt, completion in zip(prompts, completions):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        full = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            full = full + [tokenizer.eos_token_id]
        full = full[:max_length]
        start = min(len(prompt_ids), len(full))
        labels = [IGNORE_INDEX] * start + full[start:]
        if any(label != IGNORE_INDEX for label in labels):
            examples.append({"input_ids": full, "labels": labels})
    return examples


def fisher_diagonal(model, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """The diagonal empirical Fisher of `model`'s trainable parameters: the mean over
    `examples` (dicts of input_ids and labels, one example per backward pass) of the
    squared gradient of the example's mean token negative log-likelihood. Dropout is off
    while it is measured; the model's mode and gradients are restored."""
    if not examples:
        raise ValueError("EWC needs at least one example of the previous data to measure the Fisher information")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    fisher = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for example in examples:
            model.zero_grad(set_to_none=True)
            ids = torch.tensor([example["input_ids"]], device=device)
            labels = torch.tensor([example["labels"]], device=device)
            model(input_ids=ids, labels=labels).loss.backward()
            for name, p in params.items():
                if p.grad is not None:
                    fisher[name] += p.grad.detach().float() ** 2
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {name: f.div_(len(examples)) for name, f in fisher.items()}


@dataclass
class EWC:
    """Hooks that add EWC's gradient to the model's trainable parameters; `remove()`
    detaches them, `penalty()` is the current value of the penalty (for logging)."""

    model: torch.nn.Module
    fisher: dict[str, torch.Tensor]
    anchor: dict[str, torch.Tensor]
    strength: float
    handles: list

    def penalty(self) -> float:
        total = 0.0
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.fisher:
                    total += float((self.fisher[name] * (p.float() - self.anchor[name]) ** 2).sum())
        return self.strength / 2 * total

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def attach(
    model,
    fisher: dict[str, torch.Tensor],
    strength: float,
    scale: float = 1.0,
    loss_scale: Callable[[], float] | None = None,
) -> EWC:
    """Anchor `model` at its current weights and add EWC's gradient,
    `strength * scale * F * (theta - theta*)`, to every parameter `fisher` names, on every
    backward pass. `scale` is 1 / the gradient-accumulation steps of the trainer;
    `loss_scale`, when given, the current loss scale of fp16 training (`trainer_loss_scale`),
    which the added gradient is multiplied by as the loss's gradient is."""
    anchor, handles = {}, []
    weight = strength * scale
    for name, p in model.named_parameters():
        if name not in fisher or not p.requires_grad:
            continue
        # Two float32 copies of what trains, the Fisher and the anchor (full fine-tuning: 8
        # bytes a parameter), kept where the parameter is; the pull is made at each backward.
        fisher[name] = fisher[name].to(p.device)
        anchor[name] = p.detach().float().clone()

        def hook(grad, p=p, fisher_value=fisher[name], anchor_value=anchor[name]):
            pull = (p.detach().float() - anchor_value).mul_(fisher_value).mul_(weight)
            if loss_scale is not None:
                pull = pull * loss_scale()
            return grad + pull.to(grad.dtype)

        handles.append(p.register_hook(hook))
    if not handles:
        raise ValueError("EWC: the Fisher information names none of the model's trainable parameters")
    return EWC(model, fisher, anchor, strength, handles)


def table_texts(tokenizer, table) -> tuple[list[str], list[str]]:
    """Prompt and completion strings of an SFT table: prompt/completion text as it is,
    conversational rows (`messages`, or message-list prompts and completions) through the
    chat template, the last assistant turn as the completion."""
    from rlhf.models.generation import format_prompt

    if "messages" in table.columns:
        pairs = [(list(m)[:-1], list(m)[-1]["content"]) for m in table["messages"]]
    else:
        pairs = [
            (p, c if isinstance(c, str) else "".join(turn["content"] for turn in c))
            for p, c in zip(table["prompt"], table["completion"])
        ]
    return [format_prompt(tokenizer, p) for p, _ in pairs], [c for _, c in pairs]


def ewc_examples(tokenizer, table, params, max_length: int, seed: int, key: str, path) -> list[dict]:
    """The examples EWC measures its Fisher information on: at most `params.samples` rows
    of the SFT table `table` (read from `path`), drawn with `seed`, tokenized as SFT trains
    them. A row whose prompt fills `max_length` has no completion token to measure: it is
    left out and counted (printed); none left is a `TrainingDataError` naming `key`. Call
    it before the model loads."""
    from rlhf.training.trainer_setup import TrainingDataError

    if len(table) > params.samples:
        table = table.sample(n=params.samples, random_state=seed)
    prompts, completions = table_texts(tokenizer, table)
    examples = completion_examples(tokenizer, prompts, completions, max_length)
    if not examples:
        raise TrainingDataError(
            f"{key} {max_length}: every one of the {len(table)} rows of {path} that EWC measures its Fisher "
            f"information on has a prompt that fills it; raise {key}, or set ewc.strength: 0"
        )
    if len(examples) < len(table):
        print(
            f"{key} {max_length}: {len(table) - len(examples)} of the {len(table)} rows of {path} that EWC measures "
            f"on have a prompt that fills it and are left out of its Fisher information; raise {key} to keep them"
        )
    return examples


def trainer_loss_scale(trainer) -> Callable[[], float] | None:
    """The current loss scale of a transformers Trainer that trains in fp16 (accelerate's
    gradient scaler), or None (no scaler: fp32 and bf16 gradients are not scaled; no trainer)."""
    scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    return None if scaler is None else scaler.get_scale


def consolidate(
    model, examples: Sequence[dict], strength: float, scale: float = 1.0, loss_scale: Callable[[], float] | None = None
) -> EWC:
    """EWC for `model` at its current weights, with the Fisher information of `examples`
    (`ewc_examples`), `attach`ed with `strength`."""
    return attach(model, fisher_diagonal(model, examples), strength, scale, loss_scale)
