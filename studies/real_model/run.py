"""A real model learns (docs/results/real-model.md): SmolLM2-135M-Instruct from its GGUF file,
through the whole DAG of the recipe smollm2-135m-word-problems, once per seed, on the
test suites only (dev decides the gate; nothing reads test).

    .venv/bin/python studies/real_model/run.py                     # seeds 0, 1, 2, one after another
    .venv/bin/python studies/real_model/run.py --seeds 0 --work /tmp/real

Each seed is what a user runs: a scratch project (`--work`/seed<k>: this checkout's code,
params.yaml with the recipe applied as `rlhf recipes apply` applies it, and every seed of
the run set to k: the data, SFT's, the verifier's, the reward model's and each policy
method's data order and sampling, infer's sampling), committed to a git + DVC repository
of its own, and `python -m flows.pipeline` in it (`rlhf run`: the Prefect flow, two stages
at a time on 2 cores). A project that has finished is read again, not rerun.

Per seed it records each stage's wall time (from the flow's log) and peak resident memory
(every process of the stage, sampled each second), and reads reports/eval.json (accuracy
with its bootstrap interval per model and suite, per family), reports/outcomes.json
(per-problem outcomes: the paired difference of each method against SFT, and of SFT
against the instruct model, on test and test_unseen), reports/infer.json (best-of-N and
MCTS against greedy) and reports/gate.json (the champion). Then it scores the hand-written
problems (handwritten.py) with the instruct model as it came and the champion, each loaded
with plain transformers. Results go to --out/results.json and --out/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from studies import scratch, sweep  # noqa: E402

RECIPE = ROOT / "configs/recipes/smollm2-135m-word-problems.yaml"
SEEDED = ("prepare.seed", "sft.seed", "verifier.seed", "rm.seed", "policy.dpo.seed", "policy.grpo.seed", "infer.seed")
METHODS = ("dpo", "grpo", "merged")
SUITES = ("test", "test_unseen")
HERE = Path(__file__).resolve().parent


def seeded_recipe(seed: int, extra: dict):
    """params.yaml edited as `rlhf recipes apply` does, then every seed set to `seed`."""
    import yaml

    from rlhf.recipes import merge

    def edit(params: dict) -> None:
        merge(params, yaml.safe_load(RECIPE.read_text()))
        for key, value in {**{k: seed for k in SEEDED}, **extra}.items():
            scratch.set_key(params, key, value)

    return edit


class PeakMemory(threading.Thread):
    """The peak resident memory of each stage's processes (`python -m stages.<name> ...`,
    launched or not) that run in the project `root`, sampled each second."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root = str(root.resolve())
        self.peaks: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.is_set():
            for process in psutil.process_iter(["cmdline", "memory_info", "cwd"]):
                try:
                    command = process.info["cmdline"] or []
                    if "stages." not in " ".join(command) or process.info["cwd"] != self.root:
                        continue
                    module = next(a for a in command if a.startswith("stages."))
                    index = command.index(module)
                    item = command[index + 1] if index + 1 < len(command) else None
                    stage = module.removeprefix("stages.") + (f"@{item}" if item and not item.startswith("-") else "")
                    gib = process.info["memory_info"].rss / 2**30
                    self.peaks[stage] = max(self.peaks.get(stage, 0.0), round(gib, 2))
                except (StopIteration, psutil.Error, TypeError):
                    continue
            time.sleep(1)


_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \| \w+ +\| Task run '([^']+)' - (Running stage|Finished in state)")


def stage_times(log: str) -> dict[str, float]:
    """Seconds from each stage's start to its end, read from the flow's log."""
    started, seconds = {}, {}
    for line in log.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        at = datetime.strptime(match[1], "%H:%M:%S.%f")
        if match[3] == "Running stage":
            started[match[2]] = at
        elif match[2] in started:
            seconds[match[2]] = round((at - started[match[2]]).total_seconds() % 86400, 1)
    return seconds


def run_seed(work: Path, seed: int, extra: dict, jobs: int | None = None, threads: int | None = None) -> dict:
    """Seed `seed`'s project, run through the flow unless it has run already; its run facts.
    `jobs` and `threads`: the flow's `--jobs` and each stage's OMP_NUM_THREADS (two seeds at
    once on 2 cores: one stage at a time with one thread each)."""
    folder = work / f"seed{seed}"
    root = sweep.project(folder, f"real-model seed {seed}", seeded_recipe(seed, extra))
    facts_file = root / "study_run.json"
    if facts_file.is_file() and (root / "reports/gate.json").is_file():
        return json.loads(facts_file.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RLHF_", "DVC_", "OMP_", "MKL_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    memory = PeakMemory(root)
    memory.start()
    start = time.monotonic()
    command = [sys.executable, "-m", "flows.pipeline", *(["--jobs", str(jobs)] if jobs else [])]
    flow = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    minutes = (time.monotonic() - start) / 60
    memory.done.set()
    (root / "study_flow.log").write_text(flow.stdout + flow.stderr)
    if flow.returncode != 0:
        raise SystemExit(f"seed {seed}: the flow failed (log: {root / 'study_flow.log'}):\n{flow.stderr[-3000:]}")
    facts = {"minutes": round(minutes, 1), "jobs": jobs, "threads": threads, "stage_seconds": stage_times(flow.stdout + flow.stderr),
             "peak_gib": memory.peaks}  # fmt: skip
    facts_file.write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def scores(root: Path) -> dict:
    """What the seed's reports say: accuracy per model and suite (with intervals and per
    family), paired differences, inference-time compute, the gate's champion."""
    from rlhf.evaluation.statistics import paired_difference

    report = json.loads((root / "reports/eval.json").read_text())
    outcomes = json.loads((root / "reports/outcomes.json").read_text())["suites"]
    infer = json.loads((root / "reports/infer.json").read_text())
    gate = json.loads((root / "reports/gate.json").read_text())
    result: dict = {"accuracy": {}, "paired": {}, "gate": {"promoted": gate.get("promoted"),
                                                           "champion": gate.get("champion")}}  # fmt: skip
    for suite in ("dev", *SUITES):
        for model, metrics in report["suites"][suite].items():
            result["accuracy"].setdefault(suite, {})[model] = {
                key: metrics.get(key)
                for key in ("accuracy", "accuracy_low", "accuracy_high", "accuracy_by_difficulty", "mean_length")
            }
    for suite in SUITES:
        models = outcomes[suite]["models"]
        sft = models["sft"]["accuracy"]
        result["paired"][suite] = {"sft_over_base": paired_difference(sft, models["base"]["accuracy"])}
        for method in METHODS:
            if method in models:
                result["paired"][suite][f"{method}_over_sft"] = paired_difference(models[method]["accuracy"], sft)
    result["infer"] = infer
    return result


def handwritten(root: Path) -> dict:
    """The hand-written problems, answered by the instruct model as it came, SFT, and the
    champion when the gate promoted one."""
    out = root / "study_handwritten.json"
    if not out.is_file():
        from rlhf.tracking.champion import read_champion

        models = [root / "models/base", root / "models/sft"]
        if read_champion(root / "models/champion"):
            models.append(root / "models/champion")
        subprocess.run([sys.executable, str(HERE / "handwritten.py"), *map(str, models), "--out", str(out)],
                       check=True, cwd=root)  # fmt: skip
    data = json.loads(out.read_text())
    return {Path(k).name: {key: v for key, v in value.items() if key != "replies"} for k, value in data.items()}


def _cell(value: dict, low: str = "low", high: str = "high", key: str = "difference", sign: bool = True) -> str:
    form = "+.3f" if sign else ".3f"
    return f"{value[key]:{form}} [{value[low]:{form}}, {value[high]:{form}}]"


def _spread(values: list[float], sign: bool = False) -> str:
    form = "+.3f" if sign else ".3f"
    if len(values) > 1:
        return f"{statistics.mean(values):{form}} ± {statistics.stdev(values):.3f}"
    return f"{values[0]:{form}}" if values else "-"


def table(results: dict) -> str:
    """The study page's tables: test accuracy per model per seed, the paired gains, accuracy
    per family, inference-time compute, the gate, the hand-written problems, each stage's
    wall time and peak memory."""
    seeds = sorted(results["seeds"], key=int)
    runs = [results["seeds"][s] for s in seeds]
    header = "| " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd |"
    rule = "|---|" + "---|" * (len(seeds) + 1)
    lines = [f"Accuracy [95% bootstrap interval over problems] per seed; {len(seeds)} seed(s).", ""]
    for suite in SUITES:
        lines += [f"**{suite}**", "", "| model " + header, rule]
        for model in ["base", "sft", *METHODS]:
            cells, values = [], []
            for run in runs:
                m = run["scores"]["accuracy"][suite].get(model)
                if m is None or m["accuracy"] is None:
                    cells.append("n/a")
                    continue
                values.append(m["accuracy"])
                cells.append(_cell(m, "accuracy_low", "accuracy_high", "accuracy", sign=False))
            lines.append(f"| {model} | " + " | ".join(cells) + f" | {_spread(values)} |")
        lines.append("")
    lines += ["**Paired differences** on the same problems [95% paired bootstrap interval]", "",
              "| suite | difference " + header, "|---|---|" + "---|" * (len(seeds) + 1)]  # fmt: skip
    for suite in SUITES:
        for name in ["sft_over_base", *(f"{m}_over_sft" for m in METHODS)]:
            values = [run["scores"]["paired"][suite].get(name) for run in runs]
            if any(v is None for v in values):
                continue
            row = " | ".join(_cell(v) for v in values)
            label = name.replace("_over_", " − ")
            lines.append(f"| {suite} | {label} | {row} | {_spread([v['difference'] for v in values], sign=True)} |")
    lines += ["", "**Accuracy per family** (test; mean over seeds)", ""]
    families = sorted(runs[0]["scores"]["accuracy"]["test"]["sft"]["accuracy_by_difficulty"])
    lines += ["| model | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
    for model in ["base", "sft", *METHODS]:
        cells = []
        for family in families:
            values = [(run["scores"]["accuracy"]["test"].get(model) or {}).get("accuracy_by_difficulty", {}).get(family)
                      for run in runs]  # fmt: skip
            values = [v for v in values if v is not None]
            cells.append(f"{statistics.mean(values):.2f}" if values else "n/a")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += ["", "**Inference-time compute** (the SFT model, the first problems of test)", "",
              "| strategy " + header.replace(" mean ± sd |", " mean ± sd | tokens a problem |"),
              "|---|" + "---|" * (len(seeds) + 2)]  # fmt: skip
    for strategy in runs[0]["scores"]["infer"]["strategies"]:
        facts = [run["scores"]["infer"]["strategies"][strategy] for run in runs]
        cells = " | ".join(_cell(f, "accuracy_low", "accuracy_high", "accuracy", sign=False) + f" ({f['seconds']:.0f} s)"
                           for f in facts)  # fmt: skip
        tokens = statistics.mean(f["tokens_per_problem"] for f in facts)
        lines.append(f"| {strategy} | {cells} | {_spread([f['accuracy'] for f in facts])} | {tokens:.0f} |")
    lines += ["", "**The gate** (on dev): " + "; ".join(
        f"seed {s}: " + (f"promoted {run['scores']['gate']['champion']}" if run["scores"]["gate"]["promoted"]
                         else "nothing promoted") for s, run in zip(seeds, runs))]  # fmt: skip
    lines += ["", "**Hand-written problems** (60; plain transformers, greedy, the chat template)", "",
              "| model " + header, rule]  # fmt: skip
    for model in runs[0]["handwritten"]:
        values = [run["handwritten"].get(model) for run in runs]
        cells = " | ".join(_cell(v, key="accuracy", sign=False) if v else "n/a" for v in values)
        lines.append(f"| {model} | {cells} | {_spread([v['accuracy'] for v in values if v])} |")
        over = [v.get("over_base") for v in values if v and v.get("over_base")]
        if over:
            lines.append(f"| {model} − base | " + " | ".join(_cell(v) for v in over)
                         + f" | {_spread([v['difference'] for v in over], sign=True)} |")  # fmt: skip
    stages = sorted({name for run in runs for name in run["run"]["stage_seconds"]})
    lines += ["", "**Wall time (min) and peak resident memory (GiB) of each stage**", "",
              "| stage " + header.replace(" mean ± sd |", ""), "|---|" + "---|" * len(seeds)]  # fmt: skip
    for stage in stages:
        cells = []
        for run in runs:
            seconds = run["run"]["stage_seconds"].get(stage)
            peak = run["run"]["peak_gib"].get(stage)
            cells.append(f"{seconds / 60:.1f}" if seconds is not None else "-")
            cells[-1] += f" ({peak:.1f} GiB)" if peak is not None else ""
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append("| **the flow** | " + " | ".join(f"{run['run']['minutes']:.1f}" for run in runs) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("/tmp/rlhf-real-model"), help="scratch projects")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--jobs", type=int, default=None, help="the flow's --jobs (default: the flow's own)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every stage")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params change (all seeds)")
    args = parser.parse_args()
    import yaml

    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    results = {"recipe": RECIPE.relative_to(ROOT).as_posix(), "set": extra, "seeds": {}}
    previous = args.out / "results.json"
    if previous.is_file() and not extra:
        results["seeds"] = json.loads(previous.read_text()).get("seeds", {})
    for seed in args.seeds:
        run = run_seed(args.work, seed, extra, args.jobs, args.threads)
        root = args.work / f"seed{seed}" / "project"
        results["seeds"][str(seed)] = {"run": run, "scores": scores(root), "handwritten": handwritten(root)}
        sweep.write_results(args.out, results, table(results))


if __name__ == "__main__":
    main()
