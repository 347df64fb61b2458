"""GSM8K (Cobbe et al. 2021): grade-school word problems whose solutions end in ``#### N``.

The answer is the number after the last ``####``. A model that has not learnt that
convention often states its answer otherwise, so unless `strict` the answer falls back, as
lm-evaluation-harness's "flexible-extract" does, to the last ``\\boxed{N}``, then the last
``the answer is N`` (or ``answer: N``), then the last number in the text. Numbers are compared
numerically (``#### 1,000`` reaches 1000, ``$18.00`` reaches 18). The reference answer may
be a bare number or a whole GSM8K solution, whose ``####`` line then gives it. Steps are
lines by default; the ``####`` line is the final step.
"""

from __future__ import annotations

import re

from rlhf.tasks.answers import NUMBER, UserTask, last_match, last_number, normalize_number, numeric_reference

MARKER = "####"
_MARKED_RE = re.compile(rf"{MARKER}\s*({NUMBER})")
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
_STATED_RE = re.compile(rf"answer\s*(?:is|:)[\s:*]*({NUMBER})", re.IGNORECASE)


def marked_answer(text: str) -> str | None:
    """The canonical number after the last ``####``, or None."""
    at = text.rfind(MARKER)
    match = _MARKED_RE.match(text, at) if at >= 0 else None
    return normalize_number(match.group(1)) if match else None


def flexible_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` number, else the last ``the answer is N``, else the last number."""
    boxed = last_match(_BOXED_RE, text)
    if boxed is not None and (number := last_number(boxed.group(1))) is not None:
        return number
    stated = last_match(_STATED_RE, text)
    return normalize_number(stated.group(1)) if stated else last_number(text)


class GSM8KTask(UserTask):
    """GSM8K's ``#### N`` answers, with the flexible fallback unless `strict`."""

    name = "gsm8k"
    settings = (*UserTask.settings, "strict")

    def __init__(self, strict: bool = False, **shared):
        super().__init__(**shared)
        self.strict = strict

    def extract_answer(self, completion: str) -> str | None:
        answer = marked_answer(completion)
        return answer if answer is not None or self.strict else flexible_answer(completion)

    def demonstration_answer(self, completion: str) -> str | None:
        """Only a ``#### N`` line: the fallbacks guess (the last number of a reply that
        states no answer is no reference)."""
        return marked_answer(completion)

    def reference_answer(self, answer) -> str:
        text = str(answer)
        if MARKER in text:
            value = marked_answer(text)
            if value is None:
                raise ValueError(f"the reference solution {text[-80:]!r} has no number after its last {MARKER}")
            return value
        return numeric_reference(answer, self.name)

    def is_final_step(self, step: str) -> bool:
        return step.lstrip().startswith(MARKER)
