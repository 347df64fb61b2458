"""Elastic weight consolidation on a shift, measured: what a round that trains on long
problems only forgets of the short ones, with and without EWC; a params sweep over EWC
strengths and seeds, run through DVC's experiment queue (studies/sweep.py).

    .venv/bin/python studies/ewc_shift/run.py                      # 3 seeds x 5 strengths, two at a time
    .venv/bin/python studies/ewc_shift/run.py --seeds 0 --strengths 0 1e4 --jobs 1

The study makes a scratch DVC project (`--work`; a temporary folder by default): this
checkout's code, dvc.yaml and params.yaml with no planted habit (`shortcut_rate: 0`) and one
round, `shift`, in `improve.rounds`, committed to a git repository of its own. Each (seed,
strength) is one queued experiment, a params change and nothing else:

    dvc exp run --queue --name seed0-ewc10000 -S ++base.seed=0 -S ++sft.seed=0 \
        -S ++improve.defaults.seed=0 -S ++improve.defaults.train.seed=0 \
        -S ++improve.rounds.shift.ewc.strength=10000.0 improve@shift

`improve@shift` pulls in check_params, prepare, base and sft (on problems of 3-5 numbers;
DVC's run cache restores them for a seed's later experiments). The round: SFT samples 8
completions for each of 512 new problems of 5 numbers, keeps one right one per problem (the
answer check) and fine-tunes on those alone, with no replay of shorter problems (`replay:
0`): the shift; the round's training settings (200 steps at lr 1e-3), with EWC towards SFT
at the experiment's `ewc.strength` (Fisher information of the SFT data; 0: plain training).
The round's problems and samples depend on the seed only, so a seed's experiments train on
the same table (the driver checks their counts agree). The round evaluates SFT and its
candidate greedily on dev and test (3-5 numbers), accuracy with 95% bootstrap intervals and
per number of operands; its gate reads dev only (progress and retention), and the study
reads the candidate whether the gate passed it or not (reports/rounds/shift.json, read back
with `dvc exp show --json`).

What is measured: the share of the accuracy that plain training loses on the retention
suite (3-5 numbers) that EWC keeps, (ewc - plain) / (sft - plain). The strength is chosen on
dev (the highest dev accuracy, mean over seeds) before test is read; the table gives test
per seed and mean ± sd. Results: --out/results.json, the table in --out/table.md.
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

ROUND = {"after": "sft", "operands": [5, 5], "replay": 0.0, "suites": ["dev", "test"]}  # the round `shift`
STRENGTHS = (0.0, 1e3, 1e4, 1e5, 1e6)
METRICS = "reports/rounds/shift.json"
COUNTS = ("problems", "samples", "kept_samples", "training_rows")


def experiment_name(seed: int, strength: float) -> str:
    return f"seed{seed}-ewc{strength:g}".replace("+", "")


def collected(finished: dict[str, dict], jobs: dict[str, tuple[int, float]]) -> dict:
    """{seed: {"round": the round's counts, "models": {"sft" or strength: {suite: metrics}}}};
    a seed whose experiments drew different tables is an error (the study compares like
    with like)."""
    seeds: dict[str, dict] = {}
    for name, (seed, strength) in sorted(jobs.items(), key=lambda job: job[1]):
        if name not in finished:
            continue
        summary = finished[name]["metrics"][METRICS]
        if "candidate_eval" not in summary:  # the round stopped before training: nothing to compare
            print(f"{name}: the round stopped before training ({summary.get('data')}); left out", flush=True)
            continue
        counts = {k: summary["data"][k] for k in COUNTS}
        entry = seeds.setdefault(str(seed), {"round": counts, "models": {"sft": summary["start_eval"]}})
        if entry["round"] != counts or entry["models"]["sft"] != summary["start_eval"]:
            raise SystemExit(f"{name}: the round's table or SFT's scores differ from the seed's other experiments")
        entry["models"][f"{strength:g}"] = summary["candidate_eval"]
    return seeds


def kept_share(models: dict, strength: str, suite: str) -> float | None:
    """Share of the accuracy plain training lost on `suite` that `strength` keeps."""
    sft, plain, ewc = (models[name][suite]["accuracy"] for name in ("sft", "0", strength))
    return (ewc - plain) / (sft - plain) if sft > plain else None


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(results: dict) -> str:
    seeds = results["seeds"]
    names = ["sft", *(f"{s:g}" for s in results["strengths"])]
    chosen = results["chosen"]
    lines = [
        "| model | dev (3-5), mean ± sd | test (3-5), mean ± sd | test per seed [95% CI] | test, 3 numbers | "
        "test, 5 numbers (trained on) | share of the test loss kept, mean ± sd |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        runs = [seeds[s]["models"][name] for s in seeds if name in seeds[s]["models"]]
        if not runs:
            continue
        per_seed = ", ".join(
            f"{r['test']['accuracy']:.3f} [{r['test']['accuracy_low']:.3f}, {r['test']['accuracy_high']:.3f}]"
            for r in runs
        )
        shares = [
            kept_share(seeds[s]["models"], name, "test")
            for s in seeds
            if name not in ("sft", "0") and {name, "0"} <= set(seeds[s]["models"])
        ]
        shares = [x for x in shares if x is not None]
        label = {"sft": "SFT (no training)", "0": "ewc.strength 0 (plain)"}.get(name, f"ewc.strength {name}")
        if name == chosen:
            label = f"**{label} (chosen on dev)**"
        cells = [
            spread([r["dev"]["accuracy"] for r in runs]),
            spread([r["test"]["accuracy"] for r in runs]),
            per_seed,
            spread([r["test"]["accuracy_by_difficulty"]["3"] for r in runs]),
            spread([r["test"]["accuracy_by_difficulty"]["5"] for r in runs]),
            f"{spread(shares)} ({', '.join(f'{x:.0%}' for x in shares)})" if shares else "",
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--strengths", type=float, nargs="+", default=list(STRENGTHS), help="ewc.strength values")
    parser.add_argument("--jobs", type=int, default=2, help="experiments at once (each with 2 / jobs threads)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params change for all")
    parser.add_argument("--work", type=Path, help="the scratch DVC project's folder (kept; default: temporary)")
    parser.add_argument("--out", type=Path, default=ROOT / "studies/ewc_shift")
    args = parser.parse_args()
    strengths = sorted({0.0, *args.strengths})
    work = args.work or Path(tempfile.mkdtemp(prefix="ewc-shift-"))
    root = sweep.round_project(work, "ewc_shift", "shift", ROUND)
    env = sweep.environment(max(1, 2 // args.jobs))
    print(f"scratch DVC project: {root}", flush=True)
    # Strength by strength, each seed in turn: a seed's first experiment makes its SFT model,
    # which DVC's run cache gives the seed's later ones.
    jobs = {experiment_name(seed, s): (seed, s) for s in strengths for seed in args.seeds}
    experiments = {
        name: (sweep.round_overrides(seed, {"improve.rounds.shift.ewc.strength": float(s)}, args.set), "improve@shift")
        for name, (seed, s) in jobs.items()
    }
    finished, minutes, failed = sweep.sweep(root, env, experiments, args.jobs)
    results: dict = {"round": ROUND, "strengths": strengths, "seeds": collected(finished, jobs)}
    # The strength is chosen on dev: the highest dev accuracy, mean over seeds.
    dev = {
        f"{s:g}": statistics.mean(r["models"][f"{s:g}"]["dev"]["accuracy"] for r in results["seeds"].values())
        for s in strengths
        if s > 0 and all(f"{s:g}" in r["models"] for r in results["seeds"].values())
    }
    results["chosen"] = max(dev, key=dev.get) if dev else None
    results["chosen_on_dev"] = dev
    sweep.conclude(
        args.out, results, table(results), len(finished), minutes, args.jobs, failed, None if args.work else work
    )


if __name__ == "__main__":
    main()
