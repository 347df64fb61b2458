"""The headline table (README, docs/results/policy-over-seeds.md): SFT, DPO, GRPO and PPO on
the built-in task, over seeds, with and without the planted shortcut habit, scored on the
test split only: a params sweep, run through DVC's experiment queue.

    .venv/bin/python studies/seed_spread/run.py                        # 3 seeds x 2 settings, two at a time
    .venv/bin/python studies/seed_spread/run.py --seeds 0 --settings habit --jobs 1

The study makes a scratch DVC project (`--work`; a temporary folder by default): this
checkout's code, dvc.yaml and params.yaml with `policy.offline: [dpo]` and `policy.online:
[grpo, ppo]`, committed to a git repository of its own, and one stage of the study's own
added to its dvc.yaml, `score`: this file with `--score`, which decodes the test suite
(data/prepared/eval/test.parquet, which nothing tuned on) greedily with each of models/sft,
models/policy/dpo, grpo and ppo and writes metrics/test_scores.json (accuracy, its 95%
bootstrap interval over problems, accuracy per number of operands). Each (setting, seed) is
one queued experiment, a params change and nothing else, every seed of the run (data,
initialisation, data order, sampling) set to the seed:

    dvc exp run --queue --name habit-seed0 -S ++prepare.builtin.shortcut_rate=0.75 \
        -S ++prepare.seed=0 -S ++base.seed=0 -S ++sft.seed=0 -S ++policy.dpo.seed=0 \
        -S ++policy.grpo.seed=0 -S ++policy.ppo.seed=0 score

`score` pulls in the stages upstream of the four models as dvc.yaml declares them:
check_params, prepare, base, sft, verifier, rm, prm (the online methods' declared deps; their
params.yaml rewards, answer match and format, read neither), policy@dpo, rl@grpo and rl@ppo.
`dvc queue start -j 2` runs two experiments at a time, every stage on one thread (on 2 cores
the tiny model trains about as fast per job on one thread, so two jobs take about half the
time of one after the other), and `dvc exp show --json` gives each experiment's params and
scores, from which the table is made: mean and sample standard deviation over seeds. In the
scratch project, `dvc exp show` compares them as it does any user's sweep. An experiment
the scratch project already has (by name) is not queued again: run again with the same
`--work` to resume. `--set KEY=VALUE` adds a params change to every experiment (a shorter
run: `--set sft.max_steps=4`). Results go to --out/results.json and, as a markdown table, to
--out/table.md and stdout (the repository keeps both, not the scratch project).
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

from studies import sweep  # noqa: E402

SETTINGS = {"habit": 0.75, "no_habit": 0.0}  # prepare.builtin.shortcut_rate
MODELS = {"sft": "models/sft", "dpo": "models/policy/dpo", "grpo": "models/policy/grpo", "ppo": "models/policy/ppo"}
SEEDED = ("prepare.seed", "base.seed", "sft.seed", "policy.dpo.seed", "policy.grpo.seed", "policy.ppo.seed")
SCORES = "metrics/test_scores.json"
TEST_SUITE = "data/prepared/eval/test.parquet"
HERE = "studies/seed_spread/run.py"  # this file, in the scratch project


def scratch_project(work: Path) -> Path:
    """The study's DVC project in `work` (studies/sweep.py): the four methods, and the
    `score` stage."""

    def methods(params: dict) -> None:
        params["policy"]["offline"], params["policy"]["online"] = ["dpo"], ["grpo", "ppo"]

    stage = {"cmd": f"python {HERE} --score .", "deps": [HERE, TEST_SUITE, *MODELS.values()],
             "metrics": [{SCORES: {"cache": False}}]}  # fmt: skip
    return sweep.project(work, "seed_spread", methods, {"score": stage}, files=[HERE])


def experiment_name(setting: str, seed: int) -> str:
    return f"{setting}-seed{seed}"


def changes(setting: str, seed: int, extra: list[str]) -> list[str]:
    """The experiment's params changes, as `dvc exp run -S` arguments."""
    return sweep.overrides({"prepare.builtin.shortcut_rate": SETTINGS[setting], **{key: seed for key in SEEDED}}, extra)


def collected(finished: dict[str, dict], jobs: dict[str, tuple[str, int]]) -> list[dict]:
    """Each finished experiment: its setting, seed and scores."""
    results = [
        {"setting": jobs[name][0], "seed": jobs[name][1], "experiment": name, "models": run["metrics"][SCORES]}
        for name, run in finished.items()
        if run["metrics"].get(SCORES)
    ]
    return sorted(results, key=lambda r: (list(SETTINGS).index(r["setting"]), r["seed"]))


def score(folder: Path) -> dict:
    """Greedy test-suite accuracy of each model in `folder`, with its bootstrap interval and
    per number of operands: the scratch project's `score` stage, which writes them to
    metrics/test_scores.json."""
    sweep.enter_project(folder)
    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.statistics import bootstrap_interval, group_by
    from rlhf.models.generation import generate
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.tasks import get_task

    task = get_task()
    suite = read_prepared(Path(TEST_SUITE), "score")
    prompts, answers, levels = suite["prompt"].tolist(), suite["answer"].tolist(), suite["difficulty"].tolist()
    results = {}
    for name, path in MODELS.items():
        model, tokenizer = load_causal_lm(path), load_tokenizer(path)
        texts = generate(model, tokenizer, prompts, 64, 128)
        correct = [float(task.is_correct(t, a)) for t, a in zip(texts, answers)]
        low, high = bootstrap_interval(correct)
        by_level = group_by(correct, levels)
        results[name] = {
            "accuracy": sum(correct) / len(correct),
            "low": low,
            "high": high,
            "by_operands": {k: sum(v) / len(v) for k, v in by_level.items()},
        }
    Path(SCORES).parent.mkdir(parents=True, exist_ok=True)
    Path(SCORES).write_text(json.dumps(results, indent=2) + "\n")
    return results


def stdev(values: list[float]) -> float:
    """Sample standard deviation over seeds (0 for one seed)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def table(results: list[dict]) -> str:
    lines = [
        "| setting | model | test accuracy, mean ± sd over seeds | Δ vs SFT, mean ± sd | per seed [95% CI] "
        "| 3 / 4 / 5 numbers (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        runs = sorted((r for r in results if r["setting"] == setting), key=lambda r: r["seed"])
        if not runs:
            continue
        for model in MODELS:
            values = [r["models"][model]["accuracy"] for r in runs]
            spread = stdev(values)
            deltas = [v - r["models"]["sft"]["accuracy"] for v, r in zip(values, runs)]  # paired by seed
            delta = "—" if model == "sft" else f"{statistics.mean(deltas):+.3f} ± {stdev(deltas):.3f}"
            scores = [r["models"][model] for r in runs]
            per_seed = "; ".join(f"{m['accuracy']:.3f} [{m['low']:.3f}, {m['high']:.3f}]" for m in scores)
            levels = runs[0]["models"][model]["by_operands"]
            by_level = " / ".join(
                f"{statistics.mean(r['models'][model]['by_operands'][k] for r in runs):.3f}" for k in levels
            )
            lines.append(
                f"| {setting} | {model} | {statistics.mean(values):.3f} ± {spread:.3f} | {delta} | {per_seed} "
                f"| {by_level} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--jobs", type=int, default=2, help="experiments at once (each with 2 / jobs threads)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params change for all")
    parser.add_argument("--work", type=Path, help="the scratch DVC project's folder (kept; default: temporary)")
    parser.add_argument("--out", type=Path, default=ROOT / "studies/seed_spread")
    parser.add_argument("--score", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.score:
        score(args.score)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="seed-spread-"))
    root = scratch_project(work)
    env = sweep.environment(max(1, 2 // args.jobs))
    print(f"scratch DVC project: {root}", flush=True)
    jobs = {experiment_name(setting, seed): (setting, seed) for setting in args.settings for seed in args.seeds}
    experiments = {name: (changes(setting, seed, args.set), "score") for name, (setting, seed) in jobs.items()}
    finished, minutes, failed = sweep.sweep(root, env, experiments, args.jobs)
    results = collected(finished, jobs)
    sweep.conclude(
        args.out, results, table(results), len(finished), minutes, args.jobs, failed, None if args.work else work
    )


if __name__ == "__main__":
    main()
