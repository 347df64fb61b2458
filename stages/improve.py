"""Stages `improve@<name>`: self-improvement rounds, one DVC stage per entry of
`improve.rounds`.

In:  models/<after> (the model the round starts from: models/sft, models/champion,
     models/policy/<method>, models/merged, or the previous round's models/rounds/<name>
     with its `round.json`), models/sft (the reference), models/prm (PRM checks and
     repairs), data/prepared (sft.parquet for replay and EWC, prompts.parquet for tasks
     without a generator, the eval suites), params `improve.defaults` and
     `improve.rounds.<name>`.
Out: models/rounds/<name> (the round's winner: the new candidate when it passed the round's
     gate, else the model it started from; with `round.json`, the round's report, and
     `kept.parquet`, every self-generated row kept so far), data/rounds/<name> (the samples
     with their verdicts, and the table the candidate trained on), reports/rounds/<name>.json.

A round, in the manner of ReST-EM (Singh et al., 2024) and of self-improving transformers
for easy-to-hard generalisation (Lee et al., 2025):

1. problems: the built-in task generates `prompts` new problems with `operands` numbers
   (the curriculum: each round a step harder), none of them in an eval suite; other tasks
   draw `prompts` rows of data/prepared/prompts.parquet;
2. the round's starting model samples `samples` completions per problem;
3. `checks` keep a sample: `answer` (the task's check against the problem's answer), `steps`
   (the task's check of every step against the problem, for a task that has one, such as
   the built-in task: a right answer reached by a wrong path fails it), `vote`
   (it states the majority answer of its problem's samples, held by at least
   `min_vote_share` of them: no answer key), `prm` (every step scored at least
   `prm_threshold` by the PRM: no answer key); a sample cut at `max_new_tokens` is never
   kept; with `refine`, a rejected sample is repaired
   from its first bad step (rlhf.inference.refine) and kept if the repair passes; `prefer`
   ranks a problem's kept samples: those passing its checks too come first (a chain that
   reaches the right answer by a path the task's step check rejects is kept, but trained on
   only where the problem has no better one);
4. the candidate is the starting model trained by `method`:
   `sft`, rejection-sampling fine-tuning on at most `keep_per_prompt` kept samples per
   problem, plus a `replay` share of earlier data (the SFT data and every earlier round's
   kept rows), optionally with EWC towards the starting weights (Fisher information of the
   earlier data); or `rpo`, iterative reasoning preference optimisation (Pang et al., 2024):
   DPO plus an NLL term on the chosen response (params `rpo`, TRL's DPOTrainer through
   stages/trl_training.py, as stage policy@dpo trains) on pairs of one problem's samples, a
   kept one chosen over one the checks rejected (at most `keep_per_prompt` pairs per
   problem, the most often sampled first), the starting model the frozen reference; a
   problem whose samples all pass, or all fail, gives no pair;
5. the candidate is evaluated on the eval suites and gated against the starting model
   (`relative_to: champion` in a round's tests means the starting model) and SFT; the
   default tests ask for a gain on `progress_suite` (on its problems of the difficulties
   `progress_difficulty` only, when set: in a curriculum, the round's own length and longer,
   so that a gain at the frontier is not diluted by lengths already mastered) and no loss beyond
   `retention_margin` on `retention_suite` (the retention suite: what a round must not lose);
6. the winner is the candidate if it passed, else the starting model, and the loop stops:
   every later round passes its start through unchanged and says where it stopped.

Settings, problems, checks, training rows and training: rlhf/training/rounds.py; evaluation,
gate and summary: rlhf/training/round_gate.py.

Changing one round's entry reruns that round and the rounds after it (their start
changed); changing `improve.defaults` reruns them all.

    python -m stages.improve r1
"""

from __future__ import annotations

import shutil
import sys
import time
from functools import partial
from pathlib import Path

from pydantic import Field, ValidationError, model_validator

from rlhf.atomic import atomic_dir, read_json, write_json
from rlhf.evaluation.gate import CapabilityTest
from rlhf.params import PARAMS_FILE, ParamsError, SafeName, StageConfig, format_validation_error
from rlhf.training.round_gate import default_tests, earlier_evals, evaluate_models, gate, metrics_only, round_summary
from rlhf.training.rounds import (
    Settings,
    data_report,
    eval_prompts,
    judge_samples,
    kept_rows,
    merged,
    nothing_kept_reason,
    operands_problem,
    repair_rejected,
    round_problems,
    round_seed,
    train_candidate,
    training_table,
)
from stages import (
    CHECKPOINTS_DIR,
    DATA_DIR,
    EVAL_DIR,
    MODELS_DIR,
    PRM_DIR,
    PROMPTS_FILE,
    REF_LOGPS_CACHE,
    REPORTS_DIR,
    SFT_DIR,
    eval_suite_path,
    eval_suites,
    load_model_stage,
    run_facts,
)

ROUNDS_DIR = MODELS_DIR / "rounds"
ROUND_DATA = Path("data/rounds")
ROUND_REPORTS = REPORTS_DIR / "rounds"
ROUND_FILE = "round.json"  # the round's report, beside the winner's weights
KEPT_FILE = "kept.parquet"  # every self-generated row kept up to this round
SFT_DATA = DATA_DIR / "sft.parquet"
PROMPTS = PROMPTS_FILE
STARTS = ("sft", "champion", "merged")  # besides policy/<method> and rounds/<earlier round>
# The model a round's KL is measured to, and where its suites are.
EVALUATED_AGAINST = {"reference": SFT_DIR, "eval_dir": EVAL_DIR}


class Config(StageConfig):
    defaults: Settings = Field(default_factory=Settings, description="every round's settings")
    rounds: dict[SafeName, dict] = Field(
        default_factory=dict,
        description="name -> {after: where the round starts, any key of defaults}; in order; {} = no rounds",
    )

    @model_validator(mode="after")
    def _check_rounds(self):
        problems, earlier = [], []
        for name, entry in self.rounds.items():
            after = (entry or {}).get("after")
            allowed = f"one of {list(STARTS)}, policy/<method>, or rounds/<an earlier round> ({earlier})"
            if after is None:
                problems.append(f"rounds.{name}.after: missing; {allowed}")
            elif not (after in STARTS or after.startswith("policy/") or after in [f"rounds/{e}" for e in earlier]):
                problems.append(f"rounds.{name}.after: {after!r} is not {allowed}")
            try:
                self.settings(name)
            except ValidationError as error:
                problems += format_validation_error(f"rounds.{name}", error)
            earlier.append(name)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def key(self, name: str, field: str) -> str:
        """The params key that sets round `name`'s `field`: its own entry's, or the default
        it inherits (the default for a round params do not list)."""
        own = field in (self.rounds.get(name) or {})
        return f"improve.rounds.{name}.{field}" if own else f"improve.defaults.{field}"

    def model_blocks(self, section: str) -> list[tuple[str, object]]:
        blocks = []
        for name in self.rounds:
            settings = self.settings(name)
            field = "rpo" if settings.method == "rpo" else "train"
            blocks.append((self.key(name, field), getattr(settings, field)))
        return blocks

    def difficulty_problems(self, run, rounds: list[str] | None = None) -> list[str]:
        """The rounds' tests (or those of `rounds` only) that name a difficulty their suite
        lacks (run.difficulties tells)."""
        problems = []
        for name in self.rounds if rounds is None else rounds:
            settings = self.settings(name)
            key = self.key(name, "tests" if settings.tests else "progress_difficulty")
            problems += [
                p for t in round_tests(settings, run.params)[1] for p in run.difficulty_problems(key, t.suite, t)
            ]
        return problems

    def cross_problems(self, run, section: str) -> list[str]:
        """Each round's checks, start, suites, tests and model, against the task and the data."""
        task, problems = run.task, []
        if self.rounds and not task.checks_answers:
            problems.append(
                f"improve.rounds: a round keeps samples and gates its candidate by their answers; task.kind "
                f"{task.name!r} has no checkable answers: choose a task kind that checks them, or set "
                "improve.rounds: {}"
            )
        methods = run.params["policy"].methods
        for name in self.rounds:
            settings, key = self.settings(name), partial(self.key, name)
            for field in ("checks", "prefer"):
                if "steps" in getattr(settings, field) and not task.checks_steps:
                    problems.append(
                        f"{key(field)}: the steps check needs a task that checks steps; task.kind {task.name!r} "
                        "does not (use answer, vote or prm)"
                    )
            if settings.operands is not None and operands_problem(task):
                problems.append(f"{key('operands')}: {operands_problem(task)}")
            if "prm" in settings.checks:
                problems += run.need_model("the prm check", "prm", key("checks"))
            if settings.refine:
                problems += run.need_model("refine", "prm", key("refine"))
            after = self.rounds[name]["after"]
            if after.startswith("policy/") and after.removeprefix("policy/") not in methods:
                problems.append(
                    f"improve.rounds.{name}.after: {after} is not trained: policy.offline and policy.online list "
                    f"{methods}; start from policy/<one of those>, or add the method"
                )
            evaluated, tests = round_tests(settings, run.params)
            if unread := sorted({t.suite for t in tests if t.suite in run.suites} - set(evaluated)):
                problems.append(
                    f"{key('suites')}: the round's tests read {unread}, which it does not evaluate ({evaluated}); "
                    "add them, or set the tests' suites"
                )
            problems += [p for s in settings.suites or [] for p in run.suite_problems(key("suites"), s)]
            problems += run.suite_problems(key("progress_suite"), settings.progress_suite)
            problems += run.suite_problems(key("retention_suite"), settings.retention_suite)
            for index, test in enumerate(settings.tests or []):  # its own tests (its defaults test accuracy only)
                problems += run.suite_problems(f"{key('tests')}[{index}].suite", test.suite)
                problems += run.metric_problems(f"{key('tests')}[{index}].metric", test.metric, test.suite)
                if not (test.suite or "").startswith("harness/"):
                    problems += run.metric_needs(test.metric, f"{key('tests')}[{index}]", "remove the test", True)
        for key, block in self.model_blocks(section):
            problems += run.adapter_problems(key, block)
        return problems + self.difficulty_problems(run)

    def settings(self, name: str) -> Settings:
        """Round `name`'s settings: the defaults with the round's own keys (but `after`)
        merged in, a nested block (train, ewc) key by key."""
        own = {k: v for k, v in (self.rounds[name] or {}).items() if k != "after"}
        return Settings.model_validate(merged(self.defaults.model_dump(mode="json"), own))


def round_tests(settings: Settings, params: dict) -> tuple[list[str], list[CapabilityTest]]:
    """The suites a round evaluates, and its gate's tests with every suite named."""
    from stages import decision_suite, eval_suites

    suites, decision = settings.suites or eval_suites(params), decision_suite(params)
    tests = settings.tests or default_tests(settings, suites, decision)
    return suites, [t if t.suite else t.model_copy(update={"suite": decision}) for t in tests]


def check_difficulties(params: dict, name: str) -> None:
    """Before any sampling: round `name`'s tests name only difficulties its suites have, as
    prepare wrote them (a user's suite file may have changed since check_params read it)."""
    import pandas as pd

    def prepared(suite: str) -> set[str] | None:
        path = EVAL_DIR / f"{suite}.parquet"
        from rlhf.evaluation.suites import table_difficulties

        return table_difficulties(pd.read_parquet(path)) if path.is_file() else None

    problems = params["improve"].difficulty_problems(run_facts(params, prepared), rounds=[name])
    if problems:
        raise ParamsError(PARAMS_FILE, problems)


def copy_model(source: Path, out_dir: Path) -> None:
    """The start's weights and tokenizer into `out_dir` (a round that did not pass)."""
    for path in source.iterdir():
        if path.is_file() and path.name not in (ROUND_FILE, KEPT_FILE):
            shutil.copy2(path, out_dir / path.name)


def run(name: str, config: Config, params: dict, task, out_dir: Path, data_dir: Path) -> dict:
    """Round `name`: the winner's weights, round.json and kept.parquet into `out_dir`, its
    samples and training table into `data_dir`; returns the round's report."""
    import pandas as pd

    settings = config.settings(name)
    after = config.rounds[name]["after"]
    start_dir = MODELS_DIR / after
    previous = read_json(start_dir / ROUND_FILE) if (start_dir / ROUND_FILE).is_file() else None
    report: dict = {"round": name, "after": after, "settings": settings.model_dump(mode="json")}
    if previous and previous.get("stopped"):
        copy_model(start_dir, out_dir)
        if (start_dir / KEPT_FILE).is_file():
            shutil.copy2(start_dir / KEPT_FILE, out_dir / KEPT_FILE)
        stopped = {k: previous[k] for k in ("stopped", "stopped_at", "winner", "sft", "winner_eval")}
        report |= {**stopped, "passed": None, "trained": False}
        print(f"round {name}: the loop stopped at round {previous['stopped_at']}: nothing to do")
        return report

    suites, tests = round_tests(settings, params)
    missing = sorted({t.suite for t in tests} - set(suites))
    if missing:
        raise ValueError(f"improve: the round's tests read suites {missing} that it does not evaluate ({suites})")
    check_difficulties(params, name)
    check_start(name, after, start_dir)
    started = time.perf_counter()
    seed = round_seed(settings.seed, name)

    # 1-3: problems, samples, checks (and repairs).
    from rlhf.models.compute import release_memory
    from rlhf.models.generation import sample
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    # No problem of any eval suite (not only those this round evaluates) is a training problem.
    exclude = eval_prompts([eval_suite_path(suite) for suite in eval_suites(params)])
    prompts, answers = round_problems(
        settings, task, params, seed, exclude, f"improve.rounds.{name}", prompts_file=PROMPTS
    )
    trust = settings.trust_remote_code
    prm = None
    if "prm" in settings.checks or settings.refine:  # before sampling: a missing PRM fails in a second
        from rlhf.rewards.prm import load_prm

        uses = [f for f, on in (("checks: [prm]", "prm" in settings.checks), ("refine", settings.refine)) if on]
        key = f"improve.rounds.{name} ({' and '.join(uses)}): the process reward model"
        prm = load_prm(PRM_DIR, trust, task.step_separator, key=key)
    tokenizer = load_tokenizer(start_dir, trust)
    model = load_causal_lm(start_dir, trust, what=str(start_dir))
    drawn = sample(
        model, tokenizer, prompts, settings.samples, settings.max_new_tokens, settings.temperature,
        settings.batch_size, seed, details=True,
    )  # fmt: skip
    samples = drawn.texts
    verdicts = judge_samples(settings, task, prompts, answers, samples, prm, finished=drawn.finished)
    repair = repair_rejected(settings, task, model, tokenizer, prm, prompts, answers, verdicts, seed)
    del model, prm  # the sampler and the PRM go before the candidate trains and is evaluated
    release_memory()

    # 4: the training table and the candidate.
    kept = pd.DataFrame(kept_rows(prompts, verdicts, settings.keep_per_prompt), columns=["prompt", "completion"])
    earlier = pd.read_parquet(start_dir / KEPT_FILE) if (start_dir / KEPT_FILE).is_file() else kept.iloc[0:0]
    all_kept = pd.concat([earlier, kept], ignore_index=True)
    train, replay_rows = training_table(settings, prompts, verdicts, kept, earlier, SFT_DATA, seed)
    sample_rows = [
        {"prompt": p, "answer": a, **row} for p, a, group in zip(prompts, answers, verdicts) for row in group
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(sample_rows).to_parquet(data_dir / "samples.parquet", index=False)
    train.to_parquet(data_dir / "train.parquet", index=False)
    all_kept.to_parquet(out_dir / KEPT_FILE, index=False)
    report["data"] = data_report(settings, prompts, verdicts, train, kept, replay_rows, repair)
    if kept.empty:
        return stop(report, name, start_dir, out_dir, previous, nothing_kept_reason(report["data"], settings))
    if train.empty:
        reason = "no problem has both a kept and a rejected sample: no pair to train on (method rpo)"
        return stop(report, name, start_dir, out_dir, previous, reason)

    candidate_dir = out_dir / "candidate"
    previous_data = start_dir / KEPT_FILE if not earlier.empty else SFT_DATA
    train_metrics, curve = train_candidate(
        settings, partial(config.key, name), start_dir, data_dir / "train.parquet", candidate_dir, f"round-{name}",
        previous_data,
        trust_remote_code=trust or params["evaluate"].trust_remote_code,
        checkpoints=CHECKPOINTS_DIR, sft_data=SFT_DATA, ref_cache=REF_LOGPS_CACHE, model=params["model"],
    )  # fmt: skip
    report["train"] = train_metrics
    report["curve"] = curve

    # 5: evaluate and gate.
    if previous is None:  # one pass loads each model once
        models = {"sft": SFT_DIR, **({"start": start_dir} if after != "sft" else {}), "candidate": candidate_dir}
        results = evaluate_models(params["evaluate"], task, models, suites, trust, **EVALUATED_AGAINST)
        sft_eval, start_eval = results["sft"], results.get("start", results["sft"])
    else:
        sft_eval, start_eval = earlier_evals(
            params["evaluate"], task, suites, previous, start_dir, trust, **EVALUATED_AGAINST
        )
        results = evaluate_models(
            params["evaluate"], task, {"candidate": candidate_dir}, suites, trust, **EVALUATED_AGAINST
        )
    verdict = gate(settings, tests, name, sft_eval, start_eval, results["candidate"])
    passed = verdict["promote"] == name
    report |= {
        "sft": sft_eval,
        "start_eval": metrics_only(start_eval),
        "candidate_eval": metrics_only(results["candidate"]),
        "tests": verdict["candidates"][name]["tests"],
        "failures": verdict["candidates"][name]["failures"],
        "passed": passed,
        "seconds": time.perf_counter() - started,
    }
    if not passed:
        shutil.rmtree(candidate_dir)
        report["winner_eval"] = start_eval
        return stop(report, name, start_dir, out_dir, previous, "; ".join(report["failures"]))
    for path in candidate_dir.iterdir():
        shutil.move(str(path), out_dir / path.name)
    candidate_dir.rmdir()
    report |= {"stopped": False, "stopped_at": None, "winner": name, "winner_eval": results["candidate"]}
    return report


def check_start(name: str, after: str, start_dir: Path) -> None:
    """The round's start holds a model (before any problem is drawn or model loaded): the
    champion's folder holds none until a candidate has passed the gate."""
    from rlhf.models.folders import UnusableModelError, check_model_dir

    if after == "champion" and not (start_dir / "config.json").is_file():
        raise UnusableModelError(
            f"improve.rounds.{name}.after: champion: {start_dir} holds no model, as no candidate has passed the "
            "gate yet; run the gate first (dvc repro gate), or start the round from sft"
        )
    check_model_dir(start_dir, f"improve.rounds.{name}.after ({after})")


def stop(report: dict, name: str, start_dir: Path, out_dir: Path, previous: dict | None, reason: str) -> dict:
    """A round that did not pass: the start is the winner and the loop stops here."""
    copy_model(start_dir, out_dir)
    report |= {
        "passed": False,
        "stopped": True,
        "stopped_at": name,
        "stop_reason": reason,
        "winner": previous["winner"] if previous else report["after"],
    }
    report.setdefault("winner_eval", previous["winner_eval"] if previous else None)
    report.setdefault("sft", previous["sft"] if previous else None)
    print(f"round {name}: stopped: {reason}")
    return report


def main(argv: list[str] | None = None) -> None:
    import mlflow

    from rlhf.tasks import get_task
    from rlhf.tracking.runs import numeric_metrics, stage_run, tracked
    from rlhf.training.trainer_setup import discard_checkpoints

    argv = sys.argv[1:] if argv is None else argv
    params = load_model_stage()
    config = params["improve"]
    if len(argv) != 1 or argv[0] not in config.rounds:
        raise SystemExit(f"usage: python -m stages.improve ROUND, ROUND one of improve.rounds {list(config.rounds)}")
    name = argv[0]
    task = get_task(params["task"])
    with stage_run(f"improve@{name}", config.settings(name)):
        with atomic_dir(ROUNDS_DIR / name) as out, atomic_dir(ROUND_DATA / name) as data:
            report = run(name, config, params, task, out, data)
            write_json(out / ROUND_FILE, report)
            if not any(data.iterdir()):  # a round the loop passed through drew nothing (DVC warns of an empty out)
                write_json(
                    data / "absent.json", {"reason": f"round {name} drew no samples: {report.get('stop_reason')}"}
                )
        discard_checkpoints(CHECKPOINTS_DIR, f"round-{name}")  # published: no longer needed to resume
        summary = round_summary(report)
        write_json(ROUND_REPORTS / f"{name}.json", summary)
        with tracked("the round's summary"):
            mlflow.log_metrics(numeric_metrics(summary))
            mlflow.set_tags({"round.passed": str(report.get("passed")), "round.winner": str(report.get("winner"))})
        print(f"round {name}: " + ", ".join(f"{k} {v}" for k, v in summary.items() if not isinstance(v, dict)))


if __name__ == "__main__":
    main()
