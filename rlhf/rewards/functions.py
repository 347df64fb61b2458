"""Rewards for online policy optimisation (GRPO, RLOO, PPO), declared in params as a
weighted list, as in RLVR setups::

    rewards:
      - {name: answer_match, weight: 1.0}
      - {name: format, weight: 0.2}
      - {name: reward_model, weight: 0.5, uncertainty_penalty: 1.0}
      - {name: banned, weight: 1.0, words: ["as an AI"]}

Every reward is a plain function of (prompts, completions, row fields) -> one float per
completion, with TRL's reward-function signature; the task (rlhf.tasks) reads and checks
answers and formats, so the same rewards serve any task, so the same functions serve TRL's
`GRPOTrainer`/`RLOOTrainer` (a list plus `reward_weights`) and our PPO (their weighted
sum, `weighted_sum`). Row fields are the prompt table's other columns (e.g. `answer`),
repeated for each completion.

Kinds:

* answer_match — 1 when the task says the completion reaches the row's `answer`.
* numeric_tolerance — 1 when |predicted - answer| <= atol + rtol * |answer| (the task's
  extracted answer read as a number).
* format — 1 when the completion matches `pattern` (default: the task's own format check).
* reward_model — the RM ensemble's mean score minus `uncertainty_penalty` * its std.
* prm — the process reward model's step scores aggregated to one (min, prod or last).
* length / repetition / banned — constitutional rule checks: 1 when the completion is at
  most `max_chars` long; 1 minus the share of repeated n-grams; 0 when a banned string
  appears, else 1. An empty completion gets 0 from each (saying nothing breaks no rule, and
  would otherwise be the surest way to earn them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from rlhf.data.contracts import completion_text
from rlhf.params import StageConfig
from rlhf.tasks.base import Task

RewardFn = Callable[..., list[float]]
ModelDirs = Mapping[str, "str | Path"]  # reward name -> model folder, for model-based rewards without a `path`


def _answers(answer, count: int) -> list:
    """One reference per completion; None where the prompt has none (a missing cell reads
    back from Parquet as None or NaN, an empty one as "")."""
    if answer is None:
        raise ValueError(
            "this reward needs an `answer` column in the prompt data: give prepare.files.prompts with prompt and "
            "answer, or SFT data whose completions state answers the task reads"
        )
    answers = list(answer) if not isinstance(answer, str) else [answer] * count
    return [None if a is None or a != a or (isinstance(a, str) and not a.strip()) else a for a in answers]


# ----------------------------------------------------------------------------- functions


def answer_match(prompts: Sequence, completions: Sequence, answer=None, *, task: Task, **_) -> list[float]:
    """1 for a completion that reaches its prompt's answer, else 0 (0 for a prompt without one)."""
    answers = _answers(answer, len(completions))
    return [float(a is not None and task.is_correct(completion_text(c), a)) for c, a in zip(completions, answers)]


def _as_number(text) -> float | None:
    try:
        return float(str(text).replace(",", ""))
    except (TypeError, ValueError):
        return None


def numeric_tolerance(
    prompts: Sequence, completions: Sequence, answer=None, atol: float = 0.0, rtol: float = 0.0, *, task: Task, **_
) -> list[float]:
    """1 for a completion whose answer is within atol + rtol * |reference| of its prompt's
    answer (both read by the task, as answer_match reads them), else 0."""
    rewards = []
    for completion, reference in zip(completions, _answers(answer, len(completions))):
        predicted = _as_number(task.extract_answer(completion_text(completion)))
        target = _as_number(_reference(task, reference))
        ok = predicted is not None and target is not None and abs(predicted - target) <= atol + rtol * abs(target)
        rewards.append(float(ok))
    return rewards


def _reference(task: Task, reference) -> str | None:
    if reference is None:
        return None
    try:
        return task.reference_answer(reference)
    except ValueError:
        return None


def format_match(
    prompts: Sequence, completions: Sequence, pattern: str | None = None, *, task: Task, **_
) -> list[float]:
    if pattern is None:
        if not task.has_format:
            raise ValueError(f"the format reward needs a `pattern`: task {task.name!r} defines no format")
        return [float(task.is_well_formatted(completion_text(c))) for c in completions]
    regex = re.compile(pattern, re.DOTALL)
    return [float(bool(regex.fullmatch(completion_text(c).strip()))) for c in completions]


def _nothing_for_empty(rule: RewardFn) -> RewardFn:
    """A rule check as a reward: nothing for an empty (or blank) completion, which keeps
    every rule trivially, so a policy rewarded by rules would learn to say nothing. The rules
    themselves stay plain measures (the validator counts repeats and banned strings)."""

    def checked(prompts: Sequence, completions: Sequence, **kwargs) -> list[float]:
        scores = rule(prompts, completions, **kwargs)
        return [score if completion_text(c).strip() else 0.0 for c, score in zip(completions, scores)]

    checked.__name__ = rule.__name__
    checked.__doc__ = rule.__doc__
    return checked


def length_rule(prompts: Sequence, completions: Sequence, max_chars: int = 200, **_) -> list[float]:
    return [float(len(completion_text(c)) <= max_chars) for c in completions]


def repetition_rule(prompts: Sequence, completions: Sequence, ngram: int = 3, **_) -> list[float]:
    """1 - (repeated n-grams / all n-grams) over whitespace words, or characters when a
    completion has fewer than `ngram` words (the built-in task has few spaces)."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        units = text.split()
        if len(units) < ngram:
            units = list(text)
        grams = [tuple(units[i : i + ngram]) for i in range(len(units) - ngram + 1)]
        rewards.append(1.0 - (len(grams) - len(set(grams))) / len(grams) if grams else 1.0)
    return rewards


def banned_pattern(words: Sequence[str]):
    """One case-insensitive pattern for `words`: each a whole word where it starts or ends
    with an ASCII letter or digit ("AI" is not in "said"), a plain substring elsewhere (a
    word of a script written without spaces)."""
    import re

    def one(word: str) -> str:
        edge = re.compile(r"[A-Za-z0-9]")
        before = r"(?<![A-Za-z0-9])" if word and edge.match(word[0]) else ""
        after = r"(?![A-Za-z0-9])" if word and edge.match(word[-1]) else ""
        return before + re.escape(word) + after

    return re.compile("|".join(one(w) for w in words), re.IGNORECASE) if words else None


def banned_rule(prompts: Sequence, completions: Sequence, words: Sequence[str] = (), **_) -> list[float]:
    pattern = banned_pattern(words)
    return [0.0 if pattern and pattern.search(completion_text(c)) else 1.0 for c in completions]


# ----------------------------------------------------------------------------- config


class _Reward(StageConfig):
    weight: float = Field(1.0, description="weight of this reward in the sum")
    function: ClassVar[RewardFn]

    def build(self, task: Task, model_dirs: ModelDirs, trust_remote_code: bool = False) -> RewardFn:
        """The reward function with this entry's options and the task bound."""
        options = self.model_dump(exclude={"name", "weight"})
        return partial(type(self).function, task=task, **options)


class AnswerMatch(_Reward):
    name: Literal["answer_match"]
    function = staticmethod(answer_match)


class NumericTolerance(_Reward):
    name: Literal["numeric_tolerance"]
    atol: float = Field(0.0, ge=0, description="absolute tolerance")
    rtol: float = Field(0.0, ge=0, description="tolerance relative to |answer|")
    function = staticmethod(numeric_tolerance)


class FormatReward(_Reward):
    name: Literal["format"]
    pattern: str | None = Field(None, description="regex the whole completion must match; None = the task's format")
    function = staticmethod(format_match)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value):
        if value is not None:
            try:
                re.compile(value)
            except re.error as error:
                raise ValueError(f"not a valid regular expression: {error}") from error
        return value


class RewardModelReward(_Reward):
    name: Literal["reward_model"]
    path: str | None = Field(None, description="the RM ensemble directory; null = the pipeline's (stage rm)")
    uncertainty_penalty: float = Field(0.0, ge=0, description="k in mean - k * std over the members")

    def build(self, task: Task, model_dirs: ModelDirs, trust_remote_code: bool = False) -> RewardFn:
        from rlhf.rewards.ensemble import RewardEnsemble

        ensemble = RewardEnsemble.load(model_path(self, model_dirs), trust_remote_code)

        def reward_model(prompts, completions, **_):
            scores = ensemble.score(prompts, completions)
            return (scores.mean - self.uncertainty_penalty * scores.std).tolist()

        return reward_model


class PRMReward(_Reward):
    name: Literal["prm"]
    path: str | None = Field(None, description="the process reward model directory; null = the pipeline's (stage prm)")
    aggregate: Literal["min", "prod", "last"] = Field("min", description="step scores -> one score")

    def build(self, task: Task, model_dirs: ModelDirs, trust_remote_code: bool = False) -> RewardFn:
        from rlhf.rewards.prm import load_prm

        prm = load_prm(model_path(self, model_dirs), trust_remote_code, task.step_separator, key="reward prm")

        def prm_reward(prompts, completions, **_):
            return prm.score_completions(list(prompts), [completion_text(c) for c in completions], self.aggregate)

        return prm_reward


class LengthRule(_Reward):
    name: Literal["length"]
    max_chars: int = Field(200, gt=0, description="longest completion that passes")
    function = staticmethod(_nothing_for_empty(length_rule))


class RepetitionRule(_Reward):
    name: Literal["repetition"]
    ngram: int = Field(3, gt=0, description="n-gram size whose repeats are penalised")
    function = staticmethod(_nothing_for_empty(repetition_rule))


class BannedRule(_Reward):
    name: Literal["banned"]
    words: list[str] = Field(..., min_length=1, description="strings that must not appear (case-insensitive)")
    function = staticmethod(_nothing_for_empty(banned_rule))


RewardSpec = Annotated[
    AnswerMatch
    | NumericTolerance
    | FormatReward
    | RewardModelReward
    | PRMReward
    | LengthRule
    | RepetitionRule
    | BannedRule,
    Field(discriminator="name"),
]

DEFAULT_REWARDS = [{"name": "answer_match", "weight": 1.0}, {"name": "format", "weight": 0.1}]


class _Named:
    """A reward function with a `__name__`: TRL logs each reward under its function's name."""

    def __init__(self, name: str, function: RewardFn):
        self.__name__ = name
        self.function = function

    def __call__(self, prompts, completions, **fields) -> list[float]:
        return [float(r) for r in self.function(prompts, completions, **fields)]


def build_rewards(
    specs: Sequence, task: Task, model_dirs: ModelDirs | None = None, trust_remote_code: bool = False
) -> tuple[list[RewardFn], list[float]]:
    """The reward functions and their weights, in the order declared. Model-based rewards
    load their models here, once: from their `path`, else from `model_dirs[name]` (the
    caller's folders, e.g. {"reward_model": models/rm, "prm": models/prm})."""
    model_dirs = model_dirs or {}
    functions = [
        _Named(f"{i}_{spec.name}", spec.build(task, model_dirs, trust_remote_code)) for i, spec in enumerate(specs)
    ]
    return functions, [spec.weight for spec in specs]


def model_path(spec, model_dirs: ModelDirs) -> Path:
    """The model directory a model-based reward reads: its own `path`, else the caller's."""
    if spec.path is not None:
        return Path(spec.path)
    if spec.name not in model_dirs:
        raise ValueError(f"reward {spec.name!r} has no `path` and the caller gave no default folder for it")
    return Path(model_dirs[spec.name])


def model_paths(specs: Sequence, model_dirs: ModelDirs | None = None) -> list[Path]:
    """The model directories the rewards read (for fingerprints and checks)."""
    return [model_path(s, model_dirs or {}) for s in specs if isinstance(s, (RewardModelReward, PRMReward))]


def weighted_sum(functions: Sequence[RewardFn], weights: Sequence[float]) -> RewardFn:
    """One reward: sum_i w_i * r_i(prompts, completions, **fields)."""

    def total(prompts, completions, **fields) -> list[float]:
        sums = [0.0] * len(completions)
        for function, weight in zip(functions, weights):
            for i, value in enumerate(function(prompts, completions, **fields)):
                sums[i] += weight * value
        return sums

    total.__name__ = "weighted_sum"
    return total
