"""The built-in word problems: grade-school problems in sentences, solved GSM8K-style.

A problem is a short story with a question; its solution writes one computation a line and
ends with GSM8K's answer line, so the `gsm8k` task reads and checks it::

    Maya has 34 stickers. She buys 27 more. How many stickers does she have now?

    34 + 27 = 61
    #### 61

It is the real-model counterpart of the arithmetic chains (rlhf.tasks.arithmetic): a
pretrained instruct model reads English, so the problems are English, and what it must
learn is to work them out step by step and state the answer where it can be checked. One
seeded generator yields every data contract the arithmetic task does (SFT demonstrations,
preference pairs, unpaired samples, per-step labels, prompts with answers) and the eval
suites, whose `difficulty` column is the problem's family:

* training families (in every table): `add`, `subtract`, `multiply`, `divide` (one step),
  `two_step` (a product added to or taken from a count), `three_step` (a product, a count
  added, a count taken away);
* a held-out family, `change` (two purchases at unit prices, paid with a bill: four
  steps, and a situation no training problem describes), only in the suite `test_unseen`.

Each family has several phrasings, and names and objects are drawn from lists, so a
model cannot pass by recalling a sentence. Solutions are kept short (a line per
computation, no prose): on a CPU, generation dominates the pipeline's time.

Flaws, for the preference pairs, the unpaired rows and the step labels, are the slips a
small model makes: a result off by a little (carried forward), the wrong operation, and a
final answer that is not the last result. Step labels follow Math-Shepherd (the first
wrong step and every step after it are bad; the `####` line is a step).

Our own because no maintained generator of GSM8K-style problems with step labels and
flawed solutions exists as a library; GSM8K itself cannot be downloaded here (and a user
with it uses `prepare.source: files`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from rlhf.tasks.gsm8k import MARKER
from rlhf.tasks.long_context import short_context, with_context

STEP_SEPARATOR = "\n"
TRAIN_FAMILIES = ("add", "subtract", "multiply", "divide", "two_step", "three_step")
HELDOUT_FAMILIES = ("change",)
FLAW_KINDS = ("slip", "operation", "answer")
# The eval suites the generator writes, and the families (their `difficulty` labels) of each.
SUITE_FAMILIES = {"dev": TRAIN_FAMILIES, "test": TRAIN_FAMILIES, "test_unseen": HELDOUT_FAMILIES}

from rlhf.tasks.story_words import CONTAINERS, GOODS, NAMES, THINGS  # noqa: E402  (re-exported)


@dataclass(frozen=True)
class Step:
    left: int
    op: str  # + - * /
    right: int
    # The earlier steps whose results `left` and `right` are (None: a number of the question).
    sources: tuple[int | None, int | None] = (None, None)

    @property
    def result(self) -> int:
        return apply(self.left, self.op, self.right)

    def text(self, result: int | None = None) -> str:
        return f"{self.left} {self.op} {self.right} = {self.result if result is None else result}"


@dataclass(frozen=True)
class WordProblem:
    family: str
    question: str
    steps: tuple[Step, ...] = field(repr=False)

    @property
    def answer(self) -> int:
        return self.steps[-1].result

    @property
    def prompt(self) -> str:
        return self.question

    def solution(self) -> str:
        return format_solution([s.text() for s in self.steps], self.answer)


def apply(left: int, op: str, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    return left // right


def format_solution(lines: list[str], answer: int) -> str:
    return STEP_SEPARATOR.join([*lines, f"{MARKER} {answer}"])


def split_steps(solution: str) -> list[str]:
    return [line for line in solution.split(STEP_SEPARATOR) if line.strip()]


# ----------------------------------------------------------------------------- families
# Each takes the generator and returns a problem; phrasings are picked at random.


def _people(rng: random.Random, count: int) -> list[str]:
    return rng.sample(NAMES, count)


def _add(rng: random.Random) -> WordProblem:
    name, (things, _) = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(10, 89), rng.randint(10, 89)
    question = rng.choice((
        f"{name} has {a} {things}. {name} gets {b} more. How many {things} does {name} have now?",
        f"There are {a} {things} on the table and {b} {things} on the floor. How many {things} are there in all?",
        f"{name} collected {a} {things} on Monday and {b} {things} on Tuesday. How many {things} did {name} "
        "collect in the two days?",
    ))  # fmt: skip
    return WordProblem("add", question, (Step(a, "+", b),))


def _subtract(rng: random.Random) -> WordProblem:
    (name, other), (things, _) = _people(rng, 2), rng.choice(THINGS)
    a = rng.randint(30, 99)
    b = rng.randint(10, a - 10)
    question = rng.choice((
        f"{name} had {a} {things}. {name} gave {b} of them to {other}. How many {things} does {name} have left?",
        f"A shop had {a} {things}. It sold {b} of them. How many {things} are left in the shop?",
        f"{name} has {a} {things} and {other} has {b}. How many more {things} does {name} have than {other}?",
    ))  # fmt: skip
    return WordProblem("subtract", question, (Step(a, "-", b),))


def _multiply(rng: random.Random) -> WordProblem:
    name, (things, box) = rng.choice(NAMES), rng.choice(THINGS)
    boxes = CONTAINERS[box]
    a, b = rng.randint(3, 9), rng.randint(4, 12)
    question = rng.choice((
        f"There are {a} {boxes} with {b} {things} in each {box}. How many {things} are there in all?",
        f"{name} buys {a} {boxes} of {things}. Each {box} holds {b} {things}. How many {things} does {name} buy?",
        f"{name} puts {b} {things} in each of {a} {boxes}. How many {things} does {name} use?",
    ))  # fmt: skip
    return WordProblem("multiply", question, (Step(a, "*", b),))


def _divide(rng: random.Random) -> WordProblem:
    name, (things, box) = rng.choice(NAMES), rng.choice(THINGS)
    boxes = CONTAINERS[box]
    groups, each = rng.randint(2, 9), rng.randint(3, 12)
    total = groups * each
    question = rng.choice((
        f"{name} shares {total} {things} equally among {groups} friends. How many {things} does each friend get?",
        f"{name} packs {total} {things} into {groups} {boxes} with the same number in each. How many {things} "
        f"go in each {box}?",
        f"{total} {things} are split into {groups} equal groups. How many {things} are in each group?",
    ))  # fmt: skip
    return WordProblem("divide", question, (Step(total, "/", groups),))


def _two_step(rng: random.Random) -> WordProblem:
    name, (things, box) = rng.choice(NAMES), rng.choice(THINGS)
    boxes = CONTAINERS[box]
    count, per = rng.randint(3, 8), rng.randint(4, 12)
    product = count * per
    if rng.random() < 0.5:
        start = rng.randint(10, 60)
        question = rng.choice((
            f"{name} has {start} {things}. {name} buys {count} {boxes} with {per} {things} in each. How many "
            f"{things} does {name} have now?",
            f"A class has {start} {things}. The teacher brings {count} more {boxes} of {per} {things} each. How "
            f"many {things} does the class have?",
        ))  # fmt: skip
        steps = (Step(count, "*", per), Step(product, "+", start, (0, None)))
    else:
        taken = rng.randint(5, product - 5)
        question = rng.choice((
            f"{name} has {count} {boxes} with {per} {things} in each. {name} gives away {taken} {things}. How many "
            f"{things} does {name} have left?",
            f"A shop gets {count} {boxes} of {per} {things}. It sells {taken} {things}. How many {things} are left?",
        ))  # fmt: skip
        steps = (Step(count, "*", per), Step(product, "-", taken, (0, None)))
    return WordProblem("two_step", question, steps)


def _three_step(rng: random.Random) -> WordProblem:
    (name, other), (things, box) = _people(rng, 2), rng.choice(THINGS)
    boxes = CONTAINERS[box]
    count, per, more = rng.randint(2, 6), rng.randint(4, 12), rng.randint(5, 40)
    total = count * per + more
    taken = rng.randint(3, total - 3)
    question = rng.choice((
        f"{name} has {count} {boxes} of {per} {things} and {more} loose {things}. {name} gives {taken} {things} to "
        f"{other}. How many {things} does {name} have left?",
        f"A store gets {count} {boxes} with {per} {things} each, and {more} more {things} arrive later. It sells "
        f"{taken} {things}. How many {things} does the store have now?",
        f"{name} buys {count} {boxes} of {things} with {per} in each {box}, then finds {more} more {things}. "
        f"{name} loses {taken} of them. How many {things} does {name} have?",
    ))  # fmt: skip
    steps = (Step(count, "*", per), Step(count * per, "+", more, (0, None)), Step(total, "-", taken, (1, None)))
    return WordProblem("three_step", question, steps)


def _change(rng: random.Random) -> WordProblem:
    name = rng.choice(NAMES)
    first, second = rng.sample(GOODS, 2)
    a, price_a, b, price_b = rng.randint(2, 5), rng.randint(2, 9), rng.randint(2, 5), rng.randint(2, 9)
    cost = a * price_a + b * price_b
    bill = next(value for value in (20, 50, 100) if value > cost)
    question = rng.choice((
        f"{name} buys {a} {first} at {price_a} dollars each and {b} {second} at {price_b} dollars each, and pays "
        f"with a {bill} dollar bill. How much change does {name} get?",
        f"{first.capitalize()} cost {price_a} dollars each and {second} cost {price_b} dollars each. {name} buys "
        f"{a} {first} and {b} {second} and pays with {bill} dollars. How many dollars of change does {name} get "
        "back?",
    ))  # fmt: skip
    steps = (
        Step(a, "*", price_a), Step(b, "*", price_b), Step(a * price_a, "+", b * price_b, (0, 1)),
        Step(bill, "-", cost, (None, 2)),
    )  # fmt: skip
    return WordProblem("change", question, steps)


FAMILIES = {
    "add": _add,
    "subtract": _subtract,
    "multiply": _multiply,
    "divide": _divide,
    "two_step": _two_step,
    "three_step": _three_step,
    "change": _change,
}


def sample_problem(rng: random.Random, families: tuple[str, ...] = TRAIN_FAMILIES) -> WordProblem:
    return FAMILIES[rng.choice(families)](rng)


# ----------------------------------------------------------------------------- flaws


def flawed_solution(
    problem: WordProblem, rng: random.Random, kind: str | None = None, last_step: bool = False
) -> tuple[str, list[bool]]:
    """A wrong solution of `problem` and the Math-Shepherd label of each of its steps (the
    `####` line included). A wrong result is carried forward: later steps compute from it.
    With `last_step` the mistake is in the last computation or the answer line, so the
    flawed solution has the right one's length and differs only at its end (preference
    pairs: DPO pushes down every token of the rejected side, and right steps after an early
    mistake would be unlearnt)."""
    kind = kind or rng.choice(FLAW_KINDS)
    steps = problem.steps
    if kind == "answer":
        answer = problem.answer + rng.choice([-10, -2, -1, 1, 2, 10])
        labels = [True] * len(steps) + [False]
        return format_solution([s.text() for s in steps], answer), labels
    at = len(steps) - 1 if last_step else rng.randrange(len(steps))
    written: list[tuple[int, str, int, int]] = []  # (left, op, right, result) as the flawed solution writes them
    for index, step in enumerate(steps):
        left, right = (value if source is None else written[source][3]
                       for value, source in zip((step.left, step.right), step.sources))  # fmt: skip
        op = step.op
        if index == at and kind == "operation":
            op = {"+": "-", "-": "+", "*": "+", "/": "*"}[op]
        result = apply(left, op, right)
        if index == at and kind == "slip":
            result += rng.choice([-10, -2, -1, 1, 2, 10])
        written.append((left, op, right, result))
    answer = written[-1][3]
    if answer == problem.answer:  # a mistake that cancels out is no clean negative
        return flawed_solution(problem, rng, "answer")
    labels = [True] * at + [False] * (len(steps) - at) + [False]
    return format_solution([f"{a} {op} {b} = {c}" for a, op, b, c in written], answer), labels


# ----------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class WordProblemSizes:
    """How many rows of each data contract the generator writes (eval suites: problems)."""

    sft: int = 4000
    prefs: int = 1500
    prefs_eval: int = 200
    unpaired: int = 1000
    prm: int = 1000
    prm_eval: int = 200
    prompts: int = 1000
    eval_dev: int = 200
    eval_test: int = 300
    eval_test_unseen: int = 100
    compress: int = 2000  # long contexts only (`context_chars`): the context compressor's training rows


def generate_datasets(sizes: WordProblemSizes, seed: int, context_chars: int | None = None) -> dict[str, list[dict]]:
    """Every data contract of the word problems, as text rows keyed by contract file name.

    Evaluation problems are drawn first and no training table holds any of their questions.
    `eval_dev` (tuning, the gate) and `eval_test` (reported only) draw from the training
    families in equal shares; `eval_test_unseen` from the held-out family only. Eval rows
    carry their family as `difficulty`, so evaluate reports accuracy per family.

    With `context_chars` (rlhf.tasks.long_context) an eval row's facts sit in a `context`
    of at least that many characters, its `prompt` is the question alone and `relevant`
    holds the facts; training rows read the facts among a few distractors
    (`short_context`); and a `compress` table of long-context rows (context, prompt,
    completion) trains the context compressor.
    """
    rng = random.Random(seed)
    seen: set[str] = set()

    def fresh(count: int, families: tuple[str, ...] = TRAIN_FAMILIES, balanced: bool = False) -> list[WordProblem]:
        problems: list[WordProblem] = []
        attempts = 0
        while len(problems) < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise ValueError(f"too few distinct word problems for {count} more rows; ask for fewer")
            family = families[len(problems) % len(families)] if balanced else rng.choice(families)
            problem = FAMILIES[family](rng)
            if problem.question not in seen:
                seen.add(problem.question)
                problems.append(problem)
        return problems

    def prompt(problem: WordProblem) -> str:
        return problem.prompt if context_chars is None else short_context(problem.question, rng)

    def eval_rows(problems: list[WordProblem]) -> list[dict]:
        if context_chars is not None:
            return [
                {**with_context(p.question, rng, context_chars), "answer": str(p.answer), "difficulty": p.family}
                for p in problems
            ]
        return [{"prompt": p.prompt, "answer": str(p.answer), "difficulty": p.family} for p in problems]

    def pair_rows(problems: list[WordProblem]) -> list[dict]:
        return [
            {"prompt": prompt(p), "chosen": p.solution(), "rejected": flawed_solution(p, rng, last_step=True)[0]}
            for p in problems
        ]

    def prm_rows(problems: list[WordProblem]) -> list[dict]:
        rows = []
        for p in problems:
            if rng.random() < 0.5:  # half right, half flawed: both labels well represented
                text, labels = p.solution(), [True] * (len(p.steps) + 1)
            else:
                text, labels = flawed_solution(p, rng)
            rows.append({"prompt": prompt(p), "completions": split_steps(text), "labels": labels})
        return rows

    eval_dev = eval_rows(fresh(sizes.eval_dev, balanced=True))
    eval_test = eval_rows(fresh(sizes.eval_test, balanced=True))
    eval_unseen = eval_rows(fresh(sizes.eval_test_unseen, HELDOUT_FAMILIES))
    prefs_eval = pair_rows(fresh(sizes.prefs_eval))
    prm_eval = prm_rows(fresh(sizes.prm_eval))
    sft = [{"prompt": prompt(p), "completion": p.solution()} for p in fresh(sizes.sft)]
    prefs = pair_rows(fresh(sizes.prefs))
    unpaired = []
    for p in fresh(sizes.unpaired):
        good = rng.random() < 0.5
        text = p.solution() if good else flawed_solution(p, rng, last_step=True)[0]
        unpaired.append({"prompt": prompt(p), "completion": text, "label": good})
    prm = prm_rows(fresh(sizes.prm))
    prompts = [{"prompt": prompt(p), "answer": str(p.answer)} for p in fresh(sizes.prompts)]
    long_rows = {}
    if context_chars is not None:
        long_rows["compress"] = [
            {**with_context(p.question, rng, context_chars), "completion": p.solution()} for p in fresh(sizes.compress)
        ]
    return {
        **long_rows,
        "sft": sft,
        "prefs": prefs,
        "prefs_eval": prefs_eval,
        "unpaired": unpaired,
        "prm": prm,
        "prm_eval": prm_eval,
        "prompts": prompts,
        "eval_dev": eval_dev,
        "eval_test": eval_test,
        "eval_test_unseen": eval_unseen,
    }
