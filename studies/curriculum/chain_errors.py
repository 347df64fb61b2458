"""How the built-in task's chains go right and wrong, by length: a model's greedy
completions on an eval suite, each sorted into one of

* right, in the problem's order (what the step check accepts);
* right, in another order (sums commute: the answer check accepts it, the step check not);
* wrong, a number skipped or used twice (the chain lost its place in the problem);
* wrong, every number once (an arithmetic slip, or a wrong answer line).

    .venv/bin/python studies/curriculum/chain_errors.py --work W --model models/rounds_answer/r3

W is a scratch project of studies/curriculum/run.py (its data/prepared/eval and its models).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KINDS = ("right, in order", "right, another order", "wrong, skipped or repeated", "wrong, every number once")


def kind(prompt: str, answer: str, completion: str) -> str:
    from rlhf.tasks.arithmetic import STEP_PARSE_RE, is_correct, parse_prompt, split_steps

    problem = parse_prompt(prompt)
    expected = list(zip(problem.ops, problem.operands[1:]))
    used = [(m[2], int(m[3])) for m in (STEP_PARSE_RE.match(s) for s in split_steps(completion)) if m]
    if is_correct(completion, answer):
        return KINDS[0] if used == expected else KINDS[1]
    return KINDS[3] if sorted(used) == sorted(expected) else KINDS[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--model", required=True, help="a model folder, relative to --work")
    parser.add_argument("--suite", default="dev_long")
    args = parser.parse_args()
    import pandas as pd

    from rlhf.models.generation import generate
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    os.chdir(args.work)
    suite = pd.read_parquet(Path("data/prepared/eval") / f"{args.suite}.parquet")
    model = load_causal_lm(Path(args.model), what=args.model)
    completions = generate(model, load_tokenizer(Path(args.model)), list(suite["prompt"]), 128, 128)
    counts = Counter(
        (d, kind(p, a, c)) for p, a, d, c in zip(suite["prompt"], suite["answer"], suite["difficulty"], completions)
    )
    print(f"| {args.suite}: numbers | problems | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 2) + "|")
    for d in sorted(set(suite["difficulty"]), key=int):
        total = sum(counts[(d, k)] for k in KINDS)
        print(f"| {d} | {total} | " + " | ".join(str(counts[(d, k)]) for k in KINDS) + " |")


if __name__ == "__main__":
    main()
