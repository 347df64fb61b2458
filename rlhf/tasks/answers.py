"""Tasks for the user's own data: the shared settings and the generic answer kinds.

`UserTask` holds what every user kind may set in params (`task:`):

* `format_pattern` — a regex the whole completion, stripped of surrounding space, must
  match (`re.fullmatch`, with `re.DOTALL` so `.` crosses lines: the convention of the
  `format` reward's own `pattern`). Set, the task has a format (`has_format`) and
  `is_well_formatted` is that match; unset, the task has no format.
* `step_separator` — between the steps of a solution (default a newline: steps are lines).

The kinds here (`gsm8k` and `math` have their own modules):

* `last_number` — the last number in the completion, compared numerically.
* `regex` — the capture group of the last match of `pattern`, compared as text (`exact`:
  case and runs of space ignored) or as numbers (`numeric`).
* `choice` — a multiple-choice letter (`choices`, default ``ABCD``).
* `none` — no checkable answer (`checks_answers` is False).

Numbers are compared through one canonical string (`normalize_number`): thousands commas,
``$`` and a trailing ``.0`` go, so ``$1,000.00`` and ``1000`` are the same answer and the
same vote. Every regex is compiled once, when the task is built.
"""

from __future__ import annotations

import re
from decimal import Decimal

from rlhf.tasks.base import Task, normalize_text

# A number as written in prose: optional minus (not the operator of `10-3`), optional `$`,
# digits with or without thousands commas, optional decimals (a sentence's final `.` is not
# one). `1,2,3` is three numbers, `1,000` one.
NUMBER = r"(?<![\w.])-?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(NUMBER)
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")


def normalize_number(text) -> str | None:
    """The canonical string of the number `text` states (``"$1,000.50"`` -> ``"1000.5"``,
    ``"18.0"`` -> ``"18"``), or None when it is not one plain number."""
    cleaned = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    if not _PLAIN_NUMBER_RE.fullmatch(cleaned):
        return None
    value = Decimal(cleaned)
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def last_number(text: str) -> str | None:
    """The canonical string of the last number in `text`, or None when it has none."""
    numbers = _NUMBER_RE.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def numeric_reference(answer, kind: str) -> str:
    """A numeric task's reference answer, canonical; ValueError when it is not a number."""
    value = normalize_number(answer)
    if value is None:
        raise ValueError(f"task kind {kind!r} compares numbers, but the reference answer {answer!r} is not one")
    return value


def compile_setting(key: str, pattern: str, flags: int = 0) -> re.Pattern:
    """`pattern` compiled, or a ValueError that names the params key it came from."""
    try:
        return re.compile(pattern, flags)
    except re.error as error:
        raise ValueError(f"{key}: {pattern!r} is not a valid regex ({error})") from None


def last_match(regex: re.Pattern, text: str) -> re.Match | None:
    match = None
    for match in regex.finditer(text):
        pass
    return match


class UserTask(Task):
    """The settings every user kind shares: an optional format and the step separator."""

    settings = ("format_pattern", "step_separator")

    def __init__(self, format_pattern: str | None = None, step_separator: str = "\n"):
        if not step_separator:
            raise ValueError("step_separator: must not be empty (a newline makes steps lines)")
        self.format_pattern = format_pattern
        self.step_separator = step_separator
        self._format = None if format_pattern is None else compile_setting("format_pattern", format_pattern, re.DOTALL)
        self.has_format = self._format is not None

    def is_well_formatted(self, completion: str) -> bool:
        return self._format is None or self._format.fullmatch(completion.strip()) is not None


class LastNumberTask(UserTask):
    """The answer is the last number in the completion, compared numerically."""

    name = "last_number"

    def extract_answer(self, completion: str) -> str | None:
        return last_number(completion)

    def reference_answer(self, answer) -> str:
        return numeric_reference(answer, self.name)


class RegexTask(UserTask):
    """The answer is the capture group of the last match of `pattern` (compiled as given;
    flags go inline, e.g. ``(?i)``), compared as text or as numbers (`compare`)."""

    name = "regex"
    settings = (*UserTask.settings, "pattern", "compare")

    def __init__(self, pattern: str | None = None, compare: str = "exact", **shared):
        super().__init__(**shared)
        if pattern is None:
            raise ValueError(
                r"pattern: required by task kind 'regex': a regex with one capture group, e.g. 'Final: (\S+)'"
            )
        self.pattern = compile_setting("pattern", pattern)
        if self.pattern.groups != 1:
            raise ValueError(
                f"pattern: {pattern!r} has {self.pattern.groups} capture groups; it needs exactly one, around the "
                "answer (make any other group non-capturing: (?:...))"
            )
        if compare not in ("exact", "numeric"):
            raise ValueError(f"compare: must be 'exact' or 'numeric', got {compare!r}")
        self.compare = compare

    def extract_answer(self, completion: str) -> str | None:
        match = last_match(self.pattern, completion)
        if match is None or match.group(1) is None:
            return None
        if self.compare == "numeric":
            return normalize_number(match.group(1))
        return normalize_text(match.group(1)) or None

    def reference_answer(self, answer) -> str:
        return numeric_reference(answer, self.name) if self.compare == "numeric" else normalize_text(answer)

    def is_final_step(self, step: str) -> bool:
        return self.pattern.search(step) is not None


class ChoiceTask(UserTask):
    """A multiple-choice letter, looked for in this order (the last occurrence of each):
    ``answer is (B)`` / ``Answer: B`` / ``the answer is option B``; then ``(B)`` anywhere;
    then a last line that is the letter alone (``B``, ``B.``, ``**B**``). Inside parentheses
    the letter may be in either case; bare, it must be written as in `choices` (so that
    ``the answer is a dog`` is not option A). Letters are compared case-insensitively."""

    name = "choice"
    settings = (*UserTask.settings, "choices")

    def __init__(self, choices: str = "ABCD", **shared):
        super().__init__(**shared)
        if len(choices) < 2 or not choices.isalnum() or len(set(choices.upper())) != len(choices):
            raise ValueError(f"choices: {choices!r} must be two or more distinct letters or digits, e.g. 'ABCD'")
        self.choices = choices
        letter = f"[{re.escape(choices)}]"
        either_case = f"(?i:{letter})"
        self._stated = re.compile(
            rf"(?i:answer)\s*(?:(?i:is)|:)[\s:*]*(?:(?i:option|choice)\s+)?"
            rf"(?:\(\s*({either_case})\s*\)|({letter})(?!\w))"
        )
        self._parenthesised = re.compile(rf"\(\s*({either_case})\s*\)")
        self._alone = re.compile(rf"\W*({letter})\W*")

    def extract_answer(self, completion: str) -> str | None:
        match = last_match(self._stated, completion) or last_match(self._parenthesised, completion)
        if match is None:
            lines = [line for line in completion.splitlines() if line.strip()]
            match = self._alone.fullmatch(lines[-1].strip()) if lines else None
        if match is None:
            return None
        return next(group for group in match.groups() if group is not None).upper()

    def reference_answer(self, answer) -> str:
        letter = str(answer).strip().strip("()").strip().upper()
        if len(letter) != 1 or letter not in self.choices.upper():
            raise ValueError(f"the reference answer {answer!r} is not one of the choices {self.choices!r}")
        return letter

    def is_final_step(self, step: str) -> bool:
        return self._stated.search(step) is not None


class NoAnswerTask(UserTask):
    """No checkable answer (open-ended prompts): evaluate reports no accuracy, votes have
    nothing to count, and asking for correctness is an error."""

    name = "none"
    checks_answers = False

    def extract_answer(self, completion: str) -> str | None:
        return None

    def is_correct(self, completion: str, answer) -> bool:
        raise ValueError(
            "task kind 'none' checks no answers; set task.kind to one that does (gsm8k, math, last_number, "
            "regex, choice) or drop the accuracy-based metric or reward"
        )
