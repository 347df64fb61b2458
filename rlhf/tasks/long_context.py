"""Long contexts for the word problems: the facts a question needs, hidden in distraction.

The long-context variant of the built-in word problems (rlhf.tasks.word_problems) moves a
problem's facts out of its question into a long context of other sentences, so that a
model must find them there::

    context:  Omar is 12 years old. There are 31 shells in the garden. ... Maya has 34
              stickers. She buys 27 more. ... The library opens at 9 o'clock.
    prompt:   How many stickers does Maya have now?
    relevant: Maya has 34 stickers. She buys 27 more.

The problem's fact sentences stay together, in their order (their pronouns keep their
referent), at a random place among the distractors. Distractors are sentences of the same
kinds, many with numbers, about people and things the problem does not name: every
question has one answer, and a reader who keeps only "sentences with numbers" keeps the
wrong ones. A context is at least `chars` characters long (the built-in model reads a
character as a token: `chars: 1000` is 1,000 of its tokens, four times its 256-token
window).

This is what a context compressor (rlhf.models.compressor) is measured on: something to
keep (the facts), much to drop (the distractors), and a context a model's window cannot
hold whole. Rows carry `context`, `prompt` (the question) and `relevant` (the fact
sentences: the oracle reading, "the model shown only the relevant sentences").

Our own because no maintained generator of distractor-padded word problems exists as a
library (needle-in-a-haystack suites such as RULER's are English-free key-value lookups,
and cannot be downloaded here).
"""

from __future__ import annotations

import random
import re

from rlhf.tasks.story_words import GOODS, NAMES, THINGS

SEPARATOR = "\n"  # between a context and the question after it
PLACES = ("park", "library", "garden", "school", "market", "kitchen", "station", "museum", "harbor", "bakery")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def sentences(text: str) -> list[str]:
    """`text` cut into sentences (each ends at ".", "?" or "!" followed by white space)."""
    return _SENTENCE_END.split(text.strip())


def split_question(problem: str) -> tuple[list[str], str]:
    """(the fact sentences, the question sentence) of a word problem's text."""
    parts = sentences(problem)
    if len(parts) < 2 or not parts[-1].endswith("?"):
        raise ValueError(f"a word problem should be facts then one question: {problem!r}")
    return parts[:-1], parts[-1]


def _named(text: str, words) -> set[str]:
    return {word for word in words if re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE)}


def unnamed(problem: str) -> tuple[list[str], list[str]]:
    """The names and things a problem's text does not mention: what distractors speak of."""
    things = [t for t, _ in THINGS] + list(GOODS)
    return [n for n in NAMES if n not in _named(problem, NAMES)], [
        t for t in things if t not in _named(problem, things)
    ]


def distractor(rng: random.Random, names: list[str], things: list[str]) -> str:
    """One sentence about `names` and `things` (none of them the problem's)."""
    name, other = rng.sample(names, 2)
    thing, place, day = rng.choice(things), rng.choice(PLACES), rng.choice(DAYS)
    n = rng.randint(2, 99)
    return rng.choice((
        f"{name} has {n} {thing}.",
        f"There are {n} {thing} in the {place}.",
        f"{name} walks {n} minutes to the {place}.",
        f"The {place} opens at {rng.randint(6, 11)} o'clock.",
        f"{name} is {rng.randint(6, 70)} years old.",
        f"{name} read {n} pages of a book on {day}.",
        f"{name} and {other} met at the {place} on {day}.",
        f"{name} gave {n} {thing} to {other} last year.",
        f"It rained for {n} minutes on {day}.",
        f"The {place} was quiet that {day}.",
    ))  # fmt: skip


def distractors(rng: random.Random, problem: str, chars: int) -> list[str]:
    """Distractor sentences of at least `chars` characters in all, none repeating what
    another says of the same subject (one age per person, one opening hour per place)."""
    names, things = unnamed(problem)
    sentences: list[str] = []
    said: set[str] = set()
    length = 0
    while length < chars:
        sentence = distractor(rng, names, things)
        subject = re.sub(r"\d+", "N", sentence)  # the sentence with its numbers blanked
        if subject in said:
            continue
        said.add(subject)
        sentences.append(sentence)
        length += len(sentence) + 1
    return sentences


def with_context(problem: str, rng: random.Random, chars: int) -> dict:
    """A problem's text as a long-context row: {context, prompt (the question), relevant}."""
    facts, question = split_question(problem)
    block = " ".join(facts)
    others = distractors(rng, problem, chars - len(block))
    at = rng.randint(0, len(others))
    context = " ".join([*others[:at], block, *others[at:]])
    return {"context": context, "prompt": question, "relevant": block}


def short_context(problem: str, rng: random.Random, max_distractors: int = 1) -> str:
    """A problem's text as one prompt in the long-context format, with at most `max_distractors`
    distractor sentences around its facts (SFT rows: a policy that learns to read a
    context and ignore what the question does not ask about)."""
    facts, question = split_question(problem)
    names, things = unnamed(problem)
    others = [distractor(rng, names, things) for _ in range(rng.randint(0, max_distractors))]
    at = rng.randint(0, len(others))
    return joined(" ".join([*others[:at], *facts, *others[at:]]), question)


def cropped(context: str, relevant: str, extra: int, rng: random.Random) -> str:
    """`context` cut down to its `relevant` sentences and `extra` of the sentences around
    them (how many before and how many after drawn from `rng`), in their order; the whole
    context when `relevant` is not in it word for word."""
    at = context.find(relevant)
    if at < 0 or not relevant:
        return context
    head, tail = context[:at].strip(), context[at + len(relevant) :].strip()
    before = sentences(head) if head else []
    after = sentences(tail) if tail else []
    extra = min(extra, len(before) + len(after))
    take_before = rng.randint(max(0, extra - len(after)), min(extra, len(before)))
    take_after = min(extra - take_before, len(after))
    return " ".join([*before[len(before) - take_before :], relevant, *after[:take_after]])


def joined(context: str, prompt: str) -> str:
    """What a model reads when it reads a context whole: the context, then the question."""
    return f"{context}{SEPARATOR}{prompt}"
