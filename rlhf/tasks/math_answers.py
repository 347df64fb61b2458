"""Competition mathematics (MATH, Hendrycks et al. 2021): final answers are LaTeX
expressions, compared for mathematical equality by math-verify (``\\frac{1}{2}`` reaches
``0.5``, ``2\\sqrt{2}`` reaches ``\\sqrt{8}``).

A completion is read as TRL's `accuracy_reward` reads it: LaTeX only, ``\\boxed{}`` first,
otherwise an expression in math delimiters after an anchor such as "the answer is", so a
completion must state its answer in LaTeX. The reference answer may be a bare expression
(``\\frac{\\pi}{4}``, read as if boxed) or a whole solution containing ``\\boxed{}``.
`extract_answer` gives the parsed answer as a sympy string for votes (decimals as
fractions, so ``0.5`` and ``\\frac{1}{2}`` are one vote; other equal forms may still split).

Steps are lines by default, as in PRM800K; set `step_separator: "\\n\\n"` for paragraphs. A
step with a ``\\boxed{}`` answer is the final step.

math-verify pulls in sympy, so it is imported on first use, not with this module; parses are
cached because evaluate and votes read the same completions more than once. Like TRL, the
parse and verify timeouts (which use SIGALRM) apply in the main thread only.
"""

from __future__ import annotations

import logging
import threading
from functools import lru_cache

from rlhf.tasks.answers import UserTask

PARSE_TIMEOUT_S = 10
VERIFY_TIMEOUT_S = 5


def _timeout(seconds: int) -> int | None:
    if threading.current_thread() is threading.main_thread():
        return seconds
    # As TRL does: without SIGALRM there is no timeout, and math-verify would warn so on every call.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return None


@lru_cache(maxsize=4096)
def parse_completion(completion: str) -> tuple:
    """math-verify's parse of a completion (empty when it states no answer), configured as
    TRL's accuracy reward configures it."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse

    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )
    parsed = parse(
        completion, extraction_config=[config], extraction_mode="first_match", parsing_timeout=_timeout(PARSE_TIMEOUT_S)
    )
    return tuple(parsed)


@lru_cache(maxsize=1024)
def parse_reference(answer: str) -> tuple:
    """math-verify's parse of a reference answer; a bare expression is read as if boxed.
    ValueError when math-verify finds no expression in it."""
    from math_verify import parse

    text = answer if "\\boxed" in answer or "$" in answer else f"\\boxed{{{answer}}}"
    parsed = parse(text, parsing_timeout=_timeout(PARSE_TIMEOUT_S))
    if not parsed:
        raise ValueError(f"math-verify finds no expression in the reference answer {answer!r}")
    return tuple(parsed)


def vote_key(parsed: tuple) -> str:
    """One string per parsed answer: sympy's, with decimals turned into fractions."""
    import sympy

    value = parsed[0]
    if getattr(value, "is_Float", False):
        value = sympy.nsimplify(value, rational=True)
    return str(value)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of `text`, its braces balanced; None when
    there is none (or it is never closed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index].strip() or None
            depth -= 1
    return None


class MathTask(UserTask):
    """LaTeX final answers checked for mathematical equality with math-verify."""

    name = "math"

    def extract_answer(self, completion: str) -> str | None:
        parsed = parse_completion(completion)
        return vote_key(parsed) if parsed else None

    def demonstration_answer(self, completion: str) -> str | None:
        """The LaTeX inside the demonstration's last ``\\boxed{}`` as written: sympy's form
        of it (the extracted answer, for votes) is not LaTeX a reference is read back from
        (``pi/4``, ``x**2 + 1``)."""
        return last_boxed(completion)

    def reference_answer(self, answer) -> str:
        return vote_key(parse_reference(str(answer).strip()))

    def is_correct(self, completion: str, answer) -> bool:
        from math_verify import verify

        gold = parse_reference(str(answer).strip())
        predicted = parse_completion(completion)
        return bool(predicted) and verify(list(gold), list(predicted), timeout_seconds=_timeout(VERIFY_TIMEOUT_S))

    def is_final_step(self, step: str) -> bool:
        return "\\boxed" in step
