"""Tasks: how a completion's answer is pulled out and checked, what a well-formed
completion looks like, and how a solution splits into steps.

Everything generic (evaluate, the verifiable rewards, the PRM's steps, MCTS, votes, the
gate's default tests) asks the task chosen in params (`task.kind`) through the `Task`
interface of `rlhf.tasks.base`; nothing outside this package knows a task's format. One
small module per task family, picked by name from `TASKS`:

* `builtin` — the built-in arithmetic task (`rlhf.tasks.arithmetic`), which also generates
  the default pipeline's data. It takes no settings.
* `gsm8k` — ``#### N`` answers with a flexible fallback unless `strict` (`rlhf.tasks.gsm8k`).
* `math` — LaTeX answers checked for equality with math-verify (`rlhf.tasks.math_answers`).
* `last_number`, `regex` (`pattern`, `compare`), `choice` (`choices`) and `none` (no
  checkable answer) — `rlhf.tasks.answers`.

Every kind but `builtin` also takes `format_pattern` and `step_separator`. A key the chosen
kind does not read is an error, and so is a setting the kind rejects (a regex that does not
compile, a `pattern` without exactly one group): params are checked by building the task.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf.params import StageConfig, reject_unused
from rlhf.tasks.answers import ChoiceTask, LastNumberTask, NoAnswerTask, RegexTask
from rlhf.tasks.arithmetic import ArithmeticTask
from rlhf.tasks.base import Task
from rlhf.tasks.gsm8k import GSM8KTask
from rlhf.tasks.math_answers import MathTask

TASKS: dict[str, type[Task]] = {
    "builtin": ArithmeticTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
    "last_number": LastNumberTask,
    "regex": RegexTask,
    "choice": ChoiceTask,
    "none": NoAnswerTask,
}


class TaskConfig(StageConfig):
    """params.yaml `task`: which task reads and checks the completions, and its settings."""

    kind: Literal["builtin", "gsm8k", "math", "last_number", "regex", "choice", "none"] = Field(
        "builtin", description="builtin | gsm8k | math | last_number | regex | choice | none (rlhf/tasks/)"
    )
    strict: bool = Field(False, description="gsm8k: only `#### N` counts (no boxed / 'the answer is' / last number)")
    pattern: str | None = Field(None, description="regex (required): one capture group around the answer; last match")
    compare: Literal["exact", "numeric"] = Field("exact", description="regex: exact (case, space ignored) | numeric")
    choices: str = Field("ABCD", description="choice: the option letters, one character each")
    format_pattern: str | None = Field(
        None, description="not builtin: regex a well-formed completion fullmatches (stripped, DOTALL); null: no format"
    )
    step_separator: str = Field("\n", description="not builtin: between the steps of a solution")

    @model_validator(mode="after")
    def _check_settings(self):
        task = TASKS[self.kind]
        unused = [key for key in type(self).model_fields if key != "kind" and key not in task.settings]
        reads = f"it reads {', '.join(task.settings)}" if task.settings else "it takes no settings"
        reject_unused(self, unused, f"by task kind {self.kind!r} ({reads})")
        get_task(self)  # a setting the task rejects fails here, with its key named
        return self


def get_task(config: TaskConfig | None = None) -> Task:
    """The task `config` names, with its settings (the built-in task when None)."""
    config = TaskConfig() if config is None else config
    task = TASKS[config.kind]
    return task(**{key: getattr(config, key) for key in task.settings})


__all__ = ["TASKS", "Task", "TaskConfig", "get_task"]
