"""PRM-guided repair (critique and refine) in a round, measured: the share of wrong samples
the process reward model finds and the model repairs; a params sweep over seeds, run
through DVC's experiment queue (studies/sweep.py).

    .venv/bin/python studies/prm_repair/run.py                    # 3 seeds, two at a time
    .venv/bin/python studies/prm_repair/run.py --seeds 0 --jobs 1

The study makes a scratch DVC project (`--work`; a temporary folder by default): this
checkout's code, dvc.yaml and params.yaml with no planted habit (`shortcut_rate: 0`) and one
round, `fix5`, in `improve.rounds`, committed to a git repository of its own. Each seed is
one queued experiment, a params change and nothing else:

    dvc exp run --queue --name seed0 -S ++base.seed=0 -S ++sft.seed=0 \
        -S ++improve.defaults.seed=0 -S ++improve.defaults.train.seed=0 improve@fix5

`improve@fix5` pulls in what dvc.yaml says it needs: check_params, prepare, base, sft (on
problems of 3-5 numbers), the verifier and the process reward model (params.yaml's
settings: the likelihood PRM reading the verifier). The round (`refine: true`) has SFT
sample 4 completions for each of 256 new problems of 5 numbers; every sample the answer
check rejects goes to the repair, whose choices read the PRM alone
(rlhf/inference/refine.py): the first step it scores below `prm_threshold` is the first
error, the model samples `refine_attempts` continuations from the step before it, and the
one whose weakest step the PRM scores best replaces the sample if every step passes. The
answer key only measures: a repair is right or wrong, and only right ones join the round's
data.

The round's metrics (reports/rounds/fix5.json, `repair`, read back with `dvc exp show
--json`) give, of the wrong samples: flagged (the PRM found a bad step), repaired right
(`share_of_wrong_repaired`), and the repairs the PRM approved that are still wrong
(`false_repair_share`). Results: --out/results.json, the table in --out/table.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from studies import sweep  # noqa: E402

ROUND = {"after": "sft", "operands": [5, 5], "prompts": 256, "samples": 4, "refine": True, "suites": ["dev"]}
METRICS = "reports/rounds/fix5.json"
COLUMNS = (  # (column, key of the repair report)
    ("wrong samples", "wrong_samples"), ("flagged by the PRM", "wrong_flagged"),
    ("repaired right", "wrong_repaired"), ("share of wrong samples repaired", "share_of_wrong_repaired"),
    ("repairs still wrong", "false_repairs"), ("share of repairs still wrong", "false_repair_share"),
)  # fmt: skip


def cell(values: list) -> str:
    if all(isinstance(v, int) for v in values):
        return " / ".join(str(v) for v in values)
    text = " / ".join(f"{v:.2f}" for v in values)
    return f"{text} ({statistics.mean(values):.2f} ± {statistics.stdev(values):.2f})" if len(values) > 1 else text


def table(results: dict) -> str:
    seeds = list(results["seeds"])
    repairs = [results["seeds"][s]["repair"] for s in seeds]
    lines = [f"| seeds {' / '.join(seeds)} | " + " | ".join(name for name, _ in COLUMNS) + " |"]
    lines.append("|---|" + "---|" * len(COLUMNS))
    lines.append("| fix5 | " + " | ".join(cell([r[key] for r in repairs]) for _, key in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="experiments at once (each with 2 / jobs threads)")
    parser.add_argument("--work", type=Path, help="the scratch DVC project's folder (kept; default: temporary)")
    parser.add_argument("--out", type=Path, default=ROOT / "studies/prm_repair")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="prm-repair-"))
    root = sweep.round_project(work, "prm_repair", "fix5", ROUND)
    env = sweep.environment(max(1, 2 // args.jobs))
    print(f"scratch DVC project: {root}", flush=True)
    experiments = {f"seed{seed}": (sweep.round_overrides(seed), "improve@fix5") for seed in args.seeds}
    finished, minutes, failed = sweep.sweep(root, env, experiments, args.jobs)
    seeds = {str(seed): finished.get(f"seed{seed}") for seed in args.seeds}
    results = {
        "round": ROUND,
        "seeds": {seed: {"repair": run["metrics"][METRICS]["repair"]} for seed, run in seeds.items() if run},
    }
    sweep.conclude(
        args.out, results, table(results), len(finished), minutes, args.jobs, failed, None if args.work else work
    )


if __name__ == "__main__":
    main()
