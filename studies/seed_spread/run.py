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

    dvc exp run --queue --name habit-seed0 -S prepare.builtin.shortcut_rate=0.75 \
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
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
SETTINGS = {"habit": 0.75, "no_habit": 0.0}  # prepare.builtin.shortcut_rate
MODELS = {"sft": "models/sft", "dpo": "models/policy/dpo", "grpo": "models/policy/grpo", "ppo": "models/policy/ppo"}
SEEDED = ("prepare.seed", "base.seed", "sft.seed", "policy.dpo.seed", "policy.grpo.seed", "policy.ppo.seed")
SCORES = "metrics/test_scores.json"
TEST_SUITE = "data/prepared/eval/test.parquet"
HERE = "studies/seed_spread/run.py"  # this file, in the scratch project


def scratch_project(work: Path) -> Path:
    """The study's DVC project in `work` (made once; an existing one is resumed)."""
    from studies.scratch import copy_code

    root = work / "project"
    if (root / ".dvc").is_dir():
        return root
    root.mkdir(parents=True)
    copy_code(root)
    (root / HERE).parent.mkdir(parents=True)
    shutil.copy2(Path(__file__), root / HERE)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["policy"]["offline"], params["policy"]["online"] = ["dpo"], ["grpo", "ppo"]
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    pipeline = yaml.safe_load((root / "dvc.yaml").read_text())
    pipeline["stages"]["score"] = {
        "cmd": f"python {HERE} --score .",
        "deps": [HERE, TEST_SUITE, *MODELS.values()],
        "metrics": [{SCORES: {"cache": False}}],
    }
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    commit = ["git", "-c", "user.name=study", "-c", "user.email=study@localhost", "commit", "-qm", "seed_spread"]
    for command in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"], ["git", "add", "-A"], commit):
        subprocess.run(command, cwd=root, check=True, capture_output=True)
    return root


def environment(threads: int) -> dict:
    """What the queue's workers run with: this interpreter first on PATH, `threads` threads
    a stage, each experiment's MLflow runs in its own workspace's store."""
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "RLHF_PARENT_RUN_ID", "DVC_STAGE", "DVC_ROOT"):
        env.pop(name, None)
    return env


def dvc(root: Path, env: dict, *args: str, check: bool = True) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"dvc {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def experiment_name(setting: str, seed: int) -> str:
    return f"{setting}-seed{seed}"


def changes(setting: str, seed: int, extra: list[str]) -> list[str]:
    """The experiment's params changes, as `dvc exp run -S` arguments (Hydra's override
    syntax: `++` sets a key params.yaml may not write out, such as a method's seed)."""
    sets = [f"prepare.builtin.shortcut_rate={SETTINGS[setting]}", *(f"++{key}={seed}" for key in SEEDED), *extra]
    return [arg for change in sets for arg in ("-S", change)]


def start_workers(root: Path, env: dict, count: int) -> None:
    with open(root.parent / "queue-start.log", "a") as log:  # the workers outlive the command
        subprocess.run([sys.executable, "-m", "dvc", "queue", "start", "-j", str(count)], cwd=root, env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=True)  # fmt: skip


def run_queue(root: Path, env: dict, jobs: int) -> str:
    """Start `jobs` queue workers and wait until nothing is queued or running: the last
    `dvc queue status`. A worker that stops while experiments are still queued (seen once,
    with an experiment queued after the workers started) is replaced."""
    start_workers(root, env, jobs)
    shown = ""
    while True:
        status = dvc(root, env, "queue", "status")
        states = ("Queued", "Running", "Success", "Failed")
        counts = {state: len(re.findall(rf"\b{state}\b", status)) for state in states}
        line = ", ".join(f"{n} {state.lower()}" for state, n in counts.items() if n)
        if line != shown:
            print(f"{time.strftime('%H:%M:%S')} queue: {line}", flush=True)
            shown = line
        if not counts["Queued"] and not counts["Running"]:
            return status
        workers = re.search(r"Worker status: (\d+) active, (\d+) idle", status)
        busy = int(workers.group(1)) + int(workers.group(2)) if workers else jobs
        if counts["Queued"] and busy < jobs:
            start_workers(root, env, min(jobs - busy, counts["Queued"]))
        time.sleep(15)


def collected(root: Path, env: dict, names: set[str]) -> list[dict]:
    """Each finished experiment of `names`: its setting, seed and scores (`dvc exp show`)."""
    results = []
    for baseline in json.loads(dvc(root, env, "exp", "show", "--json")):
        for experiment in baseline.get("experiments") or []:
            for rev in experiment["revs"]:
                data = rev.get("data") or {}
                scores = (data.get("metrics") or {}).get(SCORES, {}).get("data")
                if rev.get("name") not in names or not scores:
                    continue
                params = data["params"]["params.yaml"]["data"]
                rate = params["prepare"]["builtin"]["shortcut_rate"]
                setting = next(name for name, value in SETTINGS.items() if value == rate)
                results.append({"setting": setting, "seed": params["prepare"]["seed"], "experiment": rev["name"],
                                "models": scores})  # fmt: skip
    return sorted(results, key=lambda r: (list(SETTINGS).index(r["setting"]), r["seed"]))


def score(folder: Path) -> dict:
    """Greedy test-suite accuracy of each model in `folder`, with its bootstrap interval and
    per number of operands: the scratch project's `score` stage, which writes them to
    metrics/test_scores.json."""
    os.chdir(folder)
    sys.path.insert(0, str(folder))
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
    env = environment(max(1, 2 // args.jobs))
    print(f"scratch DVC project: {root}", flush=True)
    jobs = {experiment_name(setting, seed): (setting, seed) for setting in args.settings for seed in args.seeds}
    done = set(dvc(root, env, "exp", "list", "--name-only").split())
    start = time.perf_counter()
    for name, (setting, seed) in jobs.items():
        if name not in done:
            dvc(root, env, "exp", "run", "--queue", "--name", name, *changes(setting, seed, args.set), "score")
    status = run_queue(root, env, args.jobs)
    minutes = (time.perf_counter() - start) / 60
    results = collected(root, env, set(jobs))
    missing = sorted(set(jobs) - {r["experiment"] for r in results})
    for name in missing:
        log = dvc(root, env, "queue", "logs", name, check=False)
        print(f"{name} failed; the end of its log (dvc queue logs {name}):\n{log[-3000:]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    summary = f"{len(results)} experiments through `dvc exp run --queue` (-j {args.jobs}), {minutes:.1f} min"
    (args.out / "table.md").write_text(f"{summary}\n\n{table(results)}\n")
    print(f"\n{summary}\n\n{table(results)}")
    if missing:
        raise SystemExit(f"{len(missing)} experiment(s) failed: {missing}\n{status}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
