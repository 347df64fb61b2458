"""Elastic weight consolidation on a shift, measured: what a round that trains on long
problems only forgets of the short ones, with and without EWC.

    .venv/bin/python studies/ewc_shift/run.py --out studies/ewc_shift      # 3 seeds, ~32 min on 2 cores
    .venv/bin/python studies/ewc_shift/run.py --seeds 0 --strengths 0 1e4 --out /tmp/ewc

For each seed, in a scratch project of its own (studies/scratch.py; this checkout is not
touched), every seed of the run (data, initialisation, data order, the round's problems and
samples) set to it:

1. the built-in task with no planted habit (`shortcut_rate: 0`), the default model and SFT
   on problems of 3-5 numbers, through the real stages prepare, base and sft;
2. the real round stage (`python -m stages.improve shift`): SFT samples 8 completions for
   each of 512 new problems of 5 numbers, keeps one right one per problem (the answer
   check) and fine-tunes on those alone, with no replay of shorter problems (`replay: 0`):
   the shift. Its training table is data/rounds/shift/train.parquet;
3. that round's training (`stages.improve.train_candidate`, the round's own settings: 200
   steps at lr 1e-3) on that same table once per --strengths value of `ewc.strength`, each
   from SFT with the Fisher information of the SFT data (0: plain training, no EWC);
4. SFT and every candidate scored greedily on dev and test (stages.improve.evaluate_models),
   accuracy with 95% bootstrap intervals, and per number of operands.

What the issue asks: the share of the accuracy that plain training loses on the retention
suite (3-5 numbers) that EWC keeps, (ewc - plain) / (sft - plain). The strength is chosen
on dev (the highest dev accuracy, mean over seeds) before test is read; the table gives
test per seed and mean ± sd. Results: --out/results.json, the table in --out/table.md.
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

SHIFT = {"after": "sft", "operands": [5, 5], "replay": 0.0, "suites": ["dev"]}  # the round `shift`
SUITES = ("dev", "test")
STRENGTHS = (0.0, 1e3, 1e4, 1e5, 1e6)


def run_seed(work: Path, seed: int, strengths: list[float]) -> dict:
    """One seed: SFT, the shift round, a candidate per strength, every model evaluated."""
    env = no_habit_sft(work, seed)
    edit_params(work, lambda params: params["improve"].update(rounds={"shift": SHIFT}))
    if not (work / "data/rounds/shift/train.parquet").is_file():
        print(run_module(env, "stages.improve", "shift").strip().splitlines()[-1][:300], flush=True)
    report = json.loads((work / "models/rounds/shift/round.json").read_text())

    from rlhf.tasks import get_task
    from rlhf.training.params import EwcParams
    from stages import load_model_stage
    from stages.improve import SFT_DATA, SFT_DIR, evaluate_models, train_candidate

    params = load_model_stage()
    settings = params["improve"].settings("shift")
    models = {"sft": SFT_DIR}
    for strength in strengths:
        out = Path(f"models/ewc/{strength:g}")
        if not (out / "config.json").is_file():
            ewc = EwcParams(strength=strength, samples=settings.ewc.samples)
            train_candidate(
                settings.model_copy(update={"ewc": ewc}), params, SFT_DIR, Path("data/rounds/shift/train.parquet"),
                out, f"round-shift-ewc{strength:g}", SFT_DATA,
            )  # fmt: skip
            print(f"seed {seed}: ewc.strength {strength:g} trained", flush=True)
        models[f"{strength:g}"] = out
    evaluated = evaluate_models(params, get_task(params["task"]), models, list(SUITES))
    return {
        "round": {k: report["data"][k] for k in ("problems", "samples", "kept_samples", "training_rows")},
        "train": settings.train.model_dump(mode="json"),
        "ewc_samples": settings.ewc.samples,
        "models": {name: {s: e["metrics"] for s, e in suites.items()} for name, suites in evaluated.items()},
    }


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
        runs = [seeds[s]["models"][name] for s in seeds]
        per_seed = ", ".join(
            f"{r['test']['accuracy']:.3f} [{r['test']['accuracy_low']:.3f}, {r['test']['accuracy_high']:.3f}]"
            for r in runs
        )
        shares = [kept_share(seeds[s]["models"], name, "test") for s in seeds] if name not in ("sft", "0") else []
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
    parser.add_argument("--out", type=Path, default=ROOT / "studies/ewc_shift")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (a project per seed under it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--strengths", type=float, nargs="+", default=list(STRENGTHS), help="ewc.strength values")
    args = parser.parse_args()
    strengths = sorted({0.0, *args.strengths})
    out = args.out.resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="ewc-shift-"))).resolve()
    results: dict = {"strengths": strengths, "seeds": {}}
    for seed in args.seeds:
        results["seeds"][str(seed)] = run_seed(work / f"seed{seed}", seed, strengths)
    # The strength is chosen on dev: the highest dev accuracy, mean over seeds.
    dev = {
        f"{s:g}": statistics.mean(r["models"][f"{s:g}"]["dev"]["accuracy"] for r in results["seeds"].values())
        for s in strengths
        if s > 0
    }
    results["chosen"] = max(dev, key=dev.get) if dev else None
    results["chosen_on_dev"] = dev
    write_results(out, results, table(results))


if __name__ == "__main__":
    main()
