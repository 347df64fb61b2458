"""A context compressor: a long context as k vectors that a model reads in place of its tokens.

In-context autoencoder (ICAE; Ge et al., ICLR 2024), read chunk by chunk as AutoCompressors
(Chevalier et al., 2023) read long documents:

* the **encoder** is the served model itself with a LoRA adapter: it reads a chunk of
  at most `chunk_tokens` context tokens followed by `tokens` learned memory embeddings, and the
  last hidden states at the memory positions, through a learned linear map, are that
  chunk's memory slots, vectors in the model's input-embedding space;
* a context is cut into chunks, each read alone (every chunk fits the model's window), and
  the slots of its chunks, in order, replace its tokens: k = chunks x `tokens`, a
  compression of `chunk_tokens / tokens` (32 slots per 128 tokens: 4x; less where a chunk
  holds fewer tokens, as whole sentences do). `chunk_by:
  tokens` cuts every `chunk_tokens` tokens; `sentences` packs whole sentences into each
  chunk, so that a fact is never spread over two chunks' slots (a chunk boundary cut a
  relevant sentence in 37% of the study's problems, and those were answered at 0.18
  against 0.28);
* the **decoder** is the served model, unchanged (the adapter off): it reads the slots,
  then the question, and answers. Only the adapter, the memory embeddings and the map
  are trained (ICAE's fine-tuning objective: the answer's log-likelihood given the slots
  and the question), so the compressor is small, serves the model as it is, and works the
  same way for a 135M and a 70B model (one copy of the weights in memory, the adapter
  switched on for encoding and off for decoding).

`save_pretrained(folder)` writes the adapter (PEFT's files), the memory embeddings and the
map (`compressor.safetensors`) and `compressor_config.json`, which records the model it
serves: its folder and a fingerprint of its checkpoint's weights (as stored, so the same
model loaded in another dtype or quantized is still the same). `from_pretrained(folder,
model)` puts the adapter on that model and refuses another one (`CompressorMismatchError`):
slots made for one model's embedding space mean nothing to another's.

With `select: m` the compressor also picks what to read: a linear relevance head on each
chunk's memory states (query-aware, so it judges a chunk against the question) scores the
chunks, trained by binary cross-entropy on which chunks hold the row's `relevant`
sentences, and the model reads the slots of the m best-scored chunks only (in training,
those of the chunks that do hold them). A chunk read alone is a small task; finding two
facts among the slots of 8 chunks is one the model failed to learn (the study,
docs/results/context-compression.md).

Entry points: `compress_context_from_ids` (token ids to slots), `compress_prompts` (texts
to slots), `generate` (answers from slots and questions) and `loss` (what training
minimizes). Stage `compress` (stages/compress.py) trains one.

Our own because no maintained library offers learned (soft) context compression for
Hugging Face causal LMs: LLMLingua (`llmlingua`) compresses by dropping tokens, a hard
prompt the model reads as text, not k vectors; ICAE's, gisting's and AutoCompressors'
code are paper repositories pinned to old transformers versions, not packages. The
adapter is PEFT's LoRA, the training loop transformers' Trainer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from rlhf.models.chunking import CHUNK_BY, CompressorError, chunk_spans, relevant_chunks
from rlhf.models.folders import fingerprint

CONFIG_FILE = "compressor_config.json"
QUERY_SEPARATOR = "\n"  # between a chunk and the query a query-aware compressor reads after it
WEIGHTS_FILE = "compressor.safetensors"
FORMAT = "rlhf-context-compressor/1"
# Chunks the encoder reads in one forward pass (`ContextCompressor.encode_rows`): 64 rows of
# a chunk, its memory tokens and the question, about 16,000 tokens, bound the activations
# whatever the batch of contexts (a 7B model's MLP holds about 1.2 MB a token in bfloat16).
ENCODE_ROWS = 64
SLOT_POSITIONS = ("parallel", "sequential")  # where the model reads the slots: ContextCompressor.decoder_inputs


def question_text(prompt) -> str:
    """The question of a row's prompt: the text, or a conversation's last user turn."""
    if isinstance(prompt, str):
        return prompt
    return [turn for turn in prompt if turn.get("role") == "user"][-1]["content"]


def prompt_frame(tokenizer, prompt) -> tuple[str, str]:
    """(the text before, the text after) a prompt's question as the model reads it
    (rlhf.models.generation.format_prompt): the chat template around a user turn, or the
    BOS before plain text."""
    from rlhf.models.generation import format_prompt

    marker = "\x00question\x00"
    framed = format_prompt(tokenizer, marker if isinstance(prompt, str) else [{"role": "user", "content": marker}])
    head, _, tail = framed.partition(marker)
    return head, tail


class CompressorMismatchError(CompressorError):
    """A compressor loaded for a model it was not trained to serve."""


def compressor_folders(root: str | Path, tokens: list[int] | None = None) -> list[Path]:
    """The compressors stage compress wrote under `root` (models/compressor), those of
    `tokens` slots per chunk only when given; a `CompressorError` when it wrote none."""
    from rlhf.models.folders import absent_reason

    root = Path(root)
    if not root.is_dir() or (reason := absent_reason(root)):
        raise CompressorError(
            f"compress.enabled: stage compress trained no compressor ({reason or f'{root} is missing'}); set "
            "compress.enabled: true in params `compress` (and a compress table: prepare.word_problems.context_chars "
            "or prepare.files.compress)"
        )
    folders = sorted(p for p in root.iterdir() if (p / CONFIG_FILE).is_file())
    if tokens is not None:
        folders = [p for p in folders if ContextCompressor.read_config(p)["tokens"] in tokens]
        if not folders:
            raise CompressorError(f"compress.tokens {tokens}: stage compress trained none of them in {root}")
    return folders


def trained_parts(folder: str | Path) -> tuple[torch.Tensor, dict]:
    """(the memory embeddings, {"proj": the slot map's state dict, "relevance": the
    relevance head's, empty in a compressor saved without one}) saved in `folder`."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(folder) / WEIGHTS_FILE))
    parts = {
        name: {k.removeprefix(f"{name}."): v for k, v in weights.items() if k.startswith(f"{name}.")}
        for name in ("proj", "relevance")
    }
    return weights["memory"], parts


def check_settings(tokens: int, chunk_tokens: int, window: int | None, key: str = "compress") -> None:
    """Fail, naming the key, when a chunk would not shrink or would not fit the window."""
    if tokens <= 0 or chunk_tokens <= 0:
        raise CompressorError(f"{key}.tokens and {key}.chunk_tokens must be positive (got {tokens}, {chunk_tokens})")
    if tokens >= chunk_tokens:
        raise CompressorError(
            f"{key}.tokens ({tokens}) is not smaller than {key}.chunk_tokens ({chunk_tokens}): each chunk of "
            f"{chunk_tokens} context tokens would become {tokens} slots, no compression; lower {key}.tokens"
        )
    if window is not None and chunk_tokens + tokens > window:
        raise CompressorError(
            f"{key}.chunk_tokens + {key}.tokens ({chunk_tokens} + {tokens}) exceeds the model's window of "
            f"{window} positions: the encoder reads a chunk and its memory tokens at once; lower {key}.chunk_tokens"
        )


class ContextCompressor(nn.Module):
    """The served `model` wrapped with the encoder's LoRA adapter, `tokens` memory
    embeddings per chunk and the slot map. Build one with `ContextCompressor.new`
    (untrained) or `from_pretrained` (saved)."""

    def __init__(
        self,
        model,
        tokens: int,
        chunk_tokens: int,
        served: dict,
        memory=None,
        proj=None,
        seed: int = 0,
        query_aware: bool = False,
        adapter_reads: bool = False,
        slot_positions: str = "parallel",
        select: int = 0,
        relevance=None,
        chunk_by: str = "tokens",
    ):
        super().__init__()
        if slot_positions not in SLOT_POSITIONS:
            raise CompressorError(f"slot_positions {slot_positions!r}: expected one of {SLOT_POSITIONS}")
        if chunk_by not in CHUNK_BY:
            raise CompressorError(f"chunk_by {chunk_by!r}: expected one of {CHUNK_BY}")
        self.chunk_by = chunk_by
        self.encode_rows = ENCODE_ROWS
        self.model = model  # a PeftModel: the adapter is the encoder's
        self.tokens, self.chunk_tokens, self.served = tokens, chunk_tokens, served
        self.query_aware, self.adapter_reads, self.slot_positions = query_aware, adapter_reads, slot_positions
        self._adapter_off = False  # inside `reading` with the adapter switched off
        self._adapted = None  # its adapted layers (rlhf.models.compressor_checkpointing), found once
        hidden = model.get_input_embeddings().weight.shape[1]
        embed = model.get_input_embeddings().weight
        if memory is None:  # memory embeddings start as typical token embeddings
            generator = torch.Generator().manual_seed(seed)
            memory = torch.randn(tokens, hidden, generator=generator) * embed.detach().float().std()
        # The trained parts are float32 whatever the served model's dtype (as peft keeps a
        # LoRA adapter): in bfloat16 an Adam step of 1e-3 rounds away on the slot map's
        # identity (its spacing at 1.0 is 0.0078), and fp16 parameters stop the GradScaler
        # of fp16 mixed precision. They meet the model in its dtype (`_project`, `_encoder_inputs`).
        self.memory = nn.Parameter(memory.float().to(embed.device))
        self.proj = nn.Linear(hidden, hidden, dtype=torch.float32, device=embed.device)
        if proj is None:
            nn.init.eye_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)
        else:
            self.proj.load_state_dict(proj)
        if select < 0:
            raise CompressorError(f"select {select}: the chunks read per context, 0 for all")
        self.select = select
        self.relevance = nn.Linear(hidden, 1, dtype=torch.float32, device=embed.device)  # a chunk's score
        if relevance:
            self.relevance.load_state_dict(relevance)
        else:
            nn.init.zeros_(self.relevance.weight)
            nn.init.zeros_(self.relevance.bias)

    # ------------------------------------------------------------------ building, saving

    @classmethod
    def new(
        cls,
        model,
        tokens: int,
        chunk_tokens: int,
        served_path: str,
        lora_r: int = 16,
        lora_alpha: int = 32,
        seed: int = 0,
        window: int | None = None,
        query_aware: bool = False,
        adapter_reads: bool = False,
        slot_positions: str = "parallel",
        select: int = 0,
        chunk_by: str = "tokens",
    ) -> ContextCompressor:
        """An untrained compressor for `model` (loaded from `served_path`), its weights frozen."""
        from peft import LoraConfig, get_peft_model

        check_settings(tokens, chunk_tokens, window)
        found, way = fingerprint(model)
        served = {"path": str(served_path), "fingerprint": found, "fingerprint_of": way}
        for param in model.parameters():
            param.requires_grad_(False)
        torch.manual_seed(seed)
        config = LoraConfig(
            r=lora_r, lora_alpha=lora_alpha, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
        )
        adapted = get_peft_model(model, config)
        return cls(
            adapted, tokens, chunk_tokens, served, seed=seed, query_aware=query_aware, adapter_reads=adapter_reads,
            slot_positions=slot_positions, select=select, chunk_by=chunk_by,
        )  # fmt: skip

    def save_pretrained(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder)  # the adapter only
        weights = {"memory": self.memory.detach().contiguous().cpu()}
        for name in ("proj", "relevance"):
            weights |= {
                f"{name}.{k}": v.detach().contiguous().cpu() for k, v in getattr(self, name).state_dict().items()
            }
        save_file(weights, folder / WEIGHTS_FILE)
        config = {
            "format": FORMAT,
            "tokens": self.tokens,
            "chunk_tokens": self.chunk_tokens,
            "query_aware": self.query_aware,
            "adapter_reads": self.adapter_reads,
            "slot_positions": self.slot_positions,
            "select": self.select,
            "chunk_by": self.chunk_by,
            "served": self.served,
        }
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @staticmethod
    def read_config(folder: str | Path) -> dict:
        """The saved settings of the compressor in `folder`, or one clear error."""
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise CompressorError(
                f"{folder} holds no context compressor ({CONFIG_FILE} is missing): point at the folder stage "
                "compress wrote (models/compressor), or run it first"
            )
        config = json.loads(path.read_text())
        if config.get("format") != FORMAT:
            raise CompressorError(f"{path}: format {config.get('format')!r} is not {FORMAT!r}")
        return config

    @classmethod
    def from_pretrained(cls, folder: str | Path, model, trainable: bool = False) -> ContextCompressor:
        """The compressor saved in `folder`, on `model`: the model it was trained to serve,
        or a `CompressorMismatchError` naming both."""
        from peft import PeftModel

        config = cls.read_config(folder)
        served = config["served"]
        # Saved with the weights' fingerprint (before the checkpoint's existed): checked that way.
        found, _ = fingerprint(model, served.get("fingerprint_of", "weights"))
        if found != served["fingerprint"]:
            raise CompressorMismatchError(
                f"the context compressor in {folder} was trained for the model in {served['path']} "
                f"(fingerprint {served['fingerprint']}), not this one ({found}): slots made for one model mean "
                "nothing to another; train a compressor for this model (stage compress, compress.model)"
            )
        for param in model.parameters():
            param.requires_grad_(False)
        peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=trainable)
        memory, parts = trained_parts(folder)
        return cls(
            peft_model, config["tokens"], config["chunk_tokens"], served, memory, parts["proj"],
            query_aware=config.get("query_aware", False), adapter_reads=config.get("adapter_reads", False),
            slot_positions=config.get("slot_positions", "sequential"), select=config.get("select", 0),
            relevance=parts["relevance"], chunk_by=config.get("chunk_by", "tokens"),
        )  # fmt: skip

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False
    ) -> None:
        """params `model.gradient_checkpointing` (transformers' Trainer calls this; its
        arguments are transformers'): rlhf.models.compressor_checkpointing."""
        from rlhf.models.compressor_checkpointing import enable

        enable(self, activation_checkpointing_kwargs, every_n_layers, offload)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        """What transformers' Trainer calls before 5.23: `activation_checkpointing_enable`."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def _as_computed(self):
        """torch's checkpoint `context_fn` (rlhf.models.compressor_checkpointing.as_computed)."""
        from rlhf.models.compressor_checkpointing import as_computed

        return as_computed(self)

    def load_trained(self, folder: str | Path) -> None:
        """The trained parts saved in `folder` (a checkpoint of this compressor) into this one."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.model, load_file(str(Path(folder) / "adapter_model.safetensors")))
        memory, parts = trained_parts(folder)
        with torch.no_grad():
            self.memory.copy_(memory.to(self.memory.dtype))
        self.proj.load_state_dict(parts["proj"])
        if parts["relevance"]:
            self.relevance.load_state_dict(parts["relevance"])

    # ------------------------------------------------------------------ compressing

    @property
    def ratio(self) -> float:
        return self.chunk_tokens / self.tokens

    def compress_context_from_ids(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        query_ids: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
        scores: bool = False,
    ):
        """(slots [batch, k, hidden], their mask [batch, k]) of right-padded context ids
        [batch, length] (as `context_ids` lays a text out: with `chunk_by: sentences`, each
        chunk padded to `chunk_tokens`): each chunk of `chunk_tokens` is read alone with the memory
        embeddings after its tokens (and, for a query-aware compressor, after the query's
        right-padded ids [batch, query length]: the question the context will answer), and
        after `prefix_ids` [prefix length] (the same for every row: the chat template's
        text before a user turn), so that a chunk and its question read as a prompt the model
        was trained on; a chunk that is all padding gives masked slots. With `scores`, a
        third value: each chunk's relevance logit [batch, chunks] (the `select` head's)."""
        embeds, full_mask, mask = self._encoder_inputs(input_ids, attention_mask, query_ids, query_mask, prefix_ids)
        batch = input_ids.shape[0]
        memory = self._memory(embeds, full_mask)
        slots = self._project(memory).reshape(batch, -1, memory.shape[-1])
        slot_mask = self._slot_mask(mask, batch)
        if not scores:
            return slots, slot_mask
        return slots, slot_mask, self._scores(memory).reshape(batch, -1)

    def _encoder_inputs(self, input_ids, attention_mask, query_ids, query_mask, prefix_ids):
        """(embeddings, mask) of what the encoder reads for each chunk [batch * chunks, ...]
        (`compress_context_from_ids`), and the chunks' own token mask [batch * chunks,
        chunk_tokens]."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        batch, length = input_ids.shape
        chunks = max(1, -(-length // self.chunk_tokens))
        pad = chunks * self.chunk_tokens - length
        ids = nn.functional.pad(input_ids, (0, pad), value=0).reshape(batch * chunks, self.chunk_tokens)
        mask = nn.functional.pad(attention_mask, (0, pad), value=0).reshape(batch * chunks, self.chunk_tokens)
        embed = self.model.get_input_embeddings()
        pieces, masks = [embed(ids)], [mask]
        if prefix_ids is not None and len(prefix_ids):
            prefix = embed(prefix_ids.to(ids.device)).unsqueeze(0).expand(batch * chunks, -1, -1)
            pieces.insert(0, prefix)
            masks.insert(0, torch.ones(batch * chunks, len(prefix_ids), dtype=mask.dtype, device=mask.device))
        if self.query_aware:
            if query_ids is None:
                raise ValueError("a query-aware compressor reads each context with its question: give query_ids")
            if query_mask is None:
                query_mask = torch.ones_like(query_ids)
            pieces.append(embed(query_ids).repeat_interleave(chunks, dim=0))
            masks.append(query_mask.repeat_interleave(chunks, dim=0))
        pieces.append(self.memory.unsqueeze(0).expand(batch * chunks, -1, -1).to(pieces[0].dtype))
        masks.append(torch.ones(batch * chunks, self.tokens, dtype=mask.dtype, device=mask.device))
        return torch.cat(pieces, dim=1), torch.cat(masks, dim=1), mask

    def _memory(self, embeds, full_mask):
        """The encoder's last hidden states at the memory positions [chunks, tokens, hidden],
        at most `encode_rows` chunks a forward pass: a batch of 128 contexts of 8,000 tokens
        is 8,000 chunks, too many activations for one pass of a 7B model (every chunk row
        has the same length, so the split changes no row's result)."""
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # padding inside a row takes no position
        body = self.model.get_base_model().base_model  # the decoder stack (no LM head), its linear layers adapted
        parts = [
            body(
                inputs_embeds=embeds[rows], attention_mask=full_mask[rows], position_ids=positions[rows]
            ).last_hidden_state[:, -self.tokens :]
            for rows in (
                slice(start, start + self.encode_rows) for start in range(0, embeds.shape[0], self.encode_rows)
            )
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _project(self, memory):
        """The slot map of memory states, in the float32 of the trained parts, returned in
        the model's dtype (the slots are read as its input embeddings)."""
        return self.proj(memory.to(self.proj.weight.dtype)).to(memory.dtype)

    def _scores(self, memory):
        """Each chunk's relevance logit from its memory states [chunks]."""
        return self.relevance(memory.mean(dim=1).to(self.relevance.weight.dtype)).reshape(-1).float()

    def _slot_mask(self, mask, batch: int):
        """[batch, chunks * tokens]: on for the slots of chunks that hold a context token."""
        used = (mask.sum(-1) > 0).to(mask.dtype)  # [batch * chunks]
        return used.reshape(batch, -1).repeat_interleave(self.tokens, dim=1)

    def _selected_slots(self, tokenizer, contexts, prompts, relevant, every_chunk: bool = False):
        """Training's reading with `select`: (slots, the mask of the slots read, the
        relevance head's loss). Every chunk is encoded once without gradients to score it;
        only the chunks read (those holding the facts, then the best-scored, as
        `selected`), the `select` best-scored (the hard negatives) and one used chunk per row
        drawn at random (which may be one of those already) are encoded again with gradients, so a step back-propagates
        through a few chunks, not all of them. The head learns from every chunk's score,
        the encoder from those encoded again. The loss's value is the one `every_chunk`
        (every chunk encoded with gradients, once) gives."""
        tokens = self._encoder_tokens(tokenizer, contexts, prompts)
        batch = len(contexts)
        if every_chunk:
            slots, slot_mask, scores = self.compress_context_from_ids(*tokens, scores=True)
            pick = None
        else:
            embeds, full_mask, mask = self._encoder_inputs(*tokens)
            with torch.no_grad():
                pooled = self._memory(embeds, full_mask).mean(dim=1)
            scores = self.relevance(pooled.to(self.relevance.weight.dtype)).reshape(batch, -1).float()
            slot_mask = self._slot_mask(mask, batch)
        labels = torch.zeros_like(scores)
        for row, chunks in enumerate(relevant_chunks(tokenizer, contexts, relevant, self.chunk_tokens, self.chunk_by)):
            labels[row, : len(chunks)] = torch.tensor(chunks, dtype=labels.dtype)
        read = self.selected(slot_mask, scores, must=labels.bool())
        used = slot_mask[:, :: self.tokens].bool()
        if not every_chunk:
            other = torch.rand(scores.shape, device=scores.device).masked_fill(~used, -1.0).argmax(dim=1, keepdim=True)
            pick = read[:, :: self.tokens].bool() | self.selected(slot_mask, scores)[:, :: self.tokens].bool()
            pick = pick.scatter(1, other, True).reshape(-1)
            memory = self._memory(embeds[pick], full_mask[pick])
            hidden, projected = memory.shape[-1], self._project(memory)
            slots = projected.new_zeros(pick.shape[0], self.tokens, hidden)
            slots[pick] = projected
            slots = slots.reshape(batch, -1, hidden)
            scores = scores.reshape(-1).clone()
            scores[pick] = self._scores(memory)
            scores = scores.reshape(batch, -1)
        selection = nn.functional.binary_cross_entropy_with_logits(scores[used], labels[used])
        return slots, read, selection

    def selected(self, slot_mask: torch.Tensor, relevance: torch.Tensor, must: torch.Tensor | None = None):
        """`slot_mask` with only the slots of the chunks read left on: per row, the `select`
        used chunks `relevance` [batch, chunks] scores best, the chunks `must` marks (bool
        [batch, chunks]; training's chunks that hold the facts) always among them, however
        many; every used chunk when `select` is 0."""
        if not self.select:
            return slot_mask
        used = slot_mask[:, :: self.tokens].bool()
        ranked = relevance.detach().float().masked_fill(~used, float("-inf"))
        limit = torch.full((used.shape[0], 1), self.select, device=used.device)
        if must is not None:
            must = must.to(used.device) & used
            ranked = ranked.masked_fill(must, float("inf"))
            limit = torch.maximum(limit, must.sum(dim=1, keepdim=True))
        rank = ranked.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
        keep = ((rank < limit) & used).repeat_interleave(self.tokens, dim=1)
        return slot_mask * keep.to(slot_mask.dtype)

    def tokenize(self, tokenizer, texts: Sequence[str]):
        """Right-padded ids and mask of `texts` (no special tokens)."""
        encoded = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in texts]
        length = max(1, max(len(e) for e in encoded))
        ids = torch.zeros(len(encoded), length, dtype=torch.long)
        mask = torch.zeros(len(encoded), length, dtype=torch.long)
        for row, e in enumerate(encoded):
            ids[row, : len(e)] = torch.tensor(e, dtype=torch.long)
            mask[row, : len(e)] = 1
        return ids.to(self.memory.device), mask.to(self.memory.device)

    def context_ids(self, tokenizer, contexts: Sequence[str]):
        """Right-padded ids and mask of context texts, laid out as `compress_context_from_ids`
        reads them: for `chunk_by: sentences` each chunk's whole sentences (`chunk_spans`)
        padded to `chunk_tokens`, so that every chunk starts at a multiple of it."""
        ids, mask = self._context_layout(tokenizer, contexts)
        return ids.to(self.memory.device), mask.to(self.memory.device)

    def _context_layout(self, tokenizer, contexts: Sequence[str]):
        """`context_ids`, on the CPU."""
        if self.chunk_by == "tokens":
            rows = [[tokenizer(c, add_special_tokens=False)["input_ids"]] for c in contexts]  # one run of tokens
        else:
            rows = []
            for text in contexts:
                try:
                    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
                except NotImplementedError as error:
                    raise CompressorError(
                        "this compressor cuts contexts between sentences (chunk_by: sentences), which needs where each "
                        "token sits in the text, and this tokenizer (not a fast one) does not say: load the model's "
                        "fast tokenizer, or train the compressor with compress.chunk_by: tokens"
                    ) from error
                spans = chunk_spans(text, encoded["offset_mapping"], self.chunk_tokens, "sentences")
                rows.append([encoded["input_ids"][a:b] for a, b in spans])
        length = max(len(chunks) for chunks in rows) * self.chunk_tokens
        if self.chunk_by == "tokens":  # the tokens as they come; compress_context_from_ids cuts them
            length = max(1, max(len(chunks[0]) for chunks in rows))
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for row, chunks in enumerate(rows):
            for number, chunk in enumerate(chunks):
                at = number * self.chunk_tokens
                ids[row, at : at + len(chunk)] = torch.tensor(chunk, dtype=torch.long)
                mask[row, at : at + len(chunk)] = 1
        return ids, mask

    def context_slots(self, tokenizer, contexts: Sequence[str]) -> list[int]:
        """k for each context: the slots the model reads (its chunks', or with `select`
        those of at most that many chunks)."""
        _, mask = self._context_layout(tokenizer, contexts)
        mask = nn.functional.pad(mask, (0, -mask.shape[1] % self.chunk_tokens))
        used = (mask.reshape(len(contexts), -1, self.chunk_tokens).sum(-1) > 0).sum(-1)
        return [(min(int(n), self.select) if self.select else int(n)) * self.tokens for n in used]

    def _encoder_tokens(self, tokenizer, contexts: Sequence[str], prompts: Sequence | None = None):
        """`compress_context_from_ids`'s token arguments for context texts (and, for a
        query-aware compressor, their prompts): ids, mask, query ids, query mask, prefix."""
        if not self.query_aware:
            return (*self.context_ids(tokenizer, contexts), None, None, None)
        if prompts is None:
            raise ValueError("a query-aware compressor reads each context with its prompt: give prompts")
        head, tail = prompt_frame(tokenizer, prompts[0])
        queries = self.tokenize(tokenizer, [QUERY_SEPARATOR + question_text(p) + tail for p in prompts])
        prefix = torch.tensor(tokenizer(head, add_special_tokens=False)["input_ids"], dtype=torch.long)
        return (*self.context_ids(tokenizer, contexts), *queries, prefix)

    def compress_prompts(self, tokenizer, contexts: Sequence[str], prompts: Sequence | None = None, scores=False):
        """(slots, mask) of context texts (`compress_context_from_ids` on their tokens; with
        `scores`, the chunks' relevance too); a query-aware compressor also reads each one's
        prompt (text, or a conversation whose last user turn is read), after a separator."""
        return self.compress_context_from_ids(*self._encoder_tokens(tokenizer, contexts, prompts), scores=scores)

    # ------------------------------------------------------------------ reading slots

    def decoder_inputs(self, slots, slot_mask, pieces: Sequence[Sequence[int]]):
        """Left-padded decoder inputs (embeddings, mask, positions): each row's used slots,
        then its token ids `pieces` (the question as the model reads it, and for training the
        answer after it). With `slot_positions: parallel` every chunk's slots take positions
        0 to tokens-1 and the pieces follow at `tokens`, so that the prompt sits as close to
        each chunk's slots as a prompt's own facts sit to it in training, whatever the
        context's length; `sequential` numbers the slots one after another."""
        embed = self.model.get_input_embeddings()
        rows = []
        for row, ids in enumerate(pieces):
            used = slots[row][slot_mask[row].bool()]
            tokens = embed(torch.tensor(list(ids), dtype=torch.long, device=slots.device))
            rows.append((torch.cat([used, tokens.to(used.dtype)], dim=0), used.shape[0]))
        length = max(r.shape[0] for r, _ in rows)
        hidden = rows[0][0].shape[1]
        embeds = slots.new_zeros(len(rows), length, hidden)
        mask = torch.zeros(len(rows), length, dtype=torch.long, device=slots.device)
        positions = torch.zeros(len(rows), length, dtype=torch.long, device=slots.device)
        for row, (values, used) in enumerate(rows):
            start = length - values.shape[0]
            embeds[row, start:] = values
            mask[row, start:] = 1
            if self.slot_positions == "parallel":
                slot_pos = torch.arange(used, device=slots.device) % self.tokens
                after = self.tokens if used else 0
            else:
                slot_pos, after = torch.arange(used, device=slots.device), used
            text_pos = after + torch.arange(values.shape[0] - used, device=slots.device)
            positions[row, start:] = torch.cat([slot_pos, text_pos])
        return embeds, mask, positions

    @contextlib.contextmanager
    def reading(self):
        """The model as it reads slots: the served model as it is (the adapter off), or, for
        a compressor whose adapter also reads (`adapter_reads`), with the adapter on."""
        if self.adapter_reads:
            yield
            return
        with self.model.disable_adapter():
            was, self._adapter_off = self._adapter_off, True
            try:
                yield
            finally:
                self._adapter_off = was

    def loss(
        self, tokenizer, contexts, prompts, completions, relevant=None, recite: float = 0.0, every_chunk: bool = False
    ) -> torch.Tensor:
        """Mean cross-entropy of each completion's tokens given its context's slots and its
        prompt, as the model reads slots (`reading`); with `recite` > 0 and each row's
        `relevant` sentences, plus `recite` times the cross-entropy of those sentences
        written from the same slots in place of the answer (every character of the facts
        is a target, where the answer's few numbers are all the answer loss asks for). With
        `select`, the model reads the slots of the chunks that hold the `relevant` sentences
        and of the best-scored others up to `select` (as it will read them), and the
        relevance head's binary cross-entropy on which chunks hold them is added; only the
        chunks read and a few others are back-propagated through (`_selected_slots`), every
        chunk with `every_chunk`."""
        selection = None
        if not self.select:
            slots, slot_mask = self.compress_prompts(tokenizer, contexts, prompts)
        elif relevant is None:
            raise CompressorError("compress.select trains on each row's `relevant` sentences: give them")
        else:
            slots, slot_mask, selection = self._selected_slots(tokenizer, contexts, prompts, relevant, every_chunk)
        loss = self._response_loss(tokenizer, slots, slot_mask, prompts, completions)
        if selection is not None:
            loss = loss + selection
        if recite > 0 and relevant is not None:
            facts = [
                [{"role": "assistant", "content": r}] if not isinstance(p, str) else r
                for p, r in zip(prompts, relevant)
            ]
            loss = loss + recite * self._response_loss(tokenizer, slots, slot_mask, prompts, facts)
        return loss

    def _response_loss(self, tokenizer, slots, slot_mask, prompts, completions) -> torch.Tensor:
        from rlhf.models.generation import encode_response

        pieces, answer_lengths = [], []
        for prompt, completion in zip(prompts, completions):
            ids, start = encode_response(tokenizer, prompt, completion)
            pieces.append(ids)
            answer_lengths.append(len(ids) - start)
        embeds, mask, positions = self.decoder_inputs(slots, slot_mask, pieces)
        with self.reading():
            logits = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
        labels = torch.full(mask.shape, -100, dtype=torch.long, device=mask.device)
        for row, (ids, answer) in enumerate(zip(pieces, answer_lengths)):
            labels[row, mask.shape[1] - answer :] = torch.tensor(ids[len(ids) - answer :], device=mask.device)
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
        )

    @torch.inference_mode()
    def generate(self, tokenizer, contexts, prompts, max_new_tokens: int, batch_size: int = 32) -> list[str]:
        """Greedy answers to `prompts`, each read after its context's slots."""
        from rlhf.models.generation import PLAIN_DECODING, format_prompt, stop_token_ids

        self.model.eval()
        texts: list[str] = []
        for start in range(0, len(prompts), batch_size):
            part = slice(start, start + batch_size)
            slots, slot_mask, scores = self.compress_prompts(tokenizer, contexts[part], prompts[part], scores=True)
            slot_mask = self.selected(slot_mask, scores)
            pieces = [
                tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts[part]
            ]
            embeds, mask, positions = self.decoder_inputs(slots, slot_mask, pieces)
            with self.reading():
                out = self.model.generate(
                    inputs_embeds=embeds,
                    attention_mask=mask,
                    position_ids=positions,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=stop_token_ids(self.model, tokenizer, chat=not isinstance(prompts[0], str)),
                    pad_token_id=tokenizer.pad_token_id,
                    **PLAIN_DECODING,
                )
            texts += tokenizer.batch_decode(out, skip_special_tokens=True)
        return texts
