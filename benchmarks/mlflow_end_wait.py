"""How long training waits on MLflow at the end of a run: many short SFT and ORPO runs
against one sqlite store, with and without a parent run open (as under the flow), through
the project's tracking (synchronous writes, rlhf.training.trainer_setup.MLflowMetrics) and,
for comparison, through transformers' MLflowCallback (asynchronous writes that the run's
end waits to drain).

Each run is the micro model trained for a few steps with a loss logged every step, inside
an MLflow run; the wait is the time `mlflow.end_run()` takes. Prints, per tracking path and
parent setting, the count of runs, the longest wait, the median and how many waited over
5 s, and whether every logged step reached the store.

    python benchmarks/mlflow_end_wait.py [--runs 30] [--steps 5] [--paths ours transformers]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402

BOUND_S = 5.0


def build_inputs(root: Path) -> tuple[Path, Path, Path]:
    from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model

    tokenizer = build_tokenizer()
    base = root / "base"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, base)
    sft = root / "sft.parquet"
    pd.DataFrame(
        {"prompt": [f"{a}+{a}\n" for a in range(32)], "completion": [f"{2 * a}" for a in range(32)]}
    ).to_parquet(sft)
    prefs = root / "prefs.parquet"
    pd.DataFrame(
        {
            "prompt": [f"{a}+{a}\n" for a in range(32)],
            "chosen": [f"{2 * a}" for a in range(32)],
            "rejected": [f"{2 * a + 1}" for a in range(32)],
        }
    ).to_parquet(prefs)
    return base, sft, prefs


def train_once(method: str, path: str, base: Path, sft: Path, prefs: Path, out: Path, steps: int) -> None:
    """One short training inside the active MLflow run; `path` ours | transformers."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.training.methods.sft import SFTParams
    from rlhf.training.trainer_setup import tracking_callbacks, trl_config

    params = SFTParams(max_steps=steps, per_device_train_batch_size=4, logging_steps=1, save_steps=1000, max_length=16)
    tokenizer = load_tokenizer(base)
    model = load_causal_lm(base, training=True)
    config_cls, trainer_cls, data = (
        (SFTConfig, SFTTrainer, sft) if method == "sft" else (ORPOConfig, ORPOTrainer, prefs)
    )
    args = trl_config(config_cls, params, out, max_length=16)
    callbacks = tracking_callbacks()
    if path == "transformers":
        args.report_to = ["mlflow"]
        callbacks = []
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=Dataset.from_pandas(pd.read_parquet(data)),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="runs per method, path and parent setting")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--paths", nargs="+", default=["ours", "transformers"])
    args = parser.parse_args()

    import mlflow
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
        mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
        mlflow.set_experiment("end-wait")
        client = MlflowClient()
        base, sft, prefs = build_inputs(root)
        header = f"{'path':<13}{'parent':<8}{'method':<7}{'runs':>5}{'longest s':>11}{'median s':>10}{'over 5 s':>10}"
        print(header + "  all steps logged")
        for path in args.paths:
            for parent in (False, True):
                if parent:
                    mlflow.start_run(run_name="pipeline")
                for method in ("sft", "orpo"):
                    waits, complete = [], True
                    for i in range(args.runs):
                        run = mlflow.start_run(run_name=f"{path}-{method}-{i}", nested=parent)
                        train_once(method, path, base, sft, prefs, root / "out", args.steps)
                        start = time.perf_counter()
                        mlflow.end_run()
                        waits.append(time.perf_counter() - start)
                        # transformers' callback ends a run it started itself; ours logs into this one.
                        steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
                        complete &= steps == list(range(1, args.steps + 1))
                    over = sum(w > BOUND_S for w in waits)
                    print(
                        f"{path:<13}{str(parent):<8}{method:<7}{len(waits):>5}{max(waits):>11.3f}"
                        f"{statistics.median(waits):>10.3f}{over:>10}  {complete}",
                        flush=True,
                    )
                if parent:
                    mlflow.end_run()


if __name__ == "__main__":
    main()
