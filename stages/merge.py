"""Stage `merge`: merge the policy candidates into one more candidate, models/merged.

In:  models/policy/<method> for each of `merge.models` (default: every policy method),
     models/<merge.base> (sft or base) as the base of task-vector methods and the source of
     the merged model's config and tokenizer, data/prepared/eval/<greedy_soup_suite>.parquet
     (greedy soup's score: the dev suite, never the reported test suite).
Out: models/merged (a plain Hugging Face model directory, safetensors, with the base's
     tokenizer), metrics/merge.json (method, members, weights, and greedy soup's trace).

`evaluate` and `gate` treat models/merged as the candidate named `merged`, like any policy.

The merges are mergekit's (rlhf.models.merging): linear (a uniform soup with equal weights),
task_arithmetic, ties, dare_ties, dare_linear, and slerp (exactly two models), each with
optional per-layer weights (a list of values interpolated from the first layer to the last).
Ours on top is greedy soup (Wortsman et al. 2022): candidates sorted by held-out accuracy,
each added to the uniform average only if the soup's accuracy does not drop (the paper's
``>=``). The score is greedy-decoding task accuracy (the task's answer check) on the first
`greedy_soup_prompts` problems of the dev suite, the split that tuning and the gate use; the
test suite stays untouched and is only reported by `evaluate`.

Before any compute, every model is checked to share the base's architecture, weight shapes
and tokenizer; the error names the models and what differs.

    python -m stages.merge
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from rlhf.atomic import atomic_dir, write_json
from rlhf.models.folders import resolve_model_dir
from rlhf.params import ParamsError, StageConfig, reject_unused
from rlhf.tasks import Task, get_task
from stages import MERGED_DIR, MODELS_DIR, POLICY_DIR, decision_suite, eval_suite_path, load_model_stage

OUT_DIR = MERGED_DIR
METRICS = Path("metrics/merge.json")

Method = Literal["linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "slerp", "greedy_soup"]
LayerWeight = float | list[float]


class Config(StageConfig):
    method: Method = Field(
        "linear", description="linear | task_arithmetic | ties | dare_ties | dare_linear | slerp | greedy_soup"
    )
    models: list[str] | None = Field(
        None, min_length=1, description="policy methods to merge (each trained: policy.offline/online); null = all"
    )
    base: Literal["sft", "base"] = Field("sft", description="models/<base>: task vectors' origin, config and tokenizer")
    weights: list[LayerWeight] | None = Field(
        None, description="one per model: a number, or a list interpolated across layers; null = 1.0 each"
    )
    density: float = Field(0.5, gt=0, le=1, description="ties/dare: fraction of each task vector kept")
    t: LayerWeight = Field(0.5, description="slerp: 0 = first model, 1 = second; or a list across layers")
    normalize: bool | None = Field(
        None, description="divide by the sum of weights; null = method default (linear, ties: on)"
    )
    int8_mask: bool = Field(False, description="task-vector methods: int8 sign masks (saves memory)")
    greedy_soup_suite: str | None = Field(
        None, description="greedy_soup: the eval suite it scores on; null: the decision suite (dev), never test"
    )
    greedy_soup_prompts: int = Field(200, gt=0, description="greedy_soup: problems of that suite scored (the first)")
    max_new_tokens: int = Field(64, gt=0, description="greedy_soup: generation budget per completion")
    batch_size: int = Field(128, gt=0, description="greedy_soup: prompts per generation batch")
    seed: int = Field(0, description="seed of DARE's random drops")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")

    @field_validator("models")
    @classmethod
    def _check_models(cls, value, info: ValidationInfo):
        if value is None:
            return value
        if len(set(value)) != len(value):
            raise ValueError(f"models are listed twice: {value}")
        if info.data.get("method") == "slerp" and len(value) != 2:
            raise ValueError(f"slerp interpolates exactly 2 models, got {len(value)}: {value}")
        return value

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, value, info: ValidationInfo):
        if value is None:
            return value
        method = info.data.get("method")
        if method in ("slerp", "greedy_soup"):
            raise ValueError(f"not used by {method} ({'set merge.t' if method == 'slerp' else 'a uniform average'})")
        if any(isinstance(w, list) and not w for w in value):
            raise ValueError("a per-layer weight list is empty")
        models = info.data.get("models")
        if models is not None and len(value) != len(models):
            raise ValueError(f"{len(value)} weights for {len(models)} models in merge.models {models}")
        return value

    @field_validator("t")
    @classmethod
    def _check_t(cls, value):
        values = value if isinstance(value, list) else [value]
        if not values or any(not 0 <= v <= 1 for v in values):
            raise ValueError(f"must be in [0, 1] (or a non-empty list of such values), got {value}")
        return value

    @model_validator(mode="after")
    def _keys_of_other_methods(self):
        # greedy_soup_suite stays allowed: dvc.yaml names its file as the stage's dep.
        reads = {
            "density": self.method in ("ties", "dare_ties", "dare_linear"),
            "int8_mask": self.method in ("task_arithmetic", "ties", "dare_ties", "dare_linear"),
            "t": self.method == "slerp",
            # greedy_soup averages (always normalised) and slerp interpolates: null (the
            # method's default, as params.yaml has it) only
            "normalize": self.method not in ("slerp", "greedy_soup") or self.normalize is None,
            "seed": self.method in ("dare_ties", "dare_linear"),
            "greedy_soup_prompts": self.method == "greedy_soup",
            "max_new_tokens": self.method == "greedy_soup",
            "batch_size": self.method == "greedy_soup",
        }
        reject_unused(self, [key for key, read in reads.items() if not read], f"by merge method {self.method}")
        return self

    def cross_problems(self, run, section: str) -> list[str]:
        """The members, against the trained methods; greedy_soup's answers and suite."""
        problems = []
        try:
            member_names(self, run.params["policy"].methods)
        except ParamsError as error:
            problems += error.problems
        if self.method == "greedy_soup" and not run.task.checks_answers:
            problems.append(
                f"merge.method: greedy_soup adds a model to the soup when it raises task accuracy; task.kind "
                f"{run.task.name!r} checks no answers (choose another merge method, or a task kind that reads answers)"
            )
        return problems + run.suite_problems("merge.greedy_soup_suite", self.greedy_soup_suite)


def member_names(config: Config, methods: list[str]) -> list[str]:
    """The policy candidates to merge, checked against the trained methods: what Config alone
    cannot check, as it needs the policy section. Raises one ParamsError listing every problem."""
    names = list(config.models) if config.models is not None else list(methods)
    source = "merge.models" if config.models is not None else "every policy method (merge.models is null)"
    problems = []
    unknown = [n for n in names if n not in methods]
    if unknown:
        problems.append(
            f"merge.models: {unknown} not in policy.offline + policy.online {methods}: "
            "only trained policies can be merged"
        )
    if config.method == "slerp" and len(names) != 2:
        problems.append(f"merge.models: slerp interpolates exactly 2 models, got {len(names)} from {source}: {names}")
    if config.weights is not None and len(config.weights) != len(names):
        problems.append(f"merge.weights: {len(config.weights)} weights for {len(names)} models from {source}: {names}")
    if problems:
        raise ParamsError("params.yaml", problems)
    return names


def prompt_accuracy(config: Config, task: Task, tokenizer, prompts: Path) -> Callable:
    """score(model) = greedy-decoding task accuracy on the first `greedy_soup_prompts`
    prompts of `prompts` that have an answer."""
    from rlhf.data.prepared import read_prepared
    from rlhf.models.generation import generate

    table = read_prepared(prompts, "merge")
    if "answer" in table:
        table = table[table["answer"].notna()]
    if "answer" not in table or table.empty:
        raise ValueError(f"greedy_soup scores task accuracy, but {prompts} has no answers; use another merge.method")
    table = table.head(config.greedy_soup_prompts)
    texts, answers = table["prompt"].tolist(), table["answer"].tolist()

    def score(model) -> float:
        completions = generate(model, tokenizer, texts, config.max_new_tokens, config.batch_size)
        return sum(task.is_correct(c, a) for c, a in zip(completions, answers)) / len(answers)

    return score


def run(
    config: Config,
    task: Task,
    members: dict[str, Path],
    base_dir: Path,
    prompts: Path,
    out_dir: Path,
    score: Callable | None = None,
) -> dict:
    """Merge `members` (name -> model dir) into `out_dir`; returns the metrics. `score`
    replaces greedy soup's prompt accuracy (tests)."""
    from rlhf.models.loading import load_tokenizer, stored_dtype
    from rlhf.models.merging import (
        SPARSIFYING_METHODS,
        TASK_VECTOR_METHODS,
        check_compatible,
        greedy_soup,
        merge_configuration,
        run_mergekit,
    )

    start = time.perf_counter()
    base = resolve_model_dir(base_dir)
    dirs = {name: resolve_model_dir(path) for name, path in members.items()}
    check_compatible({config.base: base, **dirs}, config.trust_remote_code)
    metrics: dict = {"method": config.method, "base": config.base}
    method, names, weights = config.method, list(dirs), config.weights
    if method == "greedy_soup":
        tokenizer = load_tokenizer(base, config.trust_remote_code)
        soup = greedy_soup(dirs, score or prompt_accuracy(config, task, tokenizer, prompts), config.trust_remote_code)
        metrics["greedy_soup"] = {
            "score": soup.score,
            "individual": soup.individual,
            "trace": soup.trace,
            "suite": Path(prompts).stem,
            "prompts": config.greedy_soup_prompts,
        }
        method, names, weights = "linear", soup.members, [1.0] * len(soup.members)
    weights = weights if weights is not None else [1.0] * len(names)
    mergekit_config = merge_configuration(
        method,
        [dirs[n] for n in names],
        weights,
        base if method in TASK_VECTOR_METHODS else None,
        density=config.density,
        t=config.t,
        normalize=True if config.method == "greedy_soup" else config.normalize,
        int8_mask=config.int8_mask,
        out_dtype=stored_dtype(base),
    )
    run_mergekit(mergekit_config, out_dir, base, config.seed, config.trust_remote_code)
    metrics |= {"members": names, "seconds": time.perf_counter() - start}
    if method == "slerp":
        metrics["t"] = config.t
    else:
        metrics["weights"] = weights
    if method in SPARSIFYING_METHODS:
        metrics["density"] = config.density
    return metrics


def main() -> None:
    import mlflow

    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_model_stage()
    config, methods, task = params["merge"], params["policy"].methods, get_task(params["task"])
    names = member_names(config, methods)
    soup_suite = eval_suite_path(config.greedy_soup_suite or decision_suite(params))
    with stage_run("merge", config, tags={"members": ",".join(names)}):
        with atomic_dir(OUT_DIR) as tmp:
            members = {n: POLICY_DIR / n for n in names}
            metrics = run(config, task, members, MODELS_DIR / config.base, soup_suite, tmp)
        write_json(METRICS, metrics)
        mlflow.log_metrics(numeric_metrics(metrics))
        mlflow.log_artifact(str(METRICS))
        print(f"merge: {config.method} of {metrics['members']} -> {OUT_DIR}")


if __name__ == "__main__":
    main()
