"""Stage `infer`: inference-time compute strategies on an eval suite (by default the
reported one: `test` when there is one, else the only suite).

In:  the candidate named by `infer.candidate` (sft, a policy method, or merged), models/prm
     (or `infer.prm`: MCTS's PRM and best-of-N's `prm` reward's) and models/rm (scorers),
     data/prepared/eval/<suite>.parquet; params `infer`, `task`, `compute`,
     `prepare.source`/`prepare.files` (which suite is reported).
Out: reports/infer.json (DVC metrics): per strategy, accuracy, generated tokens per problem,
     samples per problem and wall time (decoding and scoring; loading the strategy's own
     models is not counted), on the first `limit` problems of the suite (accuracy with its
     95% bootstrap interval over problems; null for a task without checkable answers);
     reports/infer_samples.json: the first few answers of each strategy, for reading.

Strategies (rlhf.inference.strategies): greedy (the baseline), best_of_n (rerank N samples with the
configured rewards, which must not need the reference answer), self_consistency (majority
vote with early stop, reported beside the full vote of the same budget), mcts (PRM-guided
step-level search), speculative (a draft model proposing tokens, when `speculative.draft`
names one) and ensemble (several candidates, logit averaging or voting).

    python -m stages.infer
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf.atomic import write_json
from rlhf.evaluation.contexts import Compress, compress_problems
from rlhf.inference.settings import STRATEGIES, Strategies
from rlhf.models.settings import ModelOverride
from rlhf.params import reject_changed
from rlhf.rules import ANSWER_REWARDS
from rlhf.tasks import Task, get_task
from stages import (
    COMPRESSOR_DIR,
    MODELS_DIR,
    PRM_DIR,
    REPORTS_DIR,
    REWARD_MODEL_DIRS,
    eval_suite_path,
    load_model_stage,
    report_suite,
)

REPORT = REPORTS_DIR / "infer.json"
SAMPLES = REPORTS_DIR / "infer_samples.json"


class Config(Strategies):
    candidate: str = Field("sft", description="model under models/ the strategies run on: sft, policy/<method>, merged")
    suite: str | None = Field(
        None, description="eval suite (data/prepared/eval/<suite>.parquet); null: the reported one (test)"
    )
    limit: int = Field(200, ge=1, description="problems evaluated (the first ones of the suite)")
    model: ModelOverride | None = Field(
        None, description="this stage's own keys of params `model` (e.g. quantization for a large candidate)"
    )
    strategies: list[Literal[STRATEGIES]] = Field(
        ["greedy", "best_of_n", "self_consistency", "mcts"], min_length=1, description="strategies to run"
    )
    compress: Compress = Field(
        default_factory=Compress,
        description="a long-context suite: greedy through each compressor too, as strategy compressed-<ratio>x",
    )
    window: int | None = Field(
        None,
        gt=0,
        description="positions the candidate reads at once (null: its max_position_embeddings); a "
        "long-context suite's contexts are cut to it",
    )

    @model_validator(mode="after")
    def _settings_of_strategies_not_run(self):
        for strategy in ("speculative", "ensemble"):
            if strategy not in self.strategies:
                reject_changed(self, [strategy], f"unless infer.strategies lists {strategy}")
        return self

    def cross_problems(self, run, section: str) -> list[str]:
        """The PRM and scorers the strategies read, and the models and suite named."""
        problems = []
        if self.prm is not None:
            problems += run.scorer_path_problems("prm", self.prm, "infer.prm")
        elif "mcts" in self.strategies:
            problems += run.need_model("strategy mcts", "prm", "infer.strategies")
        if "self_consistency" in self.strategies and not run.task.checks_answers:
            problems.append(
                f"infer.strategies: self_consistency votes on answers; task.kind {run.task.name!r} has none to vote "
                "on (remove it, or choose a task kind that reads answers)"
            )
        if "best_of_n" in self.strategies:
            for index, reward in enumerate(self.best_of_n.rewards):
                key = f"infer.best_of_n.rewards[{index}]"
                if reward.name in ANSWER_REWARDS:
                    problems.append(
                        f"{key}: {reward.name} reads the reference answer, which best-of-N must not see (it would "
                        "pick the right sample); use one that reads no answer: prm, reward_model, format, length "
                        "or repetition"
                    )
                    continue
                problems += run.format_problems(reward, key)
                if getattr(reward, "path", None) is None and not (reward.name == "prm" and self.prm is not None):
                    problems += run.need_model(f"best_of_n reward {reward.name}", reward.name, key)
                problems += run.scorer_problems(reward, key)
        # Models named under models/: what a stage writes (a typo failed after every stage,
        # with DVC's "No such file or directory" for this stage's dependency).
        written = ["sft", "merged", "champion", *(f"policy/{m}" for m in run.params["policy"].methods)]
        written += [f"rounds/{name}" for name in run.params["improve"].rounds]
        names = [("infer.candidate", self.candidate)]
        if "ensemble" in self.strategies:
            names += [(f"infer.ensemble.members[{i}]", member) for i, member in enumerate(self.ensemble.members)]
        for key, name in names:
            if name not in written:
                problems.append(
                    f"{key}: {name} is not a model a stage writes under models/ (one of {written}); name a trained "
                    "method as policy/<method>"
                )
        draft = self.speculative.draft
        if "speculative" in self.strategies and draft and not Path(draft).exists():
            problems.append(f"infer.speculative.draft: {draft} does not exist (the draft is a model folder of yours)")
        problems += compress_problems(self.compress, section, run, self.candidate)
        return problems + run.suite_problems("infer.suite", self.suite)

    @model_validator(mode="after")
    def _strategy_inputs(self):
        if "speculative" in self.strategies and not self.speculative.draft:
            raise ValueError("strategy speculative needs speculative.draft: a smaller model with the same tokenizer")
        if "ensemble" in self.strategies and len(self.ensemble.members) < 2:
            raise ValueError("strategy ensemble needs at least two ensemble.members (names under models/)")
        return self


def model_dir(name: str) -> Path:
    """A candidate's directory, named relative to models/: sft, policy/<method>, merged."""
    return MODELS_DIR / name


def summarise(task: Task, answers: list, references: list, seconds: float) -> dict:
    from rlhf.evaluation.statistics import bootstrap_interval

    scored = [(a, r) for a, r in zip(answers, references) if r is not None] if task.checks_answers else []
    correct = [float(task.is_correct(a.completion, r)) for a, r in scored]
    low, high = bootstrap_interval(correct) if correct else (None, None)
    return {
        # Null for a task without checkable answers, or a suite without them.
        "accuracy": sum(correct) / len(correct) if correct else None,
        "accuracy_low": low,
        "accuracy_high": high,
        "tokens_per_problem": sum(a.tokens for a in answers) / len(answers),
        "samples_per_problem": sum(a.samples for a in answers) / len(answers),
        "seconds": seconds,
    }


def run(config: Config, task: Task, suite_name: str) -> tuple[dict, dict]:
    import pandas as pd

    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.contexts import is_long_context, readings, window_budget
    from rlhf.inference.inputs import check_inputs
    from rlhf.inference.strategies import compressed_runner, load_strategy
    from rlhf.models.compressor import ContextCompressor, compressor_folders
    from rlhf.models.folders import check_model_dir, resolve_model_dir
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    path = eval_suite_path(suite_name)
    if not path.exists():
        raise FileNotFoundError(f"infer.suite {suite_name!r}: {path} not found; check prepare and infer.suite")
    suite = read_prepared(path, "infer", ["prompt", "answer", "context"], config.limit)
    prompts = suite["prompt"].tolist()
    references = [a if pd.notna(a) else None for a in suite["answer"]] if "answer" in suite else [None] * len(prompts)
    candidate = model_dir(config.candidate)
    check_model_dir(resolve_model_dir(candidate), f"infer.candidate {config.candidate}")
    tokenizer = load_tokenizer(candidate, config.trust_remote_code)
    members = [str(model_dir(name)) for name in config.ensemble.members]
    config = config.model_copy(update={"ensemble": config.ensemble.model_copy(update={"members": members})})
    # `infer.prm` is MCTS's PRM and best-of-N's `prm` reward's where that names no path.
    scorers = {**REWARD_MODEL_DIRS, "prm": Path(config.prm) if config.prm else PRM_DIR}
    check_inputs(config.strategies, config, tokenizer, task, scorers)
    model = load_causal_lm(candidate, config.trust_remote_code, what=f"infer.candidate {config.candidate}")
    if is_long_context(suite):  # what the candidate reads of each context without a compressor: its end
        prompts = readings(suite, tokenizer, window_budget(model, config.window, config.max_new_tokens))[""]
        prompts = prompts["prompt"].tolist()
    report = {"candidate": config.candidate, "suite": suite_name, "problems": len(prompts), "strategies": {}}
    samples = {}
    for name in config.strategies:
        runner = load_strategy(name, config, task, scorers)  # its scorers, draft or members: not timed
        start = time.perf_counter()
        answers = runner(model, tokenizer, prompts)
        report["strategies"][name] = summarise(task, answers, references, time.perf_counter() - start)
        samples[name] = [{"prompt": p, "completion": a.completion} for p, a in zip(prompts[:5], answers)]
        values = report["strategies"][name].items()
        print(f"infer {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in values if v is not None))
        if name == "self_consistency":
            # The full vote of the same budget: what early stopping is measured against.
            start = time.perf_counter()
            full = runner(model, tokenizer, prompts, early_stop=False)
            report["strategies"]["self_consistency_full"] = summarise(
                task, full, references, time.perf_counter() - start
            )
    if config.compress.enabled and is_long_context(suite):
        for folder in compressor_folders(COMPRESSOR_DIR, config.compress.tokens):
            compressor = ContextCompressor.from_pretrained(folder, model)
            runner = compressed_runner(compressor, suite["context"].tolist(), config.max_new_tokens, config.batch_size)
            start = time.perf_counter()
            answers = runner(model, tokenizer, suite["prompt"].tolist())
            name = f"compressed-{compressor.ratio:g}x"
            report["strategies"][name] = summarise(task, answers, references, time.perf_counter() - start)
            samples[name] = [{"prompt": p, "completion": a.completion} for p, a in zip(prompts[:5], answers)]
            model = compressor.model.unload()  # the candidate without the adapter, for the next compressor
    return report, samples


def main() -> None:
    import mlflow

    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_model_stage(override=lambda p: p["infer"].model, key="infer")
    config, task = params["infer"], get_task(params["task"])
    with stage_run("infer", config):
        report, samples = run(config, task, config.suite or report_suite(params))
        write_json(REPORT, report)
        write_json(SAMPLES, samples)
        mlflow.log_metrics(numeric_metrics(report["strategies"]))


if __name__ == "__main__":
    main()
