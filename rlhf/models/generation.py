"""Batched generation from a causal LM for evaluation and rewards.

Prompts are formatted the way the model was trained on them: plain text for standard
(prompt/completion) data, the tokenizer's chat template for conversational data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf.params import InputError


def text_start(tokenizer) -> str:
    """The BOS token's text when the tokenizer puts BOS before plain text by default (Llama,
    Mistral, Gemma), else "": training (TRL, rlhf.training.bucketed_sft) tokenizes plain text
    with the tokenizer's special tokens, and every prompt the project tokenizes itself is
    tokenized without them, so the BOS is written into the text (a special token's text
    reads back as that token)."""
    bos = tokenizer.bos_token
    if bos is None:
        return ""
    ids, plain = tokenizer("x")["input_ids"], tokenizer("x", add_special_tokens=False)["input_ids"]
    return bos if len(ids) > len(plain) and ids[0] == tokenizer.bos_token_id else ""


def stop_token_ids(model, tokenizer, chat: bool = False) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and every EOS of the model's
    generation config (a chat model's end-of-turn token, e.g. Gemma's `<end_of_turn>` or
    Qwen's `<|im_end|>`, is often only there), as TRL's GRPO and RLOO stop. With `chat`
    (the prompts are conversations) also the token the chat template ends an assistant
    turn with (`turn_end_ids`), for a model whose generation config does not name it."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return list(dict.fromkeys(ids + configured + (turn_end_ids(tokenizer) if chat else [])))


def turn_end_ids(tokenizer) -> list[int]:
    """The special token the chat template writes right after an assistant turn's text
    (`<|im_end|>`, `<|eot_id|>`, the built-in template's `<|end|>`), as a list; [] when
    there is no template or the turn ends in plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "Zq9"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    after = text[text.rfind(marker) + len(marker) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids)
    return [ids[0]] if ids and ids[0] in special else []


def format_prompt(tokenizer, prompt) -> str:
    """A prompt string as the model sees it in training: plain text after the BOS the
    tokenizer adds by default (`text_start`), conversational prompts through the chat
    template with the generation prompt appended. Tokenize it without special tokens."""
    if isinstance(prompt, str):
        return text_start(tokenizer) + prompt
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)


def reward_text(tokenizer, prompt, completion) -> str:
    """The text a reward model reads, exactly as TRL's `RewardTrainer` builds it: prompt +
    completion + EOS for standard data (after the tokenizer's default BOS), the chat template
    over prompt + completion messages for conversational data. Tokenize it without special
    tokens."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return text_start(tokenizer) + prompt + completion + tokenizer.eos_token
    if isinstance(completion, str):  # a sampled reply to a conversational prompt
        completion = [{"role": "assistant", "content": completion}]
    return tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)


def encode_response(tokenizer, prompt, completion) -> tuple[list[int], int]:
    """Token ids of the reward text (`reward_text`), and the index of the response's first
    token (where the ids stop agreeing with the prompt's own, as the policy saw it). At
    least 1: the first token has no log-prob."""
    ids = tokenizer(reward_text(tokenizer, prompt, completion), add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(format_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    start = 0
    while start < min(len(ids), len(prompt_ids)) and ids[start] == prompt_ids[start]:
        start += 1
    return ids, min(max(start, 1), len(ids) - 1)


class PromptTooLongError(InputError, ValueError):
    """A prompt and the tokens to generate do not fit in the model's positions."""


# What a model's own generation_config.json may set (chat models often ship a repetition
# penalty, top_k or top_p) that would change what is decoded: greedy would not be greedy,
# and samples would not be drawn from the model's distribution at the given temperature.
# Cleared wherever the project generates, as TRL's GRPO and RLOO set top_k, top_p, min_p and
# repetition_penalty for their rollouts. As keyword arguments of `generate`, None overrides
# the model's value (`PLAIN_DECODING`); in a GenerationConfig, where None is filled from the
# model's, neutral values: `NEUTRAL_DECODING`, and `NEUTRAL_SAMPLING` when it samples.
PLAIN_DECODING = {
    "top_k": None,
    "top_p": None,
    "min_p": None,
    "typical_p": None,
    "repetition_penalty": None,
    "no_repeat_ngram_size": None,
    "num_beams": 1,
}
NEUTRAL_DECODING = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "num_beams": 1}
NEUTRAL_SAMPLING = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0}


def check_fits(model, length: int, max_new_tokens: int, text: str) -> None:
    """Fail with what to change, not an index error deep in the model, when `length` prompt
    tokens plus `max_new_tokens` exceed the model's `max_position_embeddings`."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and length + max_new_tokens > limit:
        raise PromptTooLongError(
            f"a prompt of {length} tokens plus max_new_tokens {max_new_tokens} exceeds the model's {limit} "
            f"positions (the prompt begins {text[:60]!r}): lower the stage's max_new_tokens, or shorten the prompts"
        )


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
    stop_strings: list[str] | None = None,
    formatted: bool = False,
    details: bool = False,
):
    """Completions for `prompts` (greedy unless `do_sample`), decoded without special tokens.

    With `num_return_sequences` > 1 the result holds that many completions per prompt,
    grouped by prompt. A completion ends early at any of `stop_strings` (kept in it).
    `formatted`: the prompts are already texts as the model reads them (`format_prompt`,
    plus steps written so far), to continue as they are (formatting twice would put a
    second BOS, or a chat template's text inside plain text). `details`: a `Generated`
    instead, which also says whether each completion ended (a stop token or string) before
    `max_new_tokens` cut it, and how many tokens it took.

    Greedy batches are formed from the prompts sorted by token length (results in the
    caller's order): a batch pads its prompts to its longest, and a greedy row's output
    does not depend on the rows beside it. Sampled batches keep the caller's order: the
    process's generator hands out draws by row position, so sorting would change which
    completions a seed draws."""
    model.eval()
    if seed is not None:
        torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    texts = list(prompts) if formatted else [format_prompt(tokenizer, p) for p in prompts]
    order = list(range(len(texts)))
    if not do_sample and len(texts) > batch_size:
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        order.sort(key=lambda i: lengths[i])
    completions: list[str] = []
    finished: list[bool] = []
    tokens: list[int] = []
    stops = stop_token_ids(model, tokenizer, chat=not formatted and any(not isinstance(p, str) for p in prompts[:1]))
    for start in range(0, len(texts), batch_size):
        rows = [texts[i] for i in order[start : start + batch_size]]
        batch = tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        longest = int(batch["attention_mask"].sum(dim=1).argmax())
        check_fits(model, int(batch["attention_mask"][longest].sum()), max_new_tokens, rows[longest])
        output = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            **PLAIN_DECODING,
            num_return_sequences=num_return_sequences,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stops,
            **({"stop_strings": stop_strings, "tokenizer": tokenizer} if stop_strings else {}),
        )
        completions.extend(decode_continuations(tokenizer, output, batch["input_ids"].shape[1]))
        ended, taken = ends(output[:, batch["input_ids"].shape[1] :], stops, tokenizer.pad_token_id, max_new_tokens)
        finished.extend(ended)
        tokens.extend(taken)
    if order != sorted(order):  # back to the caller's order (num_return_sequences rows per prompt)
        n = num_return_sequences
        at = {prompt: place for place, prompt in enumerate(order)}
        completions, finished, tokens = (
            [column[at[i] * n + j] for i in range(len(texts)) for j in range(n)]
            for column in (completions, finished, tokens)
        )
    return Generated(completions, finished, tokens) if details else completions


@dataclass
class Generated:
    """What `generate(details=True)` gives per completion (`sample`: per prompt, lists):
    its text, whether it ended before the budget cut it, and the tokens generated for it
    (its stop token included)."""

    texts: list
    finished: list
    tokens: list


def ends(new, stops: list[int], pad: int | None, max_new_tokens: int) -> tuple[list[bool], list[int]]:
    """Per row of generated ids `new`: (whether it ended, the tokens it took). A row ends at
    its first stop token (counted), or where padding begins after a stop string (not
    counted; with the EOS as the pad token it is counted as the stop). A batch shorter than
    the budget ended every row; a row with neither used the whole budget."""
    ended, taken = [], []
    stop_set = set(stops)
    for row in new.tolist():
        length = len(row)
        for index, token in enumerate(row):
            if token in stop_set:
                length = index + 1
                break
            if token == pad:
                length = index
                break
        ended.append(length < len(row) or len(row) < max_new_tokens or (bool(row) and row[-1] in stop_set))
        taken.append(length)
    return ended, taken


def decode_continuations(tokenizer, sequences, prompt_length: int) -> list[str]:
    """The text each row of `sequences` (prompt, then generated tokens) adds after its first
    `prompt_length` tokens, special tokens left out: the decoded whole less the decoded
    prompt. Decoding the new tokens alone loses the word-boundary space of the first one
    with SentencePiece-style decoders (Llama 2, Mistral): the prompt and that text would then
    tokenize as another sequence than the one sampled, and a round would train on it. Where
    the decoded prompt is not a prefix of the decoded whole, the new tokens alone."""
    heads = tokenizer.batch_decode(sequences[:, :prompt_length], skip_special_tokens=True)
    wholes = tokenizer.batch_decode(sequences, skip_special_tokens=True)
    alone = tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)
    return [w[len(h) :] if w.startswith(h) else a for h, w, a in zip(heads, wholes, alone)]


def sample(
    model,
    tokenizer,
    prompts: Sequence,
    n: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed,
    formatted: bool = False,
    details: bool = False,
):
    """`n` sampled completions per prompt, as one list per prompt; `batch_size` counts
    sequences, not prompts; `formatted` and `details` as for `generate` (a `Generated`
    whose lists hold one list per prompt)."""
    flat = generate(
        model, tokenizer, prompts, max_new_tokens, max(1, batch_size // n), True, temperature, n, seed=seed,
        formatted=formatted, details=True,
    )  # fmt: skip

    def grouped(values: list) -> list[list]:
        return [values[i * n : (i + 1) * n] for i in range(len(prompts))]

    if not details:
        return grouped(flat.texts)
    return Generated(grouped(flat.texts), grouped(flat.finished), grouped(flat.tokens))


# A prime below 2**61 for mixing the key's parts into one generator seed.
_KEY_PRIME = 2_305_843_009_213_693_951


class KeyedSampling:
    """A logits processor that samples each row's next token itself, from softmax(logits / T),
    with noise drawn from a generator keyed by (seed, step, row, token position): a row gets
    the same completion whatever rows share its batch, how the batch is split across
    processes or how wide the left padding is. It returns 0 at the chosen token and -inf
    elsewhere, so the generation after it (greedy, or sampling) takes that token.

    Row `r` of a batch is global row `first_row + r`: a process of a data-parallel launch
    holding the rows from `first_row` on draws what one process with all the rows draws.
    Sampling is by the Gumbel-max trick: argmax_v(z_v / T + g_v) with g_v = -log(-log u_v)
    and u_v uniform is a draw from softmax(z / T) (Gumbel 1954; Maddison et al. 2014). Give
    it the untempered logits: no temperature, top-k or top-p processor may run before it
    (transformers runs a caller's processors before its own warpers, whose work on the
    one-hot result is then a no-op).

    Why our own: transformers draws the tokens of a batch with one `torch.multinomial` on
    the process's generator, so a row's draws depend on its batch and its process (TRL
    seeds each process differently on purpose); neither has a per-row generator. The cost
    is one small generator per row and token, fine for the pipeline's sampling batches;
    leave it off (the default) where throughput matters more than layout-free sampling."""

    def __init__(self, seed: int, step: int, first_row: int = 0, temperature: float = 1.0):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.seed, self.step, self.first_row, self.temperature = seed, step, first_row, temperature
        self.prompt_width: int | None = None

    def key(self, row: int, position: int) -> int:
        value = 0
        for part in (self.seed, self.step, row, position):
            value = (value * 1_000_003 + part + 1) % _KEY_PRIME
        return value

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_width is None:  # the first call sees the (padded) prompts alone
            self.prompt_width = input_ids.shape[1]
        position = input_ids.shape[1] - self.prompt_width  # index of the token being drawn
        logits = scores.float() / self.temperature
        tiny = torch.finfo(torch.float32).tiny
        picks = []
        for row in range(scores.shape[0]):
            generator = torch.Generator(device=scores.device).manual_seed(self.key(self.first_row + row, position))
            uniform = torch.rand(scores.shape[1], generator=generator, device=scores.device).clamp_(tiny, 1 - 1e-7)
            picks.append(int(torch.argmax(logits[row] - torch.log(-torch.log(uniform)))))
        chosen = torch.full_like(scores, float("-inf"))
        chosen[torch.arange(scores.shape[0], device=scores.device), torch.tensor(picks, device=scores.device)] = 0.0
        return chosen


def keyed_generate(model, seed: int, step, first_row, temperature: float) -> None:
    """Make `model.generate` sample with `KeyedSampling` (used where a library calls
    `generate` for us, as TRL's GRPO and RLOO trainers do): `step()` gives the current
    training step, `first_row(rows)` the global index of this process's first row when it
    generates `rows` rows. The model's saved weights and config are untouched; a second
    call replaces the first's settings."""
    from transformers import LogitsProcessorList

    original = model.__dict__.get("_unkeyed_generate", model.generate)
    model._unkeyed_generate = original

    def generate(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        processor = KeyedSampling(seed, int(step()), first_row(ids.shape[0]), temperature)
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])
        return original(*args, **kwargs)

    model.generate = generate
