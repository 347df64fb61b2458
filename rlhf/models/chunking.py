"""Where a context compressor (rlhf.models.compressor) cuts a context into chunks, and
which chunks hold a row's relevant sentences: text and token offsets only, no model."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf.params import InputError

CHUNK_BY = ("tokens", "sentences")  # where a context is cut into chunks: chunk_spans
SENTENCE_BREAK = r"(?<=[.?!])\s+"  # as rlhf.tasks.long_context.sentences splits (models may not import tasks)


class CompressorError(InputError, ValueError):
    """A compressor's settings or folder are unusable; the message says what to change."""


def chunk_spans(text: str, offsets: Sequence[tuple[int, int]], chunk_tokens: int, by: str = "tokens"):
    """[first, end) token ranges of a text's chunks, from its tokens' character `offsets`:
    every `chunk_tokens` tokens (`tokens`), or as many whole sentences as fit in
    `chunk_tokens` (`sentences`; a sentence longer than that is cut every `chunk_tokens`),
    so that no fact is spread over two chunks' slots. A token that carries the space before a
    sentence (byte-level BPE's " The") opens that sentence's chunk. An empty text is one
    empty chunk."""
    import bisect
    import re

    if by not in CHUNK_BY:
        raise CompressorError(f"compress.chunk_by {by!r}: expected one of {CHUNK_BY}")
    count = len(offsets)
    if by == "tokens" or count == 0:
        return [(first, min(first + chunk_tokens, count)) for first in range(0, max(1, count), chunk_tokens)]
    ends = [end for _, end in offsets]  # a sentence opens its first token that ends past its first character
    cuts = sorted({bisect.bisect_right(ends, m.end()) for m in re.finditer(SENTENCE_BREAK, text)} - {0} | {count})
    spans, first = [], 0
    while first < count:
        fits = [cut for cut in cuts if first < cut <= first + chunk_tokens]
        end = fits[-1] if fits else first + chunk_tokens
        spans.append((first, end))
        first = end
    return spans


def relevant_chunks(
    tokenizer, contexts: Sequence[str], relevant: Sequence[str], chunk_tokens: int, chunk_by: str = "tokens"
) -> list[list[bool]]:
    """Per context, for each of its chunks (`chunk_spans`, as the compressor cuts it),
    whether the chunk overlaps a sentence of that row's `relevant` text; each sentence must
    appear in its context as written."""
    import re

    labels = []
    for row, (context, facts) in enumerate(zip(contexts, relevant)):
        spans = []
        for sentence in re.split(SENTENCE_BREAK, str(facts).strip()):
            at = context.find(sentence)
            if at < 0:
                raise CompressorError(
                    f"row {row}: relevant sentence {sentence[:60]!r} is not in its context as written; `relevant` "
                    "must quote the context's sentences"
                )
            spans.append((at, at + len(sentence)))
        offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        chunks = []
        for first, end in chunk_spans(context, offsets, chunk_tokens, chunk_by):
            start, stop = (offsets[first][0], offsets[end - 1][1]) if end > first else (0, 0)
            chunks.append(any(a < stop and start < b for a, b in spans))
        labels.append(chunks)
    return labels
