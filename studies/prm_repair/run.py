"""PRM-guided repair (critique and refine) in a round, measured: the share of wrong samples
the process reward model finds and the model repairs.

    .venv/bin/python studies/prm_repair/run.py --out studies/prm_repair      # 3 seeds, ~10 min a seed
    .venv/bin/python studies/prm_repair/run.py --work /tmp/ewc-shift   # reuse ewc_shift's SFT models

For each seed, in a scratch project of its own (studies/scratch.py; this checkout is not
touched; a --work folder that studies/ewc_shift/run.py used keeps its SFT models):

1. the built-in task with no planted habit (`shortcut_rate: 0`), the default model and SFT
   on problems of 3-5 numbers (the real stages prepare, base, sft), every seed set to the
   seed's; the verifier and the process reward model (stages verifier and prm, params.yaml's
   settings: the likelihood PRM reading the verifier);
2. the real round stage (`python -m stages.improve fix5`, `refine: true`): SFT samples 4
   completions for each of 256 new problems of 5 numbers; every sample the answer check
   rejects goes to the repair, whose choices read the PRM alone (rlhf/inference/refine.py):
   the first step it scores below `prm_threshold` is the first error, the model samples
   `refine_attempts` continuations from the step before it, and the one whose weakest step
   the PRM scores best replaces the sample if every step passes. The answer key only
   measures: a repair is right or wrong, and only right ones join the round's data.

The round's report (models/rounds/fix5/round.json, `data.repair`) gives, of the wrong
samples: flagged (the PRM found a bad step), repaired right (`share_of_wrong_repaired`),
and the repairs the PRM approved that are still wrong (`false_repair_share`). Results:
--out/results.json, the table in --out/table.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from studies.scratch import edit_params, no_habit_sft, run_module, write_results  # noqa: E402

ROUND = {"after": "sft", "operands": [5, 5], "prompts": 256, "samples": 4, "refine": True, "suites": ["dev"]}
COLUMNS = (  # (column, key of the repair report)
    ("wrong samples", "wrong_samples"), ("flagged by the PRM", "wrong_flagged"),
    ("repaired right", "wrong_repaired"), ("share of wrong samples repaired", "share_of_wrong_repaired"),
    ("repairs still wrong", "false_repairs"), ("share of repairs still wrong", "false_repair_share"),
)  # fmt: skip


def run_seed(work: Path, seed: int) -> dict:
    env = no_habit_sft(work, seed)
    edit_params(work, lambda params: params["improve"].update(rounds={"fix5": ROUND}))
    if not (work / "models/prm").is_dir():
        run_module(env, "rlhf.cli.launch", "stages.verifier")
        run_module(env, "stages.prm")
    if not (work / "models/rounds/fix5/round.json").is_file():
        print(run_module(env, "stages.improve", "fix5").strip().splitlines()[-1][:300], flush=True)
    report = json.loads((work / "models/rounds/fix5/round.json").read_text())
    return {"round": report["data"]}


def cell(values: list) -> str:
    if all(isinstance(v, int) for v in values):
        return " / ".join(str(v) for v in values)
    text = " / ".join(f"{v:.2f}" for v in values)
    return f"{text} ({statistics.mean(values):.2f} ± {statistics.stdev(values):.2f})" if len(values) > 1 else text


def table(results: dict) -> str:
    seeds = list(results["seeds"])
    repairs = [results["seeds"][s]["round"]["repair"] for s in seeds]
    lines = [f"| seeds {' / '.join(seeds)} | " + " | ".join(name for name, _ in COLUMNS) + " |"]
    lines.append("|---|" + "---|" * len(COLUMNS))
    lines.append("| fix5 | " + " | ".join(cell([r[key] for r in repairs]) for _, key in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "studies/prm_repair")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (a project per seed under it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    out = args.out.resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="prm-repair-"))).resolve()
    results = {"round": ROUND, "seeds": {str(seed): run_seed(work / f"seed{seed}", seed) for seed in args.seeds}}
    write_results(out, results, table(results))


if __name__ == "__main__":
    main()
