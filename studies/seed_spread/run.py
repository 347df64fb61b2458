"""The headline table (README, docs/results/policy-over-seeds.md): SFT, DPO, GRPO and PPO on
the built-in task, over seeds, with and without the planted shortcut habit, scored on the test split only.

    .venv/bin/python studies/seed_spread/run.py                        # 3 seeds x 2 settings
    .venv/bin/python studies/seed_spread/run.py --seeds 0 --settings habit --workers 1

Each (setting, seed) runs the real stages (`python -m stages.<name>`, params from this
checkout's params.yaml) in its own folder under --out: prepare, base, sft, policy dpo, grpo
and ppo, with every seed of the run (data, initialisation, data order, sampling) set to the
seed. GRPO and PPO use their params.yaml rewards (answer match and format), which read no
reward model, so the RM, verifier and PRM stages are not needed and not run. Each model is
then scored by greedy decoding on the test suite (data/prepared/eval/test.parquet), which
nothing tuned on: accuracy, its 95% bootstrap interval over problems, and accuracy per
number of operands. The table gives mean and sample standard deviation over seeds.

`--workers 2` runs two (setting, seed) jobs at once with one thread each: on a 2-core
machine the tiny model trains about as fast per job on one thread, so two jobs finish in
about half the time of one-by-one. Results go to --out/results.json and, as a markdown
table, to --out/table.md and stdout (the repository keeps both, not the jobs' folders).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"habit": 0.75, "no_habit": 0.0}  # prepare.builtin.shortcut_rate
MODELS = {"sft": "models/sft", "dpo": "models/policy/dpo", "grpo": "models/policy/grpo", "ppo": "models/policy/ppo"}
STAGES = [["stages.prepare"], ["stages.base"], ["stages.sft"], ["stages.policy", "dpo"], ["stages.rl", "grpo"],
          ["stages.rl", "ppo"]]  # fmt: skip


def job_params(shortcut_rate: float, seed: int) -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["prepare"]["seed"] = seed
    params["prepare"]["builtin"]["shortcut_rate"] = shortcut_rate
    params["base"]["seed"] = seed
    params["sft"]["seed"] = seed
    params["policy"]["offline"], params["policy"]["online"] = ["dpo"], ["grpo", "ppo"]
    for method in ("dpo", "grpo", "ppo"):
        params["policy"].setdefault(method, {})["seed"] = seed
    return params


def run_job(out: Path, setting: str, seed: int, threads: int) -> dict:
    folder = out / f"{setting}-seed{seed}"
    result_file = folder / "result.json"
    if result_file.is_file():  # a finished job is not run again (the sweep resumes)
        return json.loads(result_file.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    for name in ("rlhf", "stages"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "params.yaml").write_text(yaml.safe_dump(job_params(SETTINGS[setting], seed), sort_keys=False))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
        "PYTHONPATH": str(folder),
    }
    env.pop("RLHF_PARENT_RUN_ID", None)
    seconds = {}
    for command in STAGES:
        start = time.perf_counter()
        log = folder / "log.txt"
        with log.open("a") as handle:
            subprocess.run(
                [sys.executable, "-m", *command], cwd=folder, env=env, stdout=handle, stderr=handle, check=True
            )
        seconds[" ".join(command[-1:])] = time.perf_counter() - start
    score = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--score", str(folder)],
        cwd=folder, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = {"setting": setting, "seed": seed, "seconds": seconds, "models": json.loads(score.stdout)}
    result_file.write_text(json.dumps(result, indent=2))
    print(f"{setting} seed {seed}: " + ", ".join(f"{m} {r['accuracy']:.3f}" for m, r in result["models"].items()))
    return result


def score(folder: Path) -> dict:
    """Greedy test-suite accuracy of each model in `folder`, with its bootstrap interval and
    per number of operands (run in the job's folder, as its own process)."""
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.statistics import bootstrap_interval, group_by
    from rlhf.models.generation import generate
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.tasks import get_task

    task = get_task()
    suite = read_prepared(Path("data/prepared/eval/test.parquet"), "score")
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
    parser.add_argument("--workers", type=int, default=2, help="jobs at once (each with 2 / workers threads)")
    parser.add_argument("--out", type=Path, default=ROOT / "studies/seed_spread")
    parser.add_argument("--score", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.score:
        print(json.dumps(score(args.score)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(setting, seed) for setting in args.settings for seed in args.seeds]
    threads = max(1, 2 // args.workers)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(lambda job: run_job(args.out, job[0], job[1], threads), jobs))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    minutes = (time.perf_counter() - start) / 60
    (args.out / "table.md").write_text(f"{len(jobs)} runs in {minutes:.1f} min\n\n{table(results)}\n")
    print(f"\n{len(jobs)} runs in {minutes:.1f} min\n")
    print(table(results))


if __name__ == "__main__":
    main()
