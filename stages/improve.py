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

Settings, problems, checks and training rows: rlhf/training/rounds.py.

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

from rlhf.artifacts import atomic_dir, read_json, write_json
from rlhf.evaluation.gate import CapabilityTest
from rlhf.params import PARAMS_FILE, ParamsError, SafeName, StageConfig, format_validation_error
from rlhf.training.rounds import (
    Settings,
    eval_prompts,
    judge_samples,
    kept_rows,
    majority,
    operands_problem,
    preference_pairs,
    round_problems,
    sft_rows,
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
# What a round's summary keeps of each suite's metrics.
ACCURACY_KEYS = (
    "accuracy", "accuracy_low", "accuracy_high", "accuracy_by_difficulty", "accuracy_by_difficulty_interval",
)  # fmt: skip


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


def round_seed(seed: int, name: str) -> int:
    """A round's seed: `seed` plus a number from the round's name, so that rounds draw
    different problems and samples, and a round's draw does not depend on the others."""
    import zlib

    return seed + zlib.crc32(name.encode()) % 100_000


def merged(base: dict, own: dict) -> dict:
    out = dict(base)
    for key, value in own.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def nothing_kept_reason(data: dict, settings: Settings) -> str:
    """Why a round stops with no kept sample, with the likely cause when every sample was
    cut at max_new_tokens (never kept): too few tokens, or a model that does not end its
    reply with the EOS token generation stops at."""
    reason = "no sample passed the checks: nothing to train on"
    if data["samples"] and data["unfinished_samples"] == data["samples"]:
        reason += (
            f" (every one of the {data['samples']} samples was cut at max_new_tokens {settings.max_new_tokens} before "
            "it ended: raise max_new_tokens, or check that the model ends its reply with its tokenizer's EOS token, "
            "e.g. a chat model's end-of-turn token)"
        )
    return reason


# ----------------------------------------------------------------------------- evaluation


def evaluate_models(
    params: dict, task, models: dict[str, Path], suites: list[str], trust_remote_code: bool = False
) -> dict:
    """{name: {suite: {"metrics", "outcomes", "digest"}}} of each model on each suite, greedy,
    with KL to SFT (params `evaluate`; custom modelling code with its or the caller's
    `trust_remote_code`)."""
    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.suites import SUITE_COLUMNS, evaluate_model, suite_identity
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    config = params["evaluate"]
    trust = config.trust_remote_code or trust_remote_code
    tokenizer = load_tokenizer(SFT_DIR, trust)
    reference = load_causal_lm(SFT_DIR, trust, what="models/sft")
    tables = {suite: read_prepared(EVAL_DIR / f"{suite}.parquet", "improve", SUITE_COLUMNS) for suite in suites}
    identities = {suite: suite_identity(table) for suite, table in tables.items()}
    results: dict = {}
    for name, path in models.items():
        model = reference if path == SFT_DIR else load_causal_lm(path, trust, what=str(path))
        results[name] = {}
        for suite, table in tables.items():
            metrics, outcomes, _, _ = evaluate_model(config, task, model, reference, tokenizer, None, table, None)
            results[name][suite] = {"metrics": metrics, "outcomes": outcomes, **identities[suite]}
        del model
    return results


def round_tests(settings: Settings, params: dict) -> tuple[list[str], list[CapabilityTest]]:
    """The suites a round evaluates, and its gate's tests with every suite named."""
    from stages import decision_suite, eval_suites

    suites, decision = settings.suites or eval_suites(params), decision_suite(params)
    tests = settings.tests or default_tests(settings, suites, decision)
    return suites, [t if t.suite else t.model_copy(update={"suite": decision}) for t in tests]


def default_tests(settings: Settings, suites: list[str], decision: str) -> list[CapabilityTest]:
    progress = settings.progress_suite or ("dev_long" if "dev_long" in suites else decision)
    retention = settings.retention_suite or decision
    at = "" if settings.progress_difficulty is None else "@" + ",".join(settings.progress_difficulty)
    tests = [
        CapabilityTest(
            name=f"progress{at}",
            metric="accuracy",
            suite=progress,
            difficulty=settings.progress_difficulty,
            relative_to="champion",
            op=">",
        )
    ]
    tests.append(
        CapabilityTest(
            name="retention",
            metric="accuracy",
            suite=retention,
            relative_to="sft",
            op=">=",
            threshold=-settings.retention_margin,
        )
    )
    return tests


def gate(settings: Settings, tests, name: str, sft: dict, start: dict, candidate: dict) -> dict:
    """The round's verdict (rlhf.evaluation.gate.decide): `candidate` against SFT and
    against the round's start as the champion, paired on the same problems."""
    from rlhf.evaluation.gate import decide

    suites = list(candidate)
    report = {
        "reference": "sft",
        "candidates": [name],
        "suites": {s: {"sft": sft[s]["metrics"], name: candidate[s]["metrics"]} for s in suites},
    }
    outcomes = {
        "suites": {
            s: {
                "digest": candidate[s]["digest"],
                "difficulty": candidate[s].get("difficulty"),
                "models": {"sft": sft[s]["outcomes"], name: candidate[s]["outcomes"]},
            }
            for s in suites
        }
    }
    champion = {
        "metrics": {s: start[s]["metrics"] for s in suites},
        "outcomes": {s: {"digest": start[s]["digest"], "values": start[s]["outcomes"]} for s in suites},
    }
    select = tests[0].suite
    confidence, resamples = settings.confidence, settings.bootstrap_samples
    return decide(
        tests, report, champion, "accuracy", select, outcomes, confidence, resamples, champion_name="the round's start"
    )


# ----------------------------------------------------------------------------- the round


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
    del model

    # 4: the training table and the candidate.
    kept = pd.DataFrame(kept_rows(prompts, verdicts, settings.keep_per_prompt), columns=["prompt", "completion"])
    earlier = pd.read_parquet(start_dir / KEPT_FILE) if (start_dir / KEPT_FILE).is_file() else kept.iloc[0:0]
    all_kept = pd.concat([earlier, kept], ignore_index=True)
    if settings.method == "rpo":  # pairs of this round's samples, no replay (the reference anchors)
        pairs = preference_pairs(prompts, verdicts, settings.keep_per_prompt)
        train, replay_rows = pd.DataFrame(pairs, columns=["prompt", "chosen", "rejected"]), 0
    else:
        pool = pd.concat([sft_rows(SFT_DATA), earlier], ignore_index=True)
        replay_rows = min(len(pool), round(len(kept) * settings.replay / (1 - settings.replay)))
        train = pd.concat([kept, pool.sample(n=replay_rows, random_state=seed)], ignore_index=True)
    sample_rows = [
        {"prompt": p, "answer": a, **row} for p, a, group in zip(prompts, answers, verdicts) for row in group
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(sample_rows).to_parquet(data_dir / "samples.parquet", index=False)
    train.to_parquet(data_dir / "train.parquet", index=False)
    all_kept.to_parquet(out_dir / KEPT_FILE, index=False)
    # The model's own samples (repairs are counted under `repair`).
    flat = [row for group in verdicts for row in group if row.get("source") != "refined"]
    report["data"] = {
        "problems": len(prompts),
        "samples": len(flat),
        "kept_samples": sum(row["kept"] for row in flat),
        # cut at max_new_tokens before they ended: never kept
        "unfinished_samples": sum(not row["finished"] for row in flat),
        "kept_share": _mean([row["kept"] for row in flat]),
        "problems_with_a_kept_sample": _mean([any(r["kept"] for r in g) for g in verdicts]),
        "sample_accuracy": _mean([row["correct"] for row in flat if row["correct"] is not None]),
        "kept_accuracy": _mean([row["correct"] for row in flat if row["kept"] and row["correct"] is not None]),
        **(
            {
                "kept_preferred_samples": sum(row["kept"] and row["preferred"] for row in flat),
                "problems_with_a_preferred_sample": _mean(
                    [any(r["kept"] and r["preferred"] for r in g) for g in verdicts]
                ),
            }
            if settings.prefer
            else {}
        ),
        "training_rows": len(train),
        "new_rows": len(kept),
        "replay_rows": replay_rows,
        "repair": repair,
    }
    if kept.empty:
        return stop(report, name, start_dir, out_dir, previous, nothing_kept_reason(report["data"], settings))
    if train.empty:
        reason = "no problem has both a kept and a rejected sample: no pair to train on (method rpo)"
        return stop(report, name, start_dir, out_dir, previous, reason)

    candidate_dir = out_dir / "candidate"
    previous_data = start_dir / KEPT_FILE if not earlier.empty else SFT_DATA
    train_metrics, curve = train_candidate(
        settings, params, start_dir, data_dir / "train.parquet", candidate_dir, f"round-{name}", previous_data
    )
    report["train"] = train_metrics
    report["curve"] = curve

    # 5: evaluate and gate.
    if previous is None:  # one pass loads each model once
        models = {"sft": SFT_DIR, **({"start": start_dir} if after != "sft" else {}), "candidate": candidate_dir}
        results = evaluate_models(params, task, models, suites, trust)
        sft_eval, start_eval = results["sft"], results.get("start", results["sft"])
    else:
        sft_eval, start_eval = earlier_evals(params, task, suites, previous, start_dir, trust)
        results = evaluate_models(params, task, {"candidate": candidate_dir}, suites, trust)
    verdict = gate(settings, tests, name, sft_eval, start_eval, results["candidate"])
    passed = verdict["promote"] == name
    report |= {
        "sft": sft_eval,
        "start_eval": _metrics_only(start_eval),
        "candidate_eval": _metrics_only(results["candidate"]),
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


def earlier_evals(params, task, suites: list[str], previous: dict, start_dir: Path, trust: bool):
    """(SFT's, the start's) evaluation on `suites`, from the report of the round before (the
    start): a suite that round did not evaluate (this round evaluates more) is evaluated here."""
    sft_eval, start_eval = dict(previous["sft"]), dict(previous["winner_eval"])
    if missing := [s for s in suites if s not in sft_eval]:
        sft_eval |= evaluate_models(params, task, {"sft": SFT_DIR}, missing, trust)["sft"]
    if missing := [s for s in suites if s not in start_eval]:
        start_eval |= evaluate_models(params, task, {"start": start_dir}, missing, trust)["start"]
    return sft_eval, start_eval


def train_candidate(
    settings: Settings, params: dict, start: Path, table: Path, out_dir: Path, stage: str, previous_data: Path
) -> tuple[dict, list[dict]]:
    """The round's candidate, `start` trained on `table` by `settings.method` into `out_dir`
    (checkpoints under checkpoints/<stage>): sft on kept rows (EWC, when on, with the Fisher
    information of `previous_data`), or rpo on pairs with `start` as the reference."""
    name = stage.removeprefix("round-")  # the caller's f"round-{name}"
    if settings.method == "rpo":
        from rlhf.training.methods import dpo
        from rlhf.training.trl_training import TrainingJob

        job = TrainingJob(
            stage=stage,
            key=params["improve"].key(name, "rpo"),
            start=start,
            data=table,
            checkpoints=CHECKPOINTS_DIR,
            trust_remote_code=settings.trust_remote_code or params["evaluate"].trust_remote_code,
            sft_data=SFT_DATA,
            ref_cache=REF_LOGPS_CACHE,
        )
        return dpo.train(job, settings.rpo, out_dir)
    from rlhf.training.methods.sft import train_sft

    ewc = (settings.ewc, previous_data) if settings.ewc.strength else None
    train = settings.train
    if settings.trust_remote_code:
        train = train.model_copy(update={"trust_remote_code": True})
    return train_sft(train, start, table, out_dir, CHECKPOINTS_DIR, stage, ewc, params["improve"].key(name, "train"))


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


def repair_rejected(settings: Settings, task, model, tokenizer, prm, prompts, answers, verdicts, seed) -> dict | None:
    """With `refine`: each rejected sample repaired from its first bad step; a repair that
    passes the checks is kept (source `refined`). Returns the repair report."""
    if not settings.refine:
        return None
    from rlhf.inference.refine import refine, repair_report

    rejected = [(i, j) for i, group in enumerate(verdicts) for j, row in enumerate(group) if not row["kept"]]
    if not rejected:
        return {"flagged": 0, "repaired": 0}
    results = refine(
        model, tokenizer, prm, task,
        [prompts[i] for i, _ in rejected], [verdicts[i][j]["completion"] for i, j in rejected],
        threshold=settings.prm_threshold, attempts=settings.refine_attempts,
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
        batch_size=settings.batch_size, seed=seed, answers=[answers[i] for i, _ in rejected],
    )  # fmt: skip
    repaired = [(i, r.refined) for (i, _), r in zip(rejected, results) if r.status == "repaired"]
    if repaired:
        own = [[row["completion"] for row in verdicts[i] if row.get("source") != "refined"] for i, _ in repaired]
        rechecked = judge_samples(
            settings, task, [prompts[i] for i, _ in repaired], [answers[i] for i, _ in repaired],
            [[text] for _, text in repaired], prm, votes=[majority(task, group) for group in own],
        )  # fmt: skip
        for (i, _), [row] in zip(repaired, rechecked):
            verdicts[i].append({**row, "source": "refined"})
    report = repair_report(results, [answers[i] for i, _ in rejected], task)
    report["kept_after_repair"] = sum(row.get("source") == "refined" and row["kept"] for g in verdicts for row in g)
    return report


def _mean(values) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


def _metrics_only(results: dict) -> dict:
    return {suite: entry["metrics"] for suite, entry in results.items()}


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


def round_summary(report: dict) -> dict:
    """The round's headline numbers (reports/rounds/<name>.json, a DVC metric)."""
    summary = {
        "passed": report.get("passed"),
        "stopped": report.get("stopped"),
        "stopped_at": report.get("stopped_at"),
        "winner": report.get("winner"),
        "data": {k: v for k, v in (report.get("data") or {}).items() if not isinstance(v, dict)},
    }
    if report.get("data", {}).get("repair"):
        summary["repair"] = report["data"]["repair"]
    for role in ("candidate_eval", "start_eval"):
        if report.get(role):
            summary[role] = {suite: {k: m.get(k) for k in ACCURACY_KEYS} for suite, m in report[role].items()}
    if report.get("failures"):
        summary["failures"] = report["failures"]
    return summary


if __name__ == "__main__":
    main()
