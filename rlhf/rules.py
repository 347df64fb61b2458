"""The params' cross-section rules: what one run of these params has, and the messages.

Each section validates alone (its pydantic Config); what spans sections (an online reward
that needs a reward model, which needs preference data; a gate test on a suite nobody
evaluates) is checked by the section that asks for it, in its Config's
`cross_problems(run)`, which `rlhf.params.cross_section_problems` collects after every
section validated. They share a `Run`: the task, the data the params provide, the eval
suites prepare writes, and the few checks several sections make (a model the run does
not train, answers the task cannot check, a scorer folder, a suite or metric name, a
quantized model trained without adapters), so that each message is written once.

The pipeline's paths come from the caller (stages/__init__.py): the library names no
pipeline folder.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from pathlib import Path

# Rewards that read the reference answer (best-of-N must not; they need a task that checks answers).
ANSWER_REWARDS = ("answer_match", "numeric_tolerance")


class Run:
    """What a run of `params` (every section validated) has. `suites`: the eval suites
    prepare writes; `decision`: the one the gate and tuning read by default;
    `difficulties(suite)`: a suite's difficulty labels, or None where not known here."""

    def __init__(
        self,
        params: dict,
        suites: list[str],
        decision: str,
        models_dir: Path,
        reward_model_dirs: dict[str, Path],
        difficulties: Callable[[str], set[str] | None],
    ):
        from rlhf.tasks import get_task

        self.params = params
        self.task = get_task(params["task"])
        self.available = params["prepare"].available()
        self.suites = suites
        self.decision = decision
        self.models_dir = models_dir
        self.reward_model_dirs = reward_model_dirs
        self._difficulties = difficulties
        self._known: dict[str, set[str] | None] = {}
        harness = params["evaluate"].harness
        self.harness_suites = {f"harness/{t}" for t in (harness.tasks if harness else [])}
        self.harness_suites |= {f"harness/rlhf_{s}" for s in (harness.suites if harness else [])}

    # ------------------------------------------------------------------ data and models

    def prm_available(self) -> bool:
        """Given step labels, or a task whose answers let stage prm derive them."""
        return "prm" in self.available or self.task.checks_answers

    def need_model(self, what: str, name: str, key: str) -> list[str]:
        """`what` (at `key`) reads the pipeline's reward model or PRM (`name`): the data that trains it."""
        if name == "reward_model" and "prefs" not in self.available:
            return [f"{key}: {what} needs the reward model, which needs preference data: add prepare.files.prefs"]
        if name == "prm" and not self.prm_available():
            return [
                f"{key}: {what} needs a process reward model: add prepare.files.prm (step labels), or use a "
                f"task whose answers can be checked (task.kind), from which stage prm derives them"
            ]
        return []

    def need_answers(self, what: str, key: str) -> list[str]:
        if self.task.checks_answers:
            return []
        return [f"{key}: {what} needs checkable answers; task.kind {self.task.name!r} has none"]

    def format_problems(self, reward, key: str) -> list[str]:
        """A format reward without a pattern, for a task that defines no format."""
        if reward.name != "format" or reward.pattern is not None or self.task.has_format:
            return []
        return [
            f"{key}: the format reward needs a pattern: task {self.task.name!r} defines no format; give the reward a "
            "`pattern` (a regular expression a well-formed reply matches), set task.format_pattern, or remove the entry"
        ]

    def scorer_problems(self, reward, key: str) -> list[str]:
        """A model-based reward's own `path`: a folder that holds another kind of model, or
        one under models/ that no stage writes (a typo), named before any stage trains; and
        an uncertainty penalty on an ensemble of one member (its std is 0: no penalty)."""
        path = getattr(reward, "path", None)
        if path is not None:
            return self.scorer_path_problems(reward.name, path, f"{key}.path")
        if getattr(reward, "uncertainty_penalty", 0) > 0 and self.params["rm"].num_members == 1:
            return [
                f"{key}.uncertainty_penalty: the ensemble's spread is 0 with rm.num_members 1, so the penalty "
                "does nothing; train several members (rm.num_members), or remove it"
            ]
        return []

    def scorer_path_problems(self, kind: str, path, key: str) -> list[str]:
        """A scorer folder a param names: one of another kind or a PRM of another step
        separator, or one under models/ that no stage writes (a typo)."""
        from rlhf.models.folders import scorer_problem

        written = self.reward_model_dirs[kind]
        if problem := scorer_problem(kind, path, self.task.step_separator if kind == "prm" else None):
            return [f"{key}: {problem}"]
        if not Path(path).exists() and Path(path).parts[:1] == (self.models_dir.name,) and Path(path) != written:
            return [f"{key}: {path} does not exist, and no stage writes it (the pipeline's is {written})"]
        return []

    def model_settings(self, block):
        """params `model` with a block's own `model:` keys."""
        return self.params["model"].merged(getattr(block, "model", None))

    def adapter_problems(self, key: str, block) -> list[str]:
        """A block that trains a model it loads quantized: only through LoRA adapters (QLoRA)."""
        settings = self.model_settings(block)
        if settings.quantization is None or block.lora.enabled:
            return []
        return [
            f"{key}.lora.enabled: the model loads {settings.quantization.bits}-bit (model.quantization) and "
            f"quantized weights train only through adapters (QLoRA): set {key}.lora.enabled: true, or "
            f"{key}.model.quantization: false"
        ]

    def full_training_problems(self, key: str, block, what: str) -> list[str]:
        """A block that trains some weights in full (`what`), which quantized weights cannot."""
        if self.model_settings(block).quantization is None:
            return []
        return [f"{key}.model.quantization: {what} in full, which quantized weights cannot: set it to false"]

    # ------------------------------------------------------------------ suites and metrics

    def suite_problems(self, key: str, suite: str | None, harness_scores: bool = False) -> list[str]:
        """A suite a param names that prepare does not write (None: the default role).
        `harness_scores`: the reader reads the eval report, where lm-evaluation-harness
        tasks' scores are suites too (the gate)."""
        if suite is None or suite in self.suites or (harness_scores and suite in self.harness_suites):
            return []
        if suite in self.harness_suites:
            return [
                f"{key}: {suite!r} is an lm-evaluation-harness score, not a suite of problems this stage can run; "
                f"name one of {self.suites}"
            ]
        return [
            f"{key}: no eval suite {suite!r} (prepare writes {self.suites}); add prepare.files.eval_{suite} "
            "or name one of those (null: the default role)"
        ]

    def metric_problems(self, key: str, metric: str | None, suite: str | None) -> list[str]:
        """A metric name that no eval suite's report has (a harness task's are its own)."""
        from rlhf.evaluation.suites import SUITE_METRICS

        if metric is None or metric in SUITE_METRICS or (suite or "").startswith("harness/"):
            return []
        close = difflib.get_close_matches(metric, SUITE_METRICS, n=2)
        return [
            f"{key}: no metric {metric!r} in an eval suite's report"
            + (f" (did you mean {' or '.join(close)}?)" if close else "")
            + f"; one of {', '.join(SUITE_METRICS)} (a harness task's own metrics: name its suite harness/<task>)"
        ]

    def metric_needs(self, metric: str, key: str, remedy: str, in_round: bool = False) -> list[str]:
        """What the run must have for `metric` to be in the eval report a test reads (a
        round's evaluation scores no reward model)."""
        problems = []
        if metric == "accuracy":
            problems += self.need_answers("metric accuracy", key)
        if metric == "format_rate" and not self.task.has_format:
            problems.append(f"{key}: task {self.task.name!r} defines no format (set task.format_pattern)")
        if metric in ("reward", "win_rate") and in_round:
            problems.append(
                f"{key}: a round's evaluation scores no reward model, so it has no {metric}; test accuracy, "
                f"format_rate or kl_to_ref, or {remedy}"
            )
        elif metric in ("reward", "win_rate"):
            problems += self.need_model(f"metric {metric}", "reward_model", key)
        if metric == "kl_to_ref" and self.params["evaluate"].kl_prompts == 0:
            problems.append(
                f"{key}: kl_to_ref is not measured with evaluate.kl_prompts 0; set kl_prompts above 0, or {remedy}"
            )
        return problems

    def difficulty_problems(self, key: str, suite: str, test) -> list[str]:
        """A capability test that names a difficulty its suite lacks."""
        if test.difficulty is None:
            return []
        if suite not in self._known:
            self._known[suite] = self._difficulties(suite)
        labels = self._known[suite]
        unknown = sorted(set(test.difficulty) - labels) if labels is not None else []
        if not unknown:
            return []
        shown = ", ".join(sorted(labels, key=lambda x: (0, int(x), "") if x.isdecimal() else (1, 0, x)))
        return [
            f"{key}: suite {suite!r} has no problem of difficulty {','.join(unknown)} (its difficulties: "
            f"{shown or 'none: no answered problem has a difficulty'}); name those, or null for every problem"
        ]


def model_blocks(params: dict) -> Iterator[tuple[str, object]]:
    """(params key, block) of every section or block that loads a model and may carry its
    own `model:` keys: a section's Config says which (`model_blocks(section)`), or is one
    when it has a `model` field of those keys."""
    from typing import get_args

    from rlhf.models.settings import ModelOverride

    for section, config in params.items():
        blocks = getattr(config, "model_blocks", None)
        field = type(config).model_fields.get("model")
        if blocks is not None:
            yield from blocks(section)
        elif field is not None and ModelOverride in (field.annotation, *get_args(field.annotation)):
            yield section, config
