"""Tasks: how a completion's answer is pulled out and checked, what a well-formed
completion looks like, and how a solution splits into steps.

Everything generic (evaluate, the verifiable rewards, the PRM's steps, MCTS, votes, the
gate's default tests) asks the task chosen in params (`task.kind`) through the `Task`
interface of `rlhf.tasks.base`; nothing outside this package knows a task's format. One
small module per task, picked by name from `TASKS`:

* `builtin` — the built-in arithmetic task (`rlhf.tasks.arithmetic`), which also generates
  the default pipeline's data.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf.params import StageConfig
from rlhf.tasks.arithmetic import ArithmeticTask
from rlhf.tasks.base import Task

TASKS: dict[str, type[Task]] = {"builtin": ArithmeticTask}


class TaskConfig(StageConfig):
    """params.yaml `task`: which task reads and checks the completions."""

    kind: Literal["builtin"] = Field("builtin", description="builtin (the arithmetic task)")


def get_task(config: TaskConfig | None = None) -> Task:
    """The task `config` names (the built-in task when None)."""
    return TASKS[(config or TaskConfig()).kind]()


__all__ = ["TASKS", "Task", "TaskConfig", "get_task"]
