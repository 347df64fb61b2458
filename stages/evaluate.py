"""Stage `evaluate`: every candidate and the reference on the same held-out suites.

In:  models/sft (the reference), models/policy/<method> for each of `policy.methods`,
     models/rm (the judge), data/prepared/eval_<suite>.parquet.
Out: reports/eval.json (DVC metrics: per suite, per model), reports/samples.json (a few
     generations per model, for reading).

Per model and suite, from greedy completions: task accuracy (exact answer check), format
compliance, mean KL to the reference over the first `kl_prompts` prompts, mean RM-ensemble
reward and its disagreement (std), win-rate against the reference as judged by the RM
ensemble, distinct-1/2 and mean completion length. Definitions: rlhf.metrics.

    python -m stages.evaluate
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import pandas as pd
import torch
from pydantic import Field

from rlhf.artifacts import write_json
from rlhf.generation import generate
from rlhf.metrics import completion_kl, distinct_n, win_rate
from rlhf.modeling import load_causal_lm, load_tokenizer
from rlhf.params import StageConfig
from rlhf.reward_ensemble import RewardEnsemble
from rlhf.task import is_correct, is_well_formatted
from rlhf.tracking import numeric_metrics, stage_run
from stages import load_all

REFERENCE = "sft"
DATA_DIR = Path("data/prepared")
RM_DIR = Path("models/rm")
REPORT = Path("reports/eval.json")
SAMPLES = Path("reports/samples.json")
MERGED, MERGED_DIR = "merged", Path("models/merged")


class Config(StageConfig):
    suites: list[str] = Field(["heldout"], min_length=1, description="eval suites (data/prepared/eval_<suite>.parquet)")
    max_new_tokens: int = Field(64, gt=0, description="generation budget per completion")
    batch_size: int = Field(128, gt=0, description="prompts per generation batch")
    kl_prompts: int = Field(200, ge=0, description="prompts used for the KL estimate (0 = skip)")
    samples: int = Field(5, ge=0, description="generations per model kept in reports/samples.json")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")


def candidate_dirs(methods: list[str]) -> dict[str, Path]:
    """The models to compare: the reference first, then every policy candidate, then the
    merge of the policies when stage `merge` has written one (models/merged)."""
    dirs = {REFERENCE: Path("models") / REFERENCE, **{m: Path("models/policy") / m for m in methods}}
    if (MERGED_DIR / "config.json").is_file():
        dirs[MERGED] = MERGED_DIR
    return dirs


def evaluate_suite(config: Config, models: dict, tokenizer, judge: RewardEnsemble, suite: pd.DataFrame):
    prompts = suite["prompt"].tolist()
    # Parquet gives NaN/None for a missing answer: those prompts count for every metric but accuracy.
    answers = [a if pd.notna(a) else None for a in suite["answer"]] if "answer" in suite else [None] * len(prompts)
    completions = {
        name: generate(model, tokenizer, prompts, config.max_new_tokens, config.batch_size)
        for name, model in models.items()
    }
    rewards = {name: judge.score(prompts, texts) for name, texts in completions.items()}
    kl_n = min(config.kl_prompts, len(prompts))
    results = {}
    for name, texts in completions.items():
        checked = [is_correct(t, a) for t, a in zip(texts, answers) if a is not None]
        kl = (
            completion_kl(models[name], models[REFERENCE], tokenizer, prompts[:kl_n], texts[:kl_n])
            if kl_n and name != REFERENCE
            else torch.zeros(1)
        )
        results[name] = {
            "accuracy": sum(checked) / len(checked) if checked else None,
            "format_rate": sum(map(is_well_formatted, texts)) / len(texts),
            "kl_to_ref": float(kl.mean()),
            "reward": float(rewards[name].mean.mean()),
            "reward_std": float(rewards[name].std.mean()),
            "win_rate": win_rate(rewards[name].mean, rewards[REFERENCE].mean),
            "distinct_1": distinct_n(texts, 1),
            "distinct_2": distinct_n(texts, 2),
            "mean_length": sum(len(t) for t in texts) / len(texts),
        }
    samples = {
        name: [{"prompt": p, "completion": c} for p, c in zip(prompts[: config.samples], texts)]
        for name, texts in completions.items()
    }
    return results, samples


def run(config: Config, methods: list[str]) -> tuple[dict, dict]:
    dirs = candidate_dirs(methods)
    tokenizer = load_tokenizer(dirs[REFERENCE], config.trust_remote_code)
    models = {name: load_causal_lm(path, config.trust_remote_code, what=str(path)) for name, path in dirs.items()}
    judge = RewardEnsemble.load(RM_DIR, config.trust_remote_code)
    report: dict = {"reference": REFERENCE, "candidates": [n for n in dirs if n != REFERENCE], "suites": {}}
    samples: dict = {}
    for suite_name in config.suites:
        path = DATA_DIR / f"eval_{suite_name}.parquet"
        if not path.exists():
            raise FileNotFoundError(f"eval suite {suite_name!r}: {path} not found; check evaluate.suites and prepare")
        start = time.perf_counter()
        report["suites"][suite_name], samples[suite_name] = evaluate_suite(
            config, models, tokenizer, judge, pd.read_parquet(path)
        )
        report["suites"][suite_name]["seconds"] = time.perf_counter() - start
    return report, samples


def main() -> None:
    params = load_all()
    config, methods = params["evaluate"], params["policy"].methods
    candidates = [n for n in candidate_dirs(methods) if n != REFERENCE]
    with stage_run("evaluate", config, tags={"candidates": ",".join(candidates)}):
        report, samples = run(config, methods)
        write_json(REPORT, report)
        write_json(SAMPLES, samples)
        mlflow.log_metrics(numeric_metrics(report["suites"]))
        mlflow.log_artifact(str(REPORT))
        for suite, results in report["suites"].items():
            for name, metrics in results.items():
                if isinstance(metrics, dict):
                    print(
                        f"evaluate[{suite}] {name}: "
                        + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if v is not None)
                    )


if __name__ == "__main__":
    main()
