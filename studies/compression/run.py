"""The context-compression study (docs/results/context-compression.md): the recipe
tiny-long-context's project (or `--recipe`'s: studies/compression/smollm2.yaml is the real
model's) up to SFT through `dvc repro sft`, then compressors of several
settings trained by stage compress's own code (stages.compress.run) for that SFT model,
and a suite scored in every reading (rlhf.evaluation.contexts): the context cut to the
window, the relevant sentences alone, and each compressor's.

    .venv/bin/python studies/compression/run.py --work /tmp/compression --suite dev \\
        --variant name=chosen,tokens=32,steps=6000,select=2,chunk_by=sentences \\
        --variant name=icae,tokens=32,steps=300,query_aware=0,adapter_reads=0,chunk_by=tokens,select=0

Each variant is `key=value` pairs: name, and any key of params `compress` (tokens: one
count, 32 when left out; steps: max_steps; lr: learning_rate; batch:
per_device_train_batch_size; query_aware and adapter_reads as 0/1; slot_positions: parallel
or sequential; chunk_by: tokens or sentences; recite: a weight; crops: N+N+N; select:
chunks read; any other key left out takes its value in the --work project's params, the
recipe as it was when that project was made), `context=relevant`: trained and scored with every context cut to
its relevant sentences (the default, whole, reads them whole), and `init=NAME`: training starts from
variant NAME's trained compressor (its adapter, memory, map and head; same settings) with a fresh
optimizer and schedule (its warm-up, then a linear decay): with half NAME's learning rate and as
many steps again, close to the second half of a schedule twice as long. A variant whose folder under
--work/compressors exists is scored
again, not retrained. Writes --work/results-<suite>.json: per reading, the
accuracy with its 95% bootstrap interval, and per variant its training time, losses and
memory (the process's resident memory before training, and its peak before and after:
training's peak where the two differ).
Tune on dev; only a setting chosen on dev is scored on test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from studies import sweep  # noqa: E402
from studies.scratch import resident_gib  # noqa: E402

NAMES = {"steps": "max_steps", "lr": "learning_rate", "batch": "per_device_train_batch_size"}


def recipe(path: Path):
    """An edit of params that merges in the recipe file at `path` as `rlhf recipes apply`
    does (mappings key by key)."""
    import yaml

    from rlhf.recipes import merge

    overlay = yaml.safe_load(path.read_text())
    return lambda params: merge(params, overlay)


def variant(text: str) -> dict:
    pairs = dict(part.split("=", 1) for part in text.split(","))
    out = {"name": pairs.pop("name")}
    for key, value in pairs.items():
        key = NAMES.get(key, key)
        if key in ("query_aware", "adapter_reads"):
            out[key] = bool(int(value))
        elif key in ("slot_positions", "chunk_by"):
            out[key] = value
        elif key == "init":
            out[key] = value
        elif key == "context":
            if value not in ("whole", "relevant"):
                raise argparse.ArgumentTypeError(f"context={value}: whole or relevant")
            out[key] = value
        elif key == "crops":  # N+N+N: one crop for each N
            out[key] = [int(n) for n in value.split("+")]
        else:
            out[key] = float(value) if "." in value or "e" in value else int(value)
    out["tokens"] = [int(out.get("tokens", 32))]
    return out


def save(out: Path, results: dict, variants: list[str]) -> None:
    """Write `results`' readings and its `variants` to `out`, keeping what another run of
    this script sharing --work wrote there (read, merged and replaced under a lock)."""
    import fcntl
    import tempfile

    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = json.loads(out.read_text()) if out.is_file() else {"readings": {}, "variants": {}}
        merged["readings"].update(results["readings"])
        merged["variants"].update({name: results["variants"][name] for name in variants})
        with tempfile.NamedTemporaryFile("w", dir=out.parent, suffix=".tmp", delete=False) as tmp:
            tmp.write(json.dumps(merged, indent=2) + "\n")
        Path(tmp.name).replace(out)


@contextlib.contextmanager
def own_checkpoints(name: str):
    """While open, stage compress keeps its checkpoints under checkpoints/study/<name>: a
    rerun of this variant resumes its own, and no other variant (a warm start, whose
    settings may equal another's) resumes them."""
    import stages.compress

    saved = stages.compress.CHECKPOINTS_DIR
    stages.compress.CHECKPOINTS_DIR = Path("checkpoints/study") / name
    try:
        yield
    finally:
        stages.compress.CHECKPOINTS_DIR = saved


@contextlib.contextmanager
def warm_start(folder: Path | None):
    """While open, a new compressor (stage compress's `ContextCompressor.new`) starts from
    the trained parts saved in `folder` (`load_trained`); nothing changes when None."""
    from rlhf.models.compressor import ContextCompressor

    if folder is None:
        yield
        return
    if not (folder / "compressor_config.json").is_file():
        raise SystemExit(f"init: {folder} holds no trained compressor; train that variant first")
    new, saved = ContextCompressor.new, ContextCompressor.__dict__["new"]

    def started(*args, **kwargs):
        compressor = new(*args, **kwargs)
        compressor.load_trained(folder)
        return compressor

    ContextCompressor.new = started
    try:
        yield
    finally:
        ContextCompressor.new = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--suite", default="dev")
    parser.add_argument("--variant", action="append", default=[], type=variant)
    parser.add_argument("--window", type=int, default=None,
                        help="the readings' window in tokens, in place of the project's evaluate.window (e.g. "
                        "8192: SmolLM2 reading whole contexts); its reading is recorded as 'window N'")  # fmt: skip
    parser.add_argument("--recipe", type=Path, default=ROOT / "configs/recipes/tiny-long-context.yaml",
                        help="the params the study's project sets (read when --work has no project yet)")  # fmt: skip
    args = parser.parse_args()
    root = sweep.project(args.work, "context compression", recipe(args.recipe))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{args.work / 'mlflow.db'}"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if not (root / "models/sft/config.json").is_file():
        subprocess.run([sys.executable, "-m", "dvc", "repro", "sft"], cwd=root, env=env, check=True)
    os.chdir(root)
    sys.path.insert(0, str(root))
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]

    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.contexts import evaluate_compressed, readings, window_budget
    from rlhf.evaluation.suites import evaluate_model
    from rlhf.models.compressor import ContextCompressor
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.tasks import get_task
    from stages import load_all
    from stages.compress import Config, run

    params = load_all()
    task, config = get_task(params["task"]), params["evaluate"]
    if args.window:
        config = config.model_copy(update={"window": args.window})
    serve = Path("models/sft")
    tokenizer, model = load_tokenizer(serve), load_causal_lm(serve)
    suite = read_prepared(Path(f"data/prepared/eval/{args.suite}.parquet"), "study")
    out = args.work / f"results-{args.suite}.json"
    results = json.loads(out.read_text()) if out.is_file() else {"readings": {}, "variants": {}}

    def interval(metrics: dict) -> dict:
        return {k: metrics[f"accuracy{s}"] for k, s in (("accuracy", ""), ("low", "_low"), ("high", "_high"))}

    cut = f"window {args.window}" if args.window else "cut to the window"
    for name, frame in readings(suite, tokenizer, window_budget(model, config.window, config.max_new_tokens)).items():
        metrics = evaluate_model(config, task, model, None, tokenizer, None, frame, None)[0]
        results["readings"][cut if not name else name.strip("/")] = interval(metrics)
    rows, done = Path("data/prepared/compress.parquet"), []
    for settings in args.variant:
        name, context, init = settings.pop("name"), settings.pop("context", "whole"), settings.pop("init", None)
        folder = args.work / "compressors" / name
        record = results["variants"].get(name, {})
        data, scored = rows, suite
        if context == "relevant":  # every context cut to its relevant sentences
            data = args.work / "compress-relevant.parquet"
            table = read_prepared(rows, "study")
            table.assign(context=table["relevant"]).to_parquet(data, index=False)
            scored = suite.assign(context=suite["relevant"])
        if not (folder / f"k{settings['tokens'][0]}").is_dir():
            compress = Config(**{**params["compress"].model_dump(), **settings, "enabled": True})
            start, (before, peak) = time.perf_counter(), resident_gib()
            init_folder = args.work / "compressors" / init / f"k{settings['tokens'][0]}" if init else None
            with warm_start(init_folder), own_checkpoints(name):
                metrics, curve = run(compress, serve, data, folder)
            record = {"settings": {**settings, "context": context, "init": init},
                      "train_minutes": (time.perf_counter() - start) / 60,
                      "losses": [round(row["loss"], 4) for row in curve], **metrics,
                      "resident_gib_before": before, "peak_resident_gib_before": peak,
                      "peak_resident_gib": resident_gib()[1]}  # fmt: skip
        compressor = ContextCompressor.from_pretrained(folder / f"k{settings['tokens'][0]}", load_causal_lm(serve))
        start = time.perf_counter()
        metrics = evaluate_compressed(config, task, compressor, tokenizer, scored)[0]
        record[args.suite] = {**interval(metrics), "slots": metrics["slots"], "seconds": time.perf_counter() - start}
        results["variants"][name] = record
        done.append(name)
        save(out, results, done)
        print(name, record[args.suite], flush=True)
    save(out, results, done)
    print(json.dumps(results["readings"]))


if __name__ == "__main__":
    main()
