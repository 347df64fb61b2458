"""The task interface: what generic code may ask of a task.

A task is a small object with no state beyond its settings. Every method has a plain-text
default that suits a task with no structure (a completion is one step, any text is well
formed, nothing can be checked), so a new task overrides only what it knows.
"""

from __future__ import annotations

import re


class Task:
    """Reading and checking completions for one kind of problem."""

    name = "none"
    # Between the steps of a solution; the PRM and MCTS work step by step.
    step_separator = "\n"
    # Whether the task defines a well-formed completion (`is_well_formatted`); when not,
    # evaluate reports no format rate and the gate's default tests do not ask for one.
    has_format = False
    # Whether `is_correct` can check an answer; when not (task kind `none`), evaluate reports
    # accuracy as null and the gate skips its accuracy tests.
    checks_answers = True
    # Whether `check_steps` labels each step of a completion (a self-improvement round's
    # `steps` check needs it).
    checks_steps = False
    # The `TaskConfig` keys the task's constructor takes (get_task passes exactly these; any
    # other key set in params is an error for this kind).
    settings: tuple[str, ...] = ()

    def identity(self) -> dict:
        """The kind and its settings, as text: what decides how answers and steps are read
        (a checkpoint of a run whose rewards read them resumes only under the same)."""
        return {"kind": self.name, **{key: str(getattr(self, key, None)) for key in self.settings}}

    def normalize_prompt(self, prompt: str) -> str:
        """A prompt as the model was trained to see it (e.g. a trailing newline)."""
        return prompt

    def extract_answer(self, completion: str) -> str | None:
        """The final answer stated by `completion`, normalised for comparison and votes;
        None when it states none."""
        lines = [line for line in completion.strip().splitlines() if line.strip()]
        # Normalised as `is_correct` normalises the reference (case and runs of space).
        return normalize_text(lines[-1]) if lines else None

    def demonstration_answer(self, completion: str) -> str | None:
        """The reference answer a training demonstration states, as the task reads a
        reference (`reference_answer`, `is_correct`): stage prepare gives the prompts it
        derives from the SFT data these answers. By default the extracted answer; a task
        whose extraction falls back to guesses, or whose extracted form is not a reference
        it reads back, says otherwise."""
        return self.extract_answer(completion)

    def is_correct(self, completion: str, answer) -> bool:
        """Whether `completion` reaches the reference `answer`."""
        predicted = self.extract_answer(completion)
        return predicted is not None and predicted == self.reference_answer(answer)

    def reference_answer(self, answer) -> str:
        """The reference `answer` normalised as `extract_answer` normalises a completion's;
        ValueError when it cannot be one (e.g. not a number for a numeric task)."""
        return normalize_text(answer)

    def is_well_formatted(self, completion: str) -> bool:
        return True

    def split_steps(self, completion: str) -> list[str]:
        """The steps of a solution, the final answer included, each exactly as written (a
        leading space stays, and blank separators before a step, such as the empty line
        between two paragraphs, begin it: the prefix `prompt + steps` joined by
        `join_steps` must be the text the model wrote, for rollouts, MCTS and the PRM)."""
        steps: list[str] = []
        blank = ""
        for piece in completion.rstrip().split(self.step_separator):
            if not piece.strip():
                blank += piece + self.step_separator
                continue
            steps.append(blank + piece)
            blank = ""
        return steps

    def join_steps(self, steps: list[str]) -> str:
        return self.step_separator.join(steps)

    def is_final_step(self, step: str) -> bool:
        """Whether `step` ends a solution (MCTS stops expanding there)."""
        return False

    def check_steps(self, prompt: str, completion: str) -> list[bool] | None:
        """Exact good/bad labels of each step, for tasks that can check steps; else None."""
        return None

    def classify_error(self, prompt: str, completion: str) -> str | None:
        """A name for the kind of mistake a wrong completion makes (reports), or None."""
        return None


def normalize_text(value) -> str:
    return re.sub(r"\s+", " ", str(value)).strip().lower()
