"""Stage `evaluate`: every candidate and the reference on the same eval suites.

In:  models/sft (the reference), models/policy/<method> for each policy method,
     models/merged (when stage merge wrote one), models/rm (the judge), models/base
     (scored only when `evaluate.baselines` names it: the model as it came, a row to
     compare with, never a candidate: its accuracy, format and text metrics, with its own
     generation budget `baseline_max_new_tokens`; no reward, win-rate or KL),
     data/prepared/eval/<suite>.parquet for each of `evaluate.suites`.
Out: reports/eval.json (DVC metrics: per suite, per model), reports/outcomes.json (per
     problem, per model: what the gate's paired tests read; with each problem's difficulty), reports/samples.json (a few
     generations per model, for reading), reports/completions.json (every greedy completion,
     for stage validate), plots/evaluate/<suite>.csv (accuracy per model: bar plots).

Per model and suite, from greedy completions: task accuracy (the task's answer check) with
its 95% bootstrap interval over problems and its value per difficulty (the suite's
`difficulty` column: the built-in task's number of operands), format compliance (tasks
that define a format), mean KL to the reference over the first `kl_prompts` prompts, mean
RM-ensemble reward and its disagreement (std), win-rate against the reference as judged by
the RM ensemble, distinct-1/2 and mean completion length. Definitions: rlhf.evaluation.

Which suite is for what: the built-in task writes `dev` (tuning, the gate, the greedy soup)
and `test` (reported only; no decision reads it). With `evaluate.suites: null` every suite
prepare wrote is evaluated; a user with one suite gets it in both roles, and the report's
`roles` says so. A task without checkable answers (kind none) reports accuracy null; with
no reward model (no preference data) reward and win-rate are null. The reference and one
candidate are in memory at a time, on `compute.device` in `compute.dtype`.

lm-evaluation-harness (`evaluate.harness`): any harness task, and the eval suites as local
harness tasks, on every model; scores land under suite `harness/<task>`, where gate tests
can read them (rlhf.evaluation.harness).

    python -m stages.evaluate
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from rlhf.atomic import atomic_dir, write_csv, write_json
from rlhf.evaluation.contexts import (
    Compress,
    compress_problems,
    compressed_name,
    evaluate_compressed,
    is_long_context,
    readings,
    window_budget,
)
from rlhf.evaluation.suites import evaluate_model, suite_identity
from rlhf.models.settings import ModelOverride
from rlhf.params import SafeName, StageConfig
from rlhf.tasks import get_task
from stages import (
    COMPRESSOR_DIR,
    MERGED_DIR,
    MODELS_DIR,
    REPORTS_DIR,
    RM_DIR,
    candidate_dir,
    decision_suite,
    eval_suite_path,
    eval_suites,
    load_model_stage,
    report_suite,
)

REFERENCE = "sft"
MERGED = "merged"
REPORT = REPORTS_DIR / "eval.json"
OUTCOMES = REPORTS_DIR / "outcomes.json"
SAMPLES = REPORTS_DIR / "samples.json"
COMPLETIONS = REPORTS_DIR / "completions.json"  # every greedy completion: what stage validate reads
PLOTS = Path("plots/evaluate")  # <suite>.csv: accuracy per model, the bar plots of `dvc plots show`
HARNESS_PREFIX = "harness/"  # report["suites"] key of a harness task's scores


class Harness(StageConfig):
    """lm-evaluation-harness tasks run on every model (rlhf.evaluation.harness). Their
    scores land in reports/eval.json as suite `harness/<task>`, so a gate test can ask
    for no regression on them (point estimates, with lm-eval's stderr beside them)."""

    tasks: list[str] = Field(default_factory=list, description="lm-eval task names (its registry or include_path)")
    include_path: str | None = Field(None, description="a folder of your own harness task YAMLs")

    @field_validator("include_path")
    @classmethod
    def _is_folder(cls, value):
        if value is not None and not Path(value).is_dir():
            raise ValueError(f"{value} is not a folder; point it at a folder of lm-eval task YAMLs")
        return value

    suites: list[str] = Field(
        default_factory=list, description="eval suites also run as harness tasks rlhf_<suite> (a cross-check)"
    )
    limit: int | None = Field(None, gt=0, description="problems per task (null: all)")
    apply_chat_template: bool = Field(False, description="format prompts with the tokenizer's chat template")


class Config(StageConfig):
    suites: list[SafeName] | None = Field(
        None, min_length=1, description="eval suites (data/prepared/eval/<suite>.parquet); null: every one"
    )
    max_new_tokens: int = Field(
        128, gt=0, description="generation budget per completion (fit the longest solution: a cut one is wrong)"
    )
    batch_size: int = Field(128, gt=0, description="prompts per generation batch")
    kl_prompts: int = Field(200, ge=0, description="prompts used for the KL estimate (0 = skip)")
    samples: int = Field(5, ge=0, description="generations per model kept in reports/samples.json")
    confidence: float = Field(0.95, gt=0, lt=1, description="level of the bootstrap intervals")
    bootstrap_samples: int = Field(2000, ge=100, description="bootstrap resamples per interval")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")
    model: ModelOverride | None = Field(
        None, description="this stage's own keys of params `model` (e.g. quantization for large candidates)"
    )
    harness: Harness | None = Field(None, description="lm-evaluation-harness tasks (null: none)")
    compress: Compress = Field(
        default_factory=Compress,
        description="long-context suites: the context cut to the model's window, the relevant sentences, and "
        "compressed (rlhf/evaluation/contexts.py)",
    )
    window: int | None = Field(
        None,
        gt=0,
        description="positions a model reads at once (null: its max_position_embeddings); long-context "
        "suites are cut to it",
    )
    baselines: list[Literal["base"]] = Field(
        default_factory=list,
        description="models scored beside the candidates and never gated: base (the model as it came, before SFT); "
        "accuracy, format and text metrics only (no reward, win-rate or KL)",
    )
    baseline_max_new_tokens: int | None = Field(
        None,
        gt=0,
        description="the baselines' generation budget (null: max_new_tokens): an instruct model as it came answers "
        "in prose, longer than the fine-tuned solutions",
    )

    def cross_problems(self, run, section: str) -> list[str]:
        """The suites named, and, with `suites` set, that they hold the ones the validator
        and the gate read from the eval report (each defaults to the decision suite):
        otherwise validate finds no completions and every gate test a missing metric, after
        the whole evaluation."""
        harness = self.harness
        problems = compress_problems(self.compress, section, run)
        if harness and harness.suites and not run.task.checks_answers:
            problems.append(
                f"evaluate.harness.suites: a suite run as a harness task is scored by its answers; task.kind "
                f"{run.task.name!r} checks none (remove the suites, or choose a task kind that reads answers)"
            )
        for suite in self.suites or []:
            problems += run.suite_problems("evaluate.suites", suite)
        for suite in harness.suites if harness else []:
            problems += run.suite_problems("evaluate.harness.suites", suite)
        if self.suites is None:
            return problems
        gate = run.params["gate"]
        readers = [("validate.suite", run.params["validate"].suite), ("gate.select_suite", gate.select_suite)]
        readers += [(f"gate.tests[{i}].suite", t.suite) for i, t in enumerate(gate.tests or [])]
        if gate.tests is None:
            readers.append(("gate.tests", None))
        fix = "add it to evaluate.suites, or set evaluate.suites: null (every suite)"
        problems += [
            f"{key}: suite {suite!r} is read from the eval report, but evaluate.suites is {list(self.suites)}; {fix}"
            for key, suite in readers
            if suite is not None and suite not in self.suites and not suite.startswith("harness/")
        ]
        defaulted = [key for key, suite in readers if suite is None]
        if defaulted and run.decision not in self.suites:
            problems.append(
                f"evaluate.suites: {list(self.suites)} leaves out the decision suite {run.decision!r}, which "
                f"{', '.join(defaulted)} read by default; {fix}"
            )
        return problems


def candidate_dirs(methods: list[str]) -> dict[str, Path]:
    """The models to compare: the reference first, then every policy candidate, then the
    merge of the policies when stage `merge` has written one (models/merged)."""
    dirs = {REFERENCE: candidate_dir(REFERENCE), **{m: candidate_dir(m) for m in methods}}
    if (MERGED_DIR / "config.json").is_file():
        dirs[MERGED] = MERGED_DIR
    return dirs


def baseline_dirs(config: Config) -> dict[str, Path]:
    """The models `evaluate.baselines` names, scored as the candidates are but never gated."""
    return {name: MODELS_DIR / name for name in config.baselines}


def harness_tasks(config: Config, task_config, workdir: Path) -> tuple[list[str], list[str]]:
    """The harness task names to run and the folders to find them in: the user's tasks,
    and each of `harness.suites` written as a local task `rlhf_<suite>` into `workdir`."""
    from rlhf.evaluation.harness import write_suite_task

    harness = config.harness
    names, folders = list(harness.tasks), []
    for suite in harness.suites:
        write_suite_task(
            eval_suite_path(suite).resolve(), f"rlhf_{suite}", workdir,
            max_new_tokens=config.max_new_tokens, task_config=task_config,
        )  # fmt: skip
        names.append(f"rlhf_{suite}")
    if harness.suites:
        folders.append(str(workdir))
    if harness.include_path:
        folders.append(harness.include_path)
    return names, folders


def run(
    config: Config, task, methods: list[str], suite_names: list[str], task_config=None
) -> tuple[dict, dict, dict, dict]:
    """The eval report, the per-problem outcomes and the samples on `suite_names`. The
    reference stays loaded (for KL); candidates are loaded one at a time. Without a reward
    model (no preference data) reward and win-rate are null."""
    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.suites import SUITE_COLUMNS
    from rlhf.models.compute import release_memory
    from rlhf.models.folders import absent_reason
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.ensemble import RewardEnsemble

    dirs = {**candidate_dirs(methods), **baseline_dirs(config)}
    suites = {}
    for name in suite_names:
        path = eval_suite_path(name)
        if not path.exists():
            raise FileNotFoundError(
                f"evaluate.suites: {name!r} has no {path}; prepare writes one per eval suite "
                f"(the built-in task: dev and test; files: prepare.files.eval_{name})"
            )
        suites[name] = read_prepared(path, "evaluate", [*SUITE_COLUMNS, "context", "relevant"])
    workdir = tempfile.TemporaryDirectory() if config.harness else None
    if config.harness:  # suite tasks written and task names looked up before any model loads
        from rlhf.evaluation.harness import load_tasks

        names, folders = harness_tasks(config, task_config, Path(workdir.name))
        load_tasks(names, folders or None)
    tokenizer = load_tokenizer(dirs[REFERENCE], config.trust_remote_code)
    reference = load_causal_lm(dirs[REFERENCE], config.trust_remote_code, what=str(dirs[REFERENCE]))
    long_suites = {name: s for name, s in suites.items() if is_long_context(s)}
    budget = window_budget(reference, config.window, config.max_new_tokens) if long_suites else 0
    suites = {
        f"{name}{suffix}": frame
        for name, suite in suites.items()
        for suffix, frame in (readings(suite, tokenizer, budget) if name in long_suites else {"": suite}).items()
    }
    # The judge scores every model's completions after the models are freed (`judged`).
    judge = None if absent_reason(RM_DIR) else RewardEnsemble.load(RM_DIR, config.trust_remote_code, resident=False)
    baselines = list(baseline_dirs(config))
    report: dict = {
        "reference": REFERENCE,
        "candidates": [n for n in dirs if n != REFERENCE and n not in baselines],
        "baselines": baselines,
        "suites": {},
    }
    outcomes: dict = {"suites": {name: {**suite_identity(s), "models": {}} for name, s in suites.items()}}
    samples: dict = {name: {} for name in suites}
    completions: dict = {"suites": {n: {"prompts": s["prompt"].tolist(), "models": {}} for n, s in suites.items()}}
    for model_name, path in dirs.items():
        model = reference if model_name == REFERENCE else load_causal_lm(path, config.trust_remote_code, what=str(path))
        baseline = model_name in baselines  # scored for what it answers: no judge, no KL to the reference
        for suite_name, suite in suites.items():
            start = time.perf_counter()
            metrics, per_problem, _, texts = evaluate_model(
                config, task, model, None if baseline else reference, tokenizer, None, suite, None,
                max_new_tokens=config.baseline_max_new_tokens if baseline else None,
            )  # fmt: skip
            metrics["seconds"] = time.perf_counter() - start
            report["suites"].setdefault(suite_name, {})[model_name] = metrics
            outcomes["suites"][suite_name]["models"][model_name] = per_problem
            if model_name not in baselines:  # what validate checks: the candidates against the reference
                completions["suites"][suite_name]["models"][model_name] = texts
            samples[suite_name][model_name] = [
                {"prompt": p, "completion": c} for p, c in zip(suite["prompt"][: config.samples], texts)
            ]
        if config.harness:
            from rlhf.evaluation.harness import run_harness

            scores = run_harness(
                model, tokenizer, names, include_path=folders or None, limit=config.harness.limit,
                batch_size=config.batch_size, apply_chat_template=config.harness.apply_chat_template,
            )  # fmt: skip
            for name, metrics in scores.items():
                report["suites"].setdefault(f"{HARNESS_PREFIX}{name}", {})[model_name] = metrics
        del model
    del reference
    release_memory()
    judged(config, judge, suites, completions, report, outcomes)
    if workdir:
        workdir.cleanup()
    if config.compress.enabled and long_suites:
        compressed(config, task, tokenizer, long_suites, dirs, report, outcomes, samples)
    return report, outcomes, samples, completions


def judged(config: Config, judge, suites: dict, completions: dict, report: dict, outcomes: dict) -> None:
    """The judge's reward and win rate (against the reference) for each candidate and suite,
    scored after generation has freed every model: one call of the ensemble over all their
    completions (each member loaded once, alone), not a member beside the reference and a
    candidate. Baselines are not judged (`completions` holds the candidates' texts only):
    they get the same keys, empty, as every model does without a judge."""
    from rlhf.evaluation.suites import judge_metrics
    from rlhf.rewards.ensemble import EnsembleScores

    texts = completions["suites"]
    spans, prompts, answers = [], [], []
    for suite_name in suites:
        for model_name, completed in texts[suite_name]["models"].items():
            spans.append((suite_name, model_name, len(answers), len(answers) + len(completed)))
            prompts += texts[suite_name]["prompts"]
            answers += completed
    scores = judge.score(prompts, answers) if judge is not None and answers else None
    rewards = {(suite, model): None if scores is None else EnsembleScores(scores.members[:, start:end])
               for suite, model, start, end in spans}  # fmt: skip
    for suite_name in suites:
        reference = rewards.get((suite_name, REFERENCE))
        for model_name, metrics in report["suites"][suite_name].items():
            judge_metrics(config, metrics, outcomes["suites"][suite_name]["models"][model_name],
                          rewards.get((suite_name, model_name)), None if reference is None else reference.mean)  # fmt: skip


def compressed(config: Config, task, tokenizer, long_suites: dict, dirs: dict, report, outcomes, samples) -> None:
    """Each long-context suite read through each compressor of stage compress by the model
    it serves (rlhf.evaluation.contexts), into the report as suite
    `<suite>/compressed-<ratio>x`."""
    from rlhf.models.compressor import ContextCompressor, compressor_folders
    from rlhf.models.loading import load_causal_lm

    for folder in compressor_folders(COMPRESSOR_DIR, config.compress.tokens):
        served = Path(ContextCompressor.read_config(folder)["served"]["path"])
        name = next((n for n, path in dirs.items() if Path(path) == served), served.name)
        compressor = ContextCompressor.from_pretrained(
            folder, load_causal_lm(served, config.trust_remote_code, what=str(served))
        )
        for suite_name, suite in long_suites.items():
            start = time.perf_counter()
            metrics, per_problem, texts = evaluate_compressed(config, task, compressor, tokenizer, suite)
            metrics["seconds"] = time.perf_counter() - start
            key = compressed_name(suite_name, compressor.ratio)
            report["suites"].setdefault(key, {})[name] = metrics
            outcomes["suites"].setdefault(key, {**suite_identity(suite), "models": {}})["models"][name] = per_problem
            samples.setdefault(key, {})[name] = [
                {"prompt": p, "completion": c} for p, c in zip(suite["prompt"][: config.samples], texts)
            ]
        del compressor


def log_models(report: dict, methods: list[str], config: Config) -> None:
    """Each eval suite as an MLflow dataset input of the run, and each model evaluated as an
    MLflow logged model (external: DVC keeps the weights) with its metrics on each suite
    linked to it and to that dataset."""
    from rlhf.tracking.runs import log_model_metrics, log_table, numeric_metrics

    dirs = {**candidate_dirs(methods), **baseline_dirs(config)}
    datasets = {
        suite: log_table(eval_suite_path(suite.split("/")[0]), "evaluation")
        for suite in report["suites"]
        if not suite.startswith(HARNESS_PREFIX)
    }
    for name, path in dirs.items():
        scored = [
            (numeric_metrics({suite: results[name]}), datasets.get(suite))
            for suite, results in report["suites"].items()
            if name in results
        ]
        log_model_metrics(name, path, scored)


def print_report(report: dict) -> None:
    for suite, results in report["suites"].items():
        if suite.startswith(HARNESS_PREFIX):
            for name, metrics in results.items():
                print(f"evaluate[{suite}] {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
            continue
        for name, metrics in results.items():
            accuracy = metrics.get("accuracy")
            interval = (
                f" [{metrics['accuracy_low']:.3f}, {metrics['accuracy_high']:.3f}]" if accuracy is not None else ""
            )
            accuracy_text = f"{accuracy:.3f}{interval}" if accuracy is not None else "n/a"
            reward = metrics.get("reward")
            reward_text = f"{reward:.3f}" if reward is not None else "n/a"
            print(
                f"evaluate[{suite}] {name}: accuracy {accuracy_text}, reward {reward_text}, "
                f"kl {'n/a' if metrics.get('kl_to_ref') is None else format(metrics['kl_to_ref'], '.3f')}"
            )


def accuracy_bars(report: dict) -> dict[str, list[dict]]:
    """Per eval suite (harness tasks left out), a row per model with a task accuracy:
    model, accuracy and its interval; suites with no accuracy (kind none) are left out."""
    bars = {}
    for suite, models in report["suites"].items():
        rows = [
            {"model": model, **{key: m.get(key) for key in ("accuracy", "accuracy_low", "accuracy_high")}}
            for model, m in models.items()
            if isinstance(m, dict) and isinstance(m.get("accuracy"), int | float)
        ]
        if rows and not suite.startswith(HARNESS_PREFIX):
            bars[suite] = rows
    return bars


def scorer_versions() -> dict:
    """The versions (dvc.lock hashes) of the models that score every candidate: the reward
    model (reward, its std, win-rate) and the reference (KL, win-rate). The gate compares a
    candidate with the champion's recorded values only when they were scored by the same."""
    from rlhf.lockfile import output_hash

    return {"rm": output_hash(RM_DIR), "reference": output_hash(candidate_dir(REFERENCE))}


def main() -> None:
    import mlflow

    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_model_stage(override=lambda p: p["evaluate"].model, key="evaluate")
    config, methods, task = params["evaluate"], params["policy"].methods, get_task(params["task"])
    candidates = [n for n in candidate_dirs(methods) if n != REFERENCE]
    with stage_run("evaluate", config, tags={"candidates": ",".join(candidates)}):
        report, outcomes, samples, completions = run(
            config, task, methods, config.suites or eval_suites(params), params["task"]
        )
        report["roles"] = {"decision": decision_suite(params), "report": report_suite(params)}
        report["scorers"] = scorer_versions()
        if report["roles"]["decision"] == report["roles"]["report"]:
            report["roles"]["note"] = (
                "one suite serves decisions (the gate, the greedy soup) and reports: its numbers are not an "
                "untouched test; add prepare.files.eval_test (reported only) and eval_dev (decisions)"
            )
        write_json(REPORT, report)
        write_json(OUTCOMES, outcomes)
        write_json(SAMPLES, samples)
        write_json(COMPLETIONS, completions)
        with atomic_dir(PLOTS) as plots:
            for suite, rows in accuracy_bars(report).items():
                write_csv(plots / f"{suite.replace('/', '-')}.csv", rows)
        mlflow.log_metrics(numeric_metrics(report["suites"]))
        mlflow.log_artifact(str(REPORT))
        log_models(report, methods, config)
        print_report(report)


if __name__ == "__main__":
    main()
