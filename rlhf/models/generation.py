"""Batched generation from a causal LM for evaluation and rewards.

Prompts are formatted the way the model was trained on them: plain text for standard
(prompt/completion) data, the tokenizer's chat template for conversational data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def format_prompt(tokenizer, prompt) -> str:
    """A prompt string as the model sees it: conversational prompts go through the chat
    template with the generation prompt appended."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)


def reward_text(tokenizer, prompt, completion) -> str:
    """The text a reward model reads, exactly as TRL's `RewardTrainer` builds it: prompt +
    completion + EOS for standard data, the chat template over prompt + completion messages
    for conversational data."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt + completion + tokenizer.eos_token
    return tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: Sequence,
    max_new_tokens: int,
    batch_size: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    num_return_sequences: int = 1,
    seed: int | None = None,
) -> list[str]:
    """Completions for `prompts` (greedy unless `do_sample`), decoded without special tokens.

    With `num_return_sequences` > 1 the result holds that many completions per prompt,
    grouped by prompt."""
    model.eval()
    if seed is not None:
        torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    texts = [format_prompt(tokenizer, p) for p in prompts]
    completions: list[str] = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
        ).to(model.device)
        output = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=None,
            top_k=None,
            num_return_sequences=num_return_sequences,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    return completions


def sample(model, tokenizer, prompts: Sequence, n: int, max_new_tokens: int, temperature: float, batch_size: int, seed):
    """`n` sampled completions per prompt, as one list per prompt; `batch_size` counts
    sequences, not prompts."""
    flat = generate(model, tokenizer, prompts, max_new_tokens, max(1, batch_size // n), True, temperature, n, seed=seed)
    return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]
