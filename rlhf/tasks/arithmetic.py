"""The built-in verifiable task: multi-step arithmetic written out as steps.

A problem is a chain of additions and subtractions, e.g. ``23+58-17``; its solution states
every intermediate result and then the answer::

    23+58=81; 81-17=64; answer 64

Answers can be checked exactly, and so can every step, which is what lets one seeded
generator emit every data contract the pipeline needs: SFT demonstrations, preference pairs
(a correct solution against a flawed one), unpaired desirable/undesirable samples for KTO,
per-step labels for the process reward model, prompts with answers for GRPO/PPO, and
held-out evaluation suites that share no problem with the training data.

Flaws are the mistakes a small model actually makes: an arithmetic slip in one step carried
forward, a step that starts from the wrong number, a skipped operation, or a final answer that
does not match the last step. Difficulty is set by the number of operands and the size of
the numbers (`TaskSpec`).

Like human demonstrations, the SFT data does not always show its working: on short problems
(at most `shortcut_max_operands` numbers) a share `shortcut_rate` of the demonstrations
state the answer alone (``answer 64``). The SFT model learns that habit, and answering in
one go is much less reliable for it than working step by step: the room the policy stage has
to find and take (a reward for the right answer favours the written-out solution). Every
other split (preference pairs, KTO, PRM) holds written-out solutions only.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace

from rlhf.tasks.base import Task

STEP_SEPARATOR = "; "
PROMPT_END = "\n"
ANSWER_PREFIX = "answer "

_ANSWER_RE = re.compile(r"answer (-?\d+)")
_ANSWER_TEXT_RE = re.compile(r"answer[:\s]+(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_INT_RE = re.compile(r"^-?\d+$")
_STEP_RE = r"\d+[+-]\d+=-?\d+"
_FORMAT_RE = re.compile(rf"^({_STEP_RE}; )*answer -?\d+$")
_PROMPT_RE = re.compile(r"\d+(?:\s*[+-]\s*\d+)+")
STEP_PARSE_RE = re.compile(r"^(-?\d+)([+-])(\d+)=(-?\d+)$")

FLAW_KINDS = ("slip", "copy", "skip", "answer")
# Flaws that keep the number of steps: preference and KTO data use only these, so that a
# preference optimiser cannot learn "longer is better" from pairs whose rejected side
# skipped a step (DPO exploits exactly that length signal).
SAME_LENGTH_FLAWS = ("slip", "copy", "answer")


@dataclass(frozen=True)
class TaskSpec:
    """How hard the generated problems are, and how often SFT demonstrations of short
    problems skip the working (see the module docstring)."""

    min_operands: int = 3
    max_operands: int = 5
    max_value: int = 29
    shortcut_rate: float = 0.75
    shortcut_max_operands: int = 3
    # Extra held-out suites of longer problems ([fewest, most] numbers), for length
    # generalisation: `eval_dev_long` and `eval_test_long`. No training split has them.
    long_operands: tuple[int, int] | None = None


@dataclass(frozen=True)
class Problem:
    operands: tuple[int, ...]
    ops: tuple[str, ...]  # one of "+"/"-" between consecutive operands

    @property
    def expression(self) -> str:
        text = str(self.operands[0])
        for op, value in zip(self.ops, self.operands[1:]):
            text += f"{op}{value}"
        return text

    @property
    def prompt(self) -> str:
        # The newline marks where the problem ends and the solution begins: prompt and
        # completion are concatenated as they are by TRL's trainers.
        return self.expression + PROMPT_END

    def steps(self) -> list[str]:
        """The correct steps, without the final answer line."""
        return _steps_from(self.operands[0], list(zip(self.ops, self.operands[1:])))

    @property
    def answer(self) -> int:
        return _apply_all(self.operands[0], list(zip(self.ops, self.operands[1:])))

    def solution(self) -> str:
        return format_solution(self.steps(), self.answer)

    def shortcut_solution(self) -> str:
        """The answer alone, without the working."""
        return format_solution([], self.answer)


def _apply(left: int, op: str, right: int) -> int:
    return left + right if op == "+" else left - right


def _apply_all(start: int, pairs: list[tuple[str, int]]) -> int:
    value = start
    for op, right in pairs:
        value = _apply(value, op, right)
    return value


def _steps_from(start: int, pairs: list[tuple[str, int]]) -> list[str]:
    steps, value = [], start
    for op, right in pairs:
        result = _apply(value, op, right)
        steps.append(f"{value}{op}{right}={result}")
        value = result
    return steps


def format_solution(steps: list[str], answer: int) -> str:
    return STEP_SEPARATOR.join([*steps, f"{ANSWER_PREFIX}{answer}"])


def sample_problem(rng: random.Random, spec: TaskSpec) -> Problem:
    """A random chain whose running value never goes negative (so every step is a plain
    non-negative result, as in the curriculum of grade-school arithmetic)."""
    n = rng.randint(spec.min_operands, spec.max_operands)
    value = rng.randint(1, spec.max_value)
    operands, ops = [value], []
    for _ in range(n - 1):
        right = rng.randint(1, spec.max_value)
        op = rng.choice("+-") if value >= right else "+"
        value = _apply(value, op, right)
        operands.append(right)
        ops.append(op)
    return Problem(tuple(operands), tuple(ops))


def flawed_solution(
    problem: Problem,
    rng: random.Random,
    kind: str | None = None,
    kinds: tuple[str, ...] = FLAW_KINDS,
    last_step: bool = False,
) -> tuple[str, list[bool]]:
    """A wrong solution of `problem` and the correctness label of each of its steps.

    Labels follow Math-Shepherd: a step is good while the chain is still on the way to the
    right answer; the first wrong step and everything after it are bad. The final
    ``answer N`` line counts as a step.

    A mistake is carried forward: the steps after it continue from the wrong number. With
    `last_step` the mistake is in the last operation, so the flawed solution differs from the
    correct one in its last step and answer only. Preference pairs use that form: sequence-
    level DPO pushes down every token of the rejected text, and after an early mistake those
    tokens are correct arithmetic on the wrong number, which DPO would then unlearn.
    """
    kind = kind or rng.choice(kinds)
    pairs = list(zip(problem.ops, problem.operands[1:]))
    good_steps = problem.steps()
    at = rng.randrange(len(pairs))
    if last_step:
        at = len(pairs) - 1
    if kind == "slip":
        # One step's result is off by a small amount; later steps carry it forward correctly.
        prefix = good_steps[:at]
        left = _apply_all(problem.operands[0], pairs[:at])
        op, right = pairs[at]
        wrong = _apply(left, op, right) + rng.choice([-10, -2, -1, 1, 2, 10])
        steps = [*prefix, f"{left}{op}{right}={wrong}", *_steps_from(wrong, pairs[at + 1 :])]
        answer = _apply_all(wrong, pairs[at + 1 :])
        labels = [True] * at + [False] * (len(steps) - at) + [False]
    elif kind == "copy":
        # A step starts from a number that is not the previous result.
        prefix = good_steps[:at]
        left = _apply_all(problem.operands[0], pairs[:at])
        wrong_left = left + rng.choice([-10, -1, 1, 10])
        if wrong_left == left or wrong_left < 0:
            wrong_left = left + 1
        steps = [*prefix, *_steps_from(wrong_left, pairs[at:])]
        answer = _apply_all(wrong_left, pairs[at:])
        labels = [True] * at + [False] * (len(steps) - at) + [False]
    elif kind == "skip":
        # One operation is dropped; the arithmetic of the remaining steps is right. Dropping
        # any one of a run of identical operations (`+3+3`) gives the same chain, whose first
        # wrong step is after the run: drop the run's last one so that step `at` is wrong.
        while at + 1 < len(pairs) and pairs[at + 1] == pairs[at]:
            at += 1
        kept = pairs[:at] + pairs[at + 1 :]
        steps = _steps_from(problem.operands[0], kept)
        answer = _apply_all(problem.operands[0], kept)
        labels = [True] * at + [False] * (len(steps) - at) + [False]
    elif kind == "answer":
        # Every step right, the stated answer is not the last result.
        steps = good_steps
        answer = problem.answer + rng.choice([-10, -1, 1, 10])
        labels = [True] * len(steps) + [False]
    else:
        raise ValueError(f"unknown flaw kind {kind!r}; expected one of {FLAW_KINDS}")
    if answer == problem.answer:
        # A skipped `+x-x` pair or a slip that cancels can land on the right answer;
        # such a solution is not a clean negative, so fall back to a wrong final answer.
        return flawed_solution(problem, rng, "answer")
    return format_solution(steps, answer), labels


# ----------------------------------------------------------------------------- checking


def extract_answer(completion: str) -> int | None:
    """The integer after the first ``answer``, or None when there is none."""
    match = _ANSWER_RE.search(completion)
    return int(match.group(1)) if match else None


def is_correct(completion: str, answer: int | str) -> bool:
    """Exact answer check: the number after ``answer`` equals `answer`. For a non-numeric
    reference answer (user suites), the text after ``answer`` (or the last line) must
    equal it, ignoring case and surrounding space."""
    reference = str(answer).strip()
    if _INT_RE.match(reference):
        predicted = extract_answer(completion)
        return predicted is not None and predicted == int(reference)
    match = _ANSWER_TEXT_RE.search(completion)
    stated = match.group(1) if match else (completion.strip().splitlines() or [""])[-1]
    return stated.strip().lower() == reference.lower()


def is_well_formatted(completion: str) -> bool:
    """Steps ``a+b=c`` separated by ``; `` and a final ``answer N`` — nothing else."""
    return bool(_FORMAT_RE.match(completion.strip()))


def split_steps(completion: str) -> list[str]:
    """The steps of a solution, the final answer line included."""
    return [part for part in completion.strip().split(STEP_SEPARATOR) if part]


def check_steps(prompt: str, completion: str) -> list[bool]:
    """Math-Shepherd labels for each step of `completion` against the problem in `prompt`:
    a step is good when its arithmetic is right, it continues from the previous result, it
    applies the next operation of the problem, and every earlier step was good. An answer
    with no steps before it (a shortcut) is good when it is the right answer."""
    problem = parse_prompt(prompt)
    pairs = list(zip(problem.ops, problem.operands[1:]))
    labels, value, ok = [], problem.operands[0], True
    steps = split_steps(completion)
    for index, step in enumerate(steps):
        if step.startswith(ANSWER_PREFIX):
            if index == 0:  # the answer alone (a shortcut): good when it is the answer
                ok = step == f"{ANSWER_PREFIX}{problem.answer}"
            else:
                ok = ok and index == len(pairs) and step == f"{ANSWER_PREFIX}{value}"
            labels.append(ok)
            continue
        match = STEP_PARSE_RE.match(step)
        if not ok or match is None or index >= len(pairs):
            ok = False
        else:
            left, op, right, result = int(match[1]), match[2], int(match[3]), int(match[4])
            expected = _apply(value, *pairs[index])
            ok = (left, op, right) == (value, *pairs[index]) and result == expected
            value = expected
        labels.append(ok)
    return labels


def parse_prompt(prompt: str) -> Problem:
    if not _PROMPT_RE.fullmatch(prompt.strip()):
        raise ValueError(f"not a built-in task prompt: {prompt!r}")
    tokens = re.findall(r"\d+|[+-]", prompt)
    operands = tuple(int(t) for t in tokens[0::2])
    ops = tuple(tokens[1::2])
    return Problem(operands, ops)


class ArithmeticTask(Task):
    """The built-in task behind the `Task` interface: steps ``a+b=c`` joined by ``; ``, a
    final ``answer N``, exact integer answers, and step labels checked exactly."""

    name = "builtin"
    step_separator = STEP_SEPARATOR
    has_format = True

    def normalize_prompt(self, prompt: str) -> str:
        return prompt if prompt.endswith(PROMPT_END) else prompt + PROMPT_END

    def extract_answer(self, completion: str) -> str | None:
        value = extract_answer(completion)
        return None if value is None else str(value)

    def is_correct(self, completion: str, answer) -> bool:
        return is_correct(completion, answer)

    def is_well_formatted(self, completion: str) -> bool:
        return is_well_formatted(completion)

    def split_steps(self, completion: str) -> list[str]:
        return split_steps(completion)

    def is_final_step(self, step: str) -> bool:
        return step.strip().startswith(ANSWER_PREFIX.strip())

    checks_steps = True

    def check_steps(self, prompt: str, completion: str) -> list[bool] | None:
        try:
            return check_steps(prompt, completion)
        except ValueError:  # not a built-in prompt (a user suite under the built-in task)
            return None

    def classify_error(self, prompt: str, completion: str) -> str | None:
        try:
            return classify_flaw(prompt, completion)
        except ValueError:
            return None


def operand_count(prompt: str) -> int:
    """The difficulty of a built-in problem: how many numbers it chains."""
    return len(parse_prompt(prompt).operands)


# ----------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class TaskSizes:
    """How many rows of each data contract the generator writes."""

    sft: int = 20000
    prefs: int = 4000
    prefs_eval: int = 500
    unpaired: int = 4000
    prm: int = 4000
    prm_eval: int = 500
    prompts: int = 2000
    eval_dev: int = 500
    eval_test: int = 500
    eval_dev_long: int = 300  # with TaskSpec.long_operands only
    eval_test_long: int = 300


def generate_datasets(spec: TaskSpec, sizes: TaskSizes, seed: int) -> dict[str, list[dict]]:
    """Every data contract of the built-in task, as rows keyed by contract file name.

    Evaluation problems are drawn first and every training split excludes them, so the
    held-out numbers measure generalisation, not recall. There are two disjoint eval
    suites: `eval_dev` for tuning, the gate and the greedy soup, and `eval_test`, which
    only reports. Eval rows carry their `difficulty`: the number of operands.
    """
    rng = random.Random(seed)
    seen: set[str] = set()

    def fresh_problems(count: int, spec: TaskSpec = spec) -> list[Problem]:
        problems: list[Problem] = []
        attempts = 0
        while len(problems) < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise ValueError(
                    f"the task spec {spec} has too few distinct problems for {count} more rows; "
                    "raise prepare.builtin.max_value or max_operands, or ask for fewer rows"
                )
            problem = sample_problem(rng, spec)
            if problem.prompt not in seen:
                seen.add(problem.prompt)
                problems.append(problem)
        return problems

    def prompt_rows(problems: list[Problem]) -> list[dict]:
        return [{"prompt": p.prompt, "answer": str(p.answer)} for p in problems]

    def eval_rows(problems: list[Problem]) -> list[dict]:
        return [{**row, "difficulty": str(len(p.operands))} for row, p in zip(prompt_rows(problems), problems)]

    def pair_rows(problems: list[Problem]) -> list[dict]:
        return [
            {
                "prompt": p.prompt,
                "chosen": p.solution(),
                "rejected": flawed_solution(p, rng, kinds=SAME_LENGTH_FLAWS, last_step=True)[0],
            }
            for p in problems
        ]

    def prm_rows(problems: list[Problem]) -> list[dict]:
        rows = []
        for p in problems:
            # Half correct, half flawed, so the step labels are not all one class.
            if rng.random() < 0.5:
                text, labels = p.solution(), [True] * (len(p.steps()) + 1)
            else:
                text, labels = flawed_solution(p, rng)
            rows.append({"prompt": p.prompt, "completions": split_steps(text), "labels": labels})
        return rows

    # Held-out suites first, so no training split can contain them.
    eval_dev = eval_rows(fresh_problems(sizes.eval_dev))
    eval_test = eval_rows(fresh_problems(sizes.eval_test))
    prefs_eval = pair_rows(fresh_problems(sizes.prefs_eval))
    prm_eval = prm_rows(fresh_problems(sizes.prm_eval))

    def demonstration(p: Problem) -> str:
        short = len(p.operands) <= spec.shortcut_max_operands
        return p.shortcut_solution() if short and rng.random() < spec.shortcut_rate else p.solution()

    sft = [{"prompt": p.prompt, "completion": demonstration(p)} for p in fresh_problems(sizes.sft)]
    prefs = pair_rows(fresh_problems(sizes.prefs))
    unpaired = []
    for p in fresh_problems(sizes.unpaired):
        good = rng.random() < 0.5
        text = p.solution() if good else flawed_solution(p, rng, kinds=SAME_LENGTH_FLAWS, last_step=True)[0]
        unpaired.append({"prompt": p.prompt, "completion": text, "label": good})
    prm = prm_rows(fresh_problems(sizes.prm))
    prompts = prompt_rows(fresh_problems(sizes.prompts))
    long = {}
    if spec.long_operands:
        # Drawn last, so that turning them on leaves every other table as it was; they are
        # longer than any training problem, so none can be in a training split.
        low, high = spec.long_operands
        long_spec = replace(spec, min_operands=low, max_operands=high)
        long["eval_dev_long"] = eval_rows(fresh_problems(sizes.eval_dev_long, long_spec))
        long["eval_test_long"] = eval_rows(fresh_problems(sizes.eval_test_long, long_spec))
    return {
        "sft": sft,
        "prefs": prefs,
        "prefs_eval": prefs_eval,
        "unpaired": unpaired,
        "prm": prm,
        "prm_eval": prm_eval,
        "prompts": prompts,
        "eval_dev": eval_dev,
        "eval_test": eval_test,
        **long,
    }


def classify_flaw(prompt: str, completion: str) -> str | None:
    """Which FLAW_KINDS a wrong built-in solution shows (None when it is correct):
    a missing step, a wrong final answer after right steps, a step that starts from the
    wrong number, or an arithmetic slip."""
    problem = parse_prompt(prompt)
    labels = check_steps(prompt, completion)
    if all(labels):
        return None
    steps = split_steps(completion)
    if len(steps) == 1 and steps[0].startswith(ANSWER_PREFIX):  # a wrong answer alone
        return "answer"
    if len(steps) != len(problem.ops) + 1:
        return "skip"
    first_bad = labels.index(False)
    if first_bad == len(steps) - 1:
        return "answer"
    match = STEP_PARSE_RE.match(steps[first_bad])
    expected_left = _apply_all(problem.operands[0], list(zip(problem.ops, problem.operands[1:]))[:first_bad])
    return "copy" if match is None or int(match[1]) != expected_left else "slip"
