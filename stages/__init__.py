"""The pipeline's DVC stages, one module each (`python -m stages.<name>`).

`SECTIONS` maps each params.yaml section to the class that defines it (a stage module's
`Config`, or the task's), so the whole file can be validated at once (`load_all`) before any
stage does work: every stage validates every section, and a typo anywhere fails the first
stage in a second. For that to take a second, a stage module imports only light modules at
its top (pydantic, the params blocks of `rlhf`); torch, transformers and TRL are imported in
the functions that train or generate.

The pipeline's folders are named here and in the stage modules only: the library (`rlhf`)
takes paths from its callers.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from functools import partial
from pathlib import Path

from rlhf.params import PARAMS_FILE, InputError, ParamsError, read_params, validate_params


def report_input_errors(kind, error, trace) -> None:
    """sys.excepthook of every stage process: an error in what the user gave
    (rlhf.params.InputError: params, a data file, a model path) is printed as its message
    alone, after the stage's name, since the message says what to fix and a traceback would
    bury it; any other error keeps its traceback. The process still exits with status 1."""
    if isinstance(error, InputError):
        script, text = Path(sys.argv[0]) if sys.argv else Path(), str(error)
        prefix = f"{script.stem}: " if script.suffix == ".py" else ""
        print(text if text.startswith(prefix) else prefix + text, file=sys.stderr)  # not "sft: sft: ..."
    else:
        sys.__excepthook__(kind, error, trace)


sys.excepthook = report_input_errors

SECTIONS = {
    "task": "rlhf.tasks:TaskConfig",
    "compute": "rlhf.models.compute:ComputeConfig",
    "model": "rlhf.models.settings:ModelSettings",
    "prepare": "stages.prepare:Config",
    "base": "stages.base:Config",
    "sft": "stages.sft:Config",
    "verifier": "stages.verifier:Config",
    "rm": "stages.rm:Config",
    "prm": "stages.prm:Config",
    "policy": "stages.policy:Config",
    "merge": "stages.merge:Config",
    "evaluate": "stages.evaluate:Config",
    "validate": "stages.validate:Config",
    "gate": "stages.gate:Config",
    "infer": "stages.infer:Config",
    "improve": "stages.improve:Config",
}

DATA_DIR = Path("data/prepared")
EVAL_DIR = DATA_DIR / "eval"  # one <suite>.parquet per eval suite
EVAL_PREFIX = "eval_"  # prepare.files.eval_<suite>: the user's file of eval suite <suite>
MODELS_DIR = Path("models")
SFT_DIR = MODELS_DIR / "sft"
RM_DIR = MODELS_DIR / "rm"
PRM_DIR = MODELS_DIR / "prm"
POLICY_DIR = MODELS_DIR / "policy"
MERGED_DIR = MODELS_DIR / "merged"
CHAMPION_DIR = MODELS_DIR / "champion"
# Outside DVC's outputs (DVC deletes those before a stage runs), so a killed stage resumes.
CHECKPOINTS_DIR = Path("checkpoints")
REF_LOGPS_CACHE = Path("cache/ref_logps")
REPORTS_DIR = Path("reports")
# Folders of the model-based rewards and scorers that name no `path` of their own.
REWARD_MODEL_DIRS = {"reward_model": RM_DIR, "prm": PRM_DIR}


def config_class(section: str) -> type:
    module, name = SECTIONS[section].split(":")
    return getattr(importlib.import_module(module), name)


def all_configs() -> dict:
    return {section: config_class(section) for section in SECTIONS}


def load_all(path: str = PARAMS_FILE) -> dict:
    """Every section of params.yaml, validated, and checked against the data the params
    provide (`input_problems`); raises one ParamsError listing all problems."""
    params = validate_params(read_params(path), all_configs(), path)
    problems = input_problems(params)
    if problems:
        raise ParamsError(path, problems)
    return params


# ----------------------------------------------------------------------------- eval suites
# The decision suite (tuning, the gate, the greedy soup) is `dev` when there is one; the
# reported suite (infer) is `test` when there is one. A user with a single eval suite gets
# it in both roles, and the eval report says so.


def eval_suites(params: dict) -> list[str]:
    """The eval suites prepare writes, from params `prepare`."""
    return sorted(name[len(EVAL_PREFIX) :] for name in params["prepare"].given() if name.startswith(EVAL_PREFIX))


def decision_suite(params: dict) -> str:
    suites = eval_suites(params)
    return "dev" if "dev" in suites else suites[0]


def report_suite(params: dict) -> str:
    suites = eval_suites(params)
    return "test" if "test" in suites else decision_suite(params)


def unevaluated_suites(params: dict) -> list[str]:
    """With `evaluate.suites` set, the suites the validator and the gate read from the eval
    report must be among them (each defaults to the decision suite): otherwise validate
    finds no completions and every gate test a missing metric, after the whole evaluation."""
    evaluated = params["evaluate"].suites
    if evaluated is None:
        return []
    gate = params["gate"]
    readers = [("validate.suite", params["validate"].suite), ("gate.select_suite", gate.select_suite)]
    readers += [(f"gate.tests[{i}].suite", t.suite) for i, t in enumerate(gate.tests or [])]
    if gate.tests is None:
        readers.append(("gate.tests", None))
    fix = "add it to evaluate.suites, or set evaluate.suites: null (every suite)"
    problems = [
        f"{key}: suite {suite!r} is read from the eval report, but evaluate.suites is {list(evaluated)}; {fix}"
        for key, suite in readers
        if suite is not None and suite not in evaluated and not suite.startswith("harness/")
    ]
    defaulted = [key for key, suite in readers if suite is None]
    decision = decision_suite(params)
    if defaulted and decision not in evaluated:
        problems.append(
            f"evaluate.suites: {list(evaluated)} leaves out the decision suite {decision!r}, which "
            f"{', '.join(defaulted)} read by default; {fix}"
        )
    return problems


# ----------------------------------------------------------------------------- inputs

ANSWER_REWARDS = ("answer_match", "numeric_tolerance")


def builtin_difficulties(params: dict, suite: str) -> set[str] | None:
    """The difficulties (numbers of operands) of a suite the built-in task generates; None
    for a suite from a file (`suite_difficulties` reads it) or none."""
    prepare = params["prepare"]
    if f"eval_{suite}" in prepare.files:
        return None
    return generated_difficulties(prepare, suite)


def generated_difficulties(prepare, suite: str) -> set[str] | None:
    """The numbers of operands of the built-in task's problems in `suite`; None when the
    built-in task does not generate that suite."""
    builtin = prepare.builtin
    generated = {"dev", "test"} | ({"dev_long", "test_long"} if builtin.long_operands else set())
    if prepare.source != "builtin" or suite not in generated:
        return None
    low, high = builtin.long_operands if suite.endswith("_long") else (builtin.min_operands, builtin.max_operands)
    return {str(n) for n in range(low, high + 1)}


def table_difficulties(table) -> set[str]:
    """The difficulty labels of a suite's answered problems (a frame); empty without the column."""
    from rlhf.evaluation.suites import answer_difficulty

    return set(answer_difficulty(table) or [])


def suite_file(params: dict, suite: str):
    """The problems of a suite that come from a local file (prepare.files.eval_<suite>), read
    from that file; None for a suite with no such file, a Hub dataset, or a file that does
    not read (prepare names its problems)."""
    from rlhf.data.contracts import DataValidationError, load_contract

    spec = params["prepare"].files.get(f"eval_{suite}")
    if spec is None or not Path(spec.path).exists():
        return None
    try:
        return load_contract(spec.path, "prompts", spec.columns, split=spec.split, config=spec.config)
    except (DataValidationError, OSError, ValueError):
        return None


def suite_difficulties(params: dict, suite: str) -> set[str] | None:
    """The difficulties of a suite whose problems come from a local file (`suite_file`, with
    the built-in task's when source is builtin); None where no such file reads."""
    frame = suite_file(params, suite)
    if frame is None:
        return None
    return table_difficulties(frame) | (generated_difficulties(params["prepare"], suite) or set())


def round_key(improve, name: str, field: str) -> str:
    """The params key that sets round `name`'s `field`: its own entry's, or the default it
    inherits (the default for a round params do not list)."""
    own = field in (improve.rounds.get(name) or {})
    return f"improve.rounds.{name}.{field}" if own else f"improve.defaults.{field}"


def difficulty_problems(params: dict, difficulties, rounds: list[str] | None = None) -> list[str]:
    """The gate's and the rounds' tests (or those of `rounds` only) that name a difficulty
    their suite lacks, each with the key to change. `difficulties(suite)` gives a suite's
    labels, or None where they are not known here (that suite is not checked)."""
    gate, improve = params["gate"], params["improve"]
    tested = []
    if rounds is None:
        tested += [(f"gate.tests[{i}]", t.suite or decision_suite(params), t) for i, t in enumerate(gate.tests or [])]
    for name in improve.rounds if rounds is None else rounds:
        settings = improve.settings(name)
        key = round_key(improve, name, "tests" if settings.tests else "progress_difficulty")
        tested += [(key, t.suite, t) for t in improve.round_tests(settings, params)[1]]
    problems, known = [], {}
    for key, suite, test in tested:
        if test.difficulty is None:
            continue
        if suite not in known:
            known[suite] = difficulties(suite)
        labels = known[suite]
        unknown = sorted(set(test.difficulty) - labels) if labels is not None else []
        if unknown:
            shown = ", ".join(sorted(labels, key=lambda x: (0, int(x), "") if x.isdecimal() else (1, 0, x)))
            problems.append(
                f"{key}: suite {suite!r} has no problem of difficulty {','.join(unknown)} (its difficulties: "
                f"{shown or 'none: no answered problem has a difficulty'}); name those, or null for every problem"
            )
    return list(dict.fromkeys(problems))  # a key that every round inherits, once


def prm_available(params: dict, task) -> bool:
    """Given step labels, or a task whose answers let stage prm derive them."""
    return "prm" in params["prepare"].available() or task.checks_answers


def format_reward_problem(key: str, task) -> str:
    """A format reward without a pattern, for a task that defines no format."""
    return (
        f"{key}: the format reward needs a pattern: task {task.name!r} defines no format; give the reward a "
        "`pattern` (a regular expression a well-formed reply matches), set task.format_pattern, or remove the entry"
    )


def model_blocks(params: dict) -> list[tuple[str, object]]:
    """(params key, block) of every section or block that loads a model and may carry its
    own `model:` keys."""
    blocks = [("sft", params["sft"]), ("verifier", params["verifier"]), ("rm", params["rm"]), ("prm", params["prm"])]
    policy = params["policy"]
    blocks += [(f"policy.{m}", getattr(policy, m)) for m in policy.methods]
    improve = params["improve"]
    for name in improve.rounds:
        settings = improve.settings(name)
        method_key = "rpo" if settings.method == "rpo" else "train"
        blocks.append((round_key(improve, name, method_key), getattr(settings, method_key)))
    return blocks + [("evaluate", params["evaluate"]), ("infer", params["infer"])]


def model_problems(params: dict) -> list[str]:
    """What params `model` (and the stages' own `model:` blocks) ask that a stage cannot do:
    quantized weights where a stage trains in full (quantized weights train only through
    LoRA adapters: QLoRA), and settings PPO's own loop cannot follow."""
    base = params["model"]
    problems = []
    for key, block in model_blocks(params):
        settings = base.merged(getattr(block, "model", None))
        if key == "policy.ppo" and settings.gradient_checkpointing:
            problems.append(
                "policy.ppo.model.gradient_checkpointing: PPO (ours) runs its models in eval mode (no dropout), where "
                "transformers does not checkpoint activations: set it to false"
            )
        if settings.quantization is None or key in ("evaluate", "infer"):
            continue
        if key == "policy.ppo" or (key == "prm" and block.kind == "classifier"):
            what = "PPO trains its value model" if key == "policy.ppo" else "prm.kind classifier trains its new head"
            problems.append(
                f"{key}.model.quantization: {what} in full, which quantized weights cannot: set it to false"
            )
        elif key == "prm":
            continue  # the likelihood kind reads the LM: quantized is fine
        elif not block.lora.enabled:
            problems.append(
                f"{key}.lora.enabled: the model loads {settings.quantization.bits}-bit (model.quantization) and "
                f"quantized weights train only through adapters (QLoRA): set {key}.lora.enabled: true, or "
                f"{key}.model.quantization: false"
            )
    return problems


def package_problems(params: dict) -> list[str]:
    """What the params need installed on this machine that is not (found without importing
    it): the attention implementation's and quantization's packages (params `model` and the
    stages' own blocks), vLLM for an online method that generates with it, lm-eval for
    evaluate.harness. Stage check_params asks (this machine's), not the params validation."""
    from rlhf.models.settings import package_problems as loading_problems

    base = params["model"]
    problems = loading_problems(base)
    for key, block in model_blocks(params):
        own = getattr(block, "model", None)
        if own is not None:
            problems += [p for p in loading_problems(base.merged(own), f"{key}.model") if p not in problems]
        if getattr(block, "trl", {}).get("use_vllm") and importlib.util.find_spec("vllm") is None:
            problems.append(
                f"{key}.trl.use_vllm: TRL generates with vLLM, which is not installed: pip install vllm (a CUDA "
                "machine; TRL's supported versions), or remove use_vllm"
            )
    if params["evaluate"].harness and importlib.util.find_spec("lm_eval") is None:
        problems.append(
            "evaluate.harness: needs lm-evaluation-harness, which is not installed: pip install "
            "'rlhf-pipeline[harness]' (or lm-eval), or set evaluate.harness: null"
        )
    return problems


def input_problems(params: dict) -> list[str]:
    """What the params ask for that the data they provide cannot feed, each naming the key
    to change or the file to add (prepare.files.<name>)."""
    from rlhf.tasks import get_task
    from rlhf.training.methods import METHODS

    task = get_task(params["task"])
    available = params["prepare"].available()
    suites = eval_suites(params)
    problems: list[str] = []

    def need_model(what: str, name: str, key: str) -> None:
        if name == "reward_model" and "prefs" not in available:
            problems.append(
                f"{key}: {what} needs the reward model, which needs preference data: add prepare.files.prefs"
            )
        if name == "prm" and not prm_available(params, task):
            problems.append(
                f"{key}: {what} needs a process reward model: add prepare.files.prm (step labels), or use a "
                f"task whose answers can be checked (task.kind), from which stage prm derives them"
            )

    from rlhf.models.folders import scorer_problem

    def check_scorer(reward, key: str) -> None:
        """A model-based reward's own `path`: a folder that holds another kind of model, or
        one under models/ that no stage writes (a typo), named before any stage trains; and
        an uncertainty penalty on an ensemble of one member (its std is 0: no penalty)."""
        path = getattr(reward, "path", None)
        if path is None:
            if getattr(reward, "uncertainty_penalty", 0) > 0 and params["rm"].num_members == 1:
                problems.append(
                    f"{key}.uncertainty_penalty: the ensemble's spread is 0 with rm.num_members 1, so the penalty "
                    "does nothing; train several members (rm.num_members), or remove it"
                )
            return
        scorer_path_problem(reward.name, path, f"{key}.path")

    def scorer_path_problem(kind: str, path, key: str) -> None:
        """A scorer folder a param names: one of another kind or a PRM of another step
        separator, or one under models/ that no stage writes (a typo)."""
        written = REWARD_MODEL_DIRS[kind]
        if problem := scorer_problem(kind, path, task.step_separator if kind == "prm" else None):
            problems.append(f"{key}: {problem}")
        elif not Path(path).exists() and Path(path).parts[:1] == (MODELS_DIR.name,) and Path(path) != written:
            problems.append(f"{key}: {path} does not exist, and no stage writes it (the pipeline's is {written})")

    def need_answers(what: str, key: str) -> None:
        if not task.checks_answers:
            problems.append(f"{key}: {what} needs checkable answers; task.kind {task.name!r} has none")

    policy = params["policy"]
    for method in policy.offline:
        data = METHODS[method].DATA
        if data not in available:
            problems.append(
                f"policy.offline: {method} needs {data} data: add prepare.files.prefs (prompt, chosen, rejected), "
                f"or remove {method} from policy.offline"
            )
    for method in policy.online:
        settings = getattr(policy, method)
        for index, reward in enumerate(settings.rewards):
            key = f"policy.{method}.rewards[{index}]"
            if reward.name in ANSWER_REWARDS:
                need_answers(f"reward {reward.name}", key)
            if getattr(reward, "path", None) is None:
                need_model(f"reward {reward.name}", reward.name, key)
            check_scorer(reward, key)
            if reward.name == "format" and reward.pattern is None and not task.has_format:
                problems.append(format_reward_problem(key, task))
        if method == "ppo" and settings.value_init == "rm":
            need_model("value_init rm", "reward_model", "policy.ppo.value_init")
        processes = params["compute"].processes
        if method == "ppo" and settings.rollout_batch_size % processes:
            problems.append(
                f"policy.ppo.rollout_batch_size: {settings.rollout_batch_size} is not a multiple of compute.processes "
                f"({processes}): each process samples an equal share of the batch"
            )
    infer = params["infer"]
    if infer.prm is not None:
        scorer_path_problem("prm", infer.prm, "infer.prm")
    elif "mcts" in infer.strategies:
        need_model("strategy mcts", "prm", "infer.strategies")
    if "self_consistency" in infer.strategies and not task.checks_answers:
        problems.append(
            f"infer.strategies: self_consistency votes on answers; task.kind {task.name!r} has none to vote on "
            "(remove it, or choose a task kind that reads answers)"
        )
    if "best_of_n" in infer.strategies:
        for index, reward in enumerate(infer.best_of_n.rewards):
            if reward.name in ANSWER_REWARDS:
                problems.append(
                    f"infer.best_of_n.rewards[{index}]: {reward.name} reads the reference answer, which best-of-N "
                    "must not see (it would pick the right sample); use one that reads no answer: prm, reward_model, "
                    "format, length or repetition"
                )
                continue
            if reward.name == "format" and reward.pattern is None and not task.has_format:
                problems.append(format_reward_problem(f"infer.best_of_n.rewards[{index}]", task))
            if getattr(reward, "path", None) is None and not (reward.name == "prm" and infer.prm is not None):
                need_model(f"best_of_n reward {reward.name}", reward.name, f"infer.best_of_n.rewards[{index}]")
            check_scorer(reward, f"infer.best_of_n.rewards[{index}]")
    # Models infer names under models/: what a stage writes (a typo failed after every
    # stage, with DVC's "No such file or directory" for the infer stage's dependency).
    written = ["sft", "merged", "champion", *(f"policy/{m}" for m in policy.methods)]
    written += [f"rounds/{name}" for name in params["improve"].rounds]
    names = [("infer.candidate", infer.candidate)]
    if "ensemble" in infer.strategies:
        names += [(f"infer.ensemble.members[{i}]", member) for i, member in enumerate(infer.ensemble.members)]
    for key, name in names:
        if name not in written:
            problems.append(
                f"{key}: {name} is not a model a stage writes under models/ (one of {written}); name a trained "
                "method as policy/<method>"
            )
    draft = infer.speculative.draft
    if "speculative" in infer.strategies and draft and not Path(draft).exists():
        problems.append(f"infer.speculative.draft: {draft} does not exist (the draft is a model folder of yours)")
    harness = params["evaluate"].harness
    if harness and harness.suites and not task.checks_answers:
        problems.append(
            f"evaluate.harness.suites: a suite run as a harness task is scored by its answers; task.kind "
            f"{task.name!r} checks none (remove the suites, or choose a task kind that reads answers)"
        )
    try:
        params["merge"].member_names(policy.methods)
    except ParamsError as error:
        problems += error.problems
    if params["merge"].method == "greedy_soup" and not task.checks_answers:
        problems.append(
            f"merge.method: greedy_soup adds a model to the soup when it raises task accuracy; task.kind "
            f"{task.name!r} checks no answers (choose another merge method, or a task kind that reads answers)"
        )
    named = [("evaluate.suites", s) for s in params["evaluate"].suites or []]
    named += [("evaluate.harness.suites", s) for s in (harness.suites if harness else [])]
    harness_suites = {f"harness/{t}" for t in (harness.tasks if harness else [])}
    harness_suites |= {f"harness/rlhf_{s}" for s in (harness.suites if harness else [])}
    named += [("infer.suite", infer.suite), ("merge.greedy_soup_suite", params["merge"].greedy_soup_suite)]
    named += [("gate.select_suite", params["gate"].select_suite), ("validate.suite", params["validate"].suite)]
    named += [(f"gate.tests[{i}].suite", t.suite) for i, t in enumerate(params["gate"].tests or [])]
    improve = params["improve"]
    for name in improve.rounds:  # a round's suites (an inherited default named once)
        settings, key = improve.settings(name), partial(round_key, improve, name)
        named += [(key("suites"), s) for s in settings.suites or []]
        named += [(key("progress_suite"), settings.progress_suite), (key("retention_suite"), settings.retention_suite)]
        named += [(f"{key('tests')}[{i}].suite", t.suite) for i, t in enumerate(settings.tests or [])]
    for key, suite in dict.fromkeys(named):
        if suite is None or suite in suites:
            continue
        if suite in harness_suites and key.startswith("gate."):  # the gate reads the harness's scores too
            continue
        if suite in harness_suites:
            problems.append(
                f"{key}: {suite!r} is an lm-evaluation-harness score, not a suite of problems this stage can run; "
                f"name one of {suites}"
            )
            continue
        problems.append(
            f"{key}: no eval suite {suite!r} (prepare writes {suites}); add prepare.files.eval_{suite} "
            "or name one of those (null: the default role)"
        )
    problems += unevaluated_suites(params)
    problems += model_problems(params)
    gate = params["gate"]
    if not task.checks_answers and "prefs" not in available and (gate.tests is None or gate.select_metric is None):
        problems.append(
            f"gate: task.kind {task.name!r} has no checkable answers, so the default gate judges the reward "
            "model's reward, which needs preference data: add prepare.files.prefs, or set gate.tests and "
            "gate.select_metric"
        )
    problems += difficulty_problems(params, lambda suite: builtin_difficulties(params, suite))
    from rlhf.training.rounds import operands_problem

    if improve.rounds and not task.checks_answers:
        problems.append(
            f"improve.rounds: a round keeps samples and gates its candidate by their answers; task.kind "
            f"{task.name!r} has no checkable answers: choose a task kind that checks them, or set improve.rounds: {{}}"
        )
    for name in improve.rounds:
        settings = improve.settings(name)
        for key in ("checks", "prefer"):
            if "steps" in getattr(settings, key) and not task.checks_steps:
                problems.append(
                    f"{round_key(improve, name, key)}: the steps check needs a task that checks steps; "
                    f"task.kind {task.name!r} does not (use answer, vote or prm)"
                )
        if settings.operands is not None and operands_problem(task):
            problems.append(f"{round_key(improve, name, 'operands')}: {operands_problem(task)}")
        if "prm" in settings.checks:
            need_model("the prm check", "prm", round_key(improve, name, "checks"))
        if settings.refine:
            need_model("refine", "prm", round_key(improve, name, "refine"))
        after = improve.rounds[name]["after"]
        methods = [*policy.offline, *policy.online]
        if after.startswith("policy/") and after.removeprefix("policy/") not in methods:
            problems.append(
                f"improve.rounds.{name}.after: {after} is not trained: policy.offline and policy.online list "
                f"{methods}; start from policy/<one of those>, or add the method"
            )
        evaluated, tests = improve.round_tests(settings, params)
        if unread := sorted({t.suite for t in tests if t.suite in suites} - set(evaluated)):
            problems.append(
                f"{round_key(improve, name, 'suites')}: the round's tests read {unread}, which it does not "
                f"evaluate ({evaluated}); add them, or set the tests' suites"
            )
    from rlhf.evaluation.suites import SUITE_METRICS

    metrics = [(f"gate.tests[{i}].metric", t.metric, t.suite) for i, t in enumerate(gate.tests or [])]
    metrics.append(("gate.select_metric", gate.select_metric, gate.select_suite))
    round_tests_given = [  # a round's own tests (its defaults ask for accuracy only)
        (f"{round_key(improve, name, 'tests')}[{i}]", t)
        for name in improve.rounds
        for i, t in enumerate(improve.settings(name).tests or [])
    ]
    metrics += [(f"{key}.metric", t.metric, t.suite) for key, t in round_tests_given]
    for key, metric, suite in metrics:
        if metric is not None and metric not in SUITE_METRICS and not (suite or "").startswith("harness/"):
            close = difflib.get_close_matches(metric, SUITE_METRICS, n=2)
            problems.append(
                f"{key}: no metric {metric!r} in an eval suite's report"
                + (f" (did you mean {' or '.join(close)}?)" if close else "")
                + f"; one of {', '.join(SUITE_METRICS)} (a harness task's own metrics: name its suite harness/<task>)"
            )

    def metric_needs(metric: str, key: str, remedy: str, in_round: bool = False) -> None:
        """What the run must have for `metric` to be in the eval report a gate reads (a
        round's evaluation scores no reward model)."""
        if metric == "accuracy":
            need_answers("metric accuracy", key)
        if metric == "format_rate" and not task.has_format:
            problems.append(f"{key}: task {task.name!r} defines no format (set task.format_pattern)")
        if metric in ("reward", "win_rate") and in_round:
            problems.append(
                f"{key}: a round's evaluation scores no reward model, so it has no {metric}; test accuracy, "
                f"format_rate or kl_to_ref, or {remedy}"
            )
        elif metric in ("reward", "win_rate"):
            need_model(f"metric {metric}", "reward_model", key)
        if metric == "kl_to_ref" and params["evaluate"].kl_prompts == 0:
            problems.append(
                f"{key}: kl_to_ref is not measured with evaluate.kl_prompts 0; set kl_prompts above 0, or {remedy}"
            )

    for index, test in enumerate(gate.tests or []):
        metric_needs(test.metric, f"gate.tests[{index}]", "remove the test")
    if gate.select_metric is not None:  # the candidates that pass are ranked on it
        metric_needs(gate.select_metric, "gate.select_metric", "choose another metric")
    for key, test in round_tests_given:
        if not (test.suite or "").startswith("harness/"):
            metric_needs(test.metric, key, "remove the test", in_round=True)
    return list(dict.fromkeys(problems))  # a default every round inherits, named once


def load_config(section: str, path: str = PARAMS_FILE):
    return load_all(path)[section]


def load_model_stage(path: str = PARAMS_FILE, override=None) -> dict:
    """`load_all` for a stage that runs a model: also sets this process's device and dtype
    from the `compute` section (rlhf.models.compute), and how models load from the `model`
    section with the stage's own `model:` block (`override(params)` gives it: None for a
    stage without one), failing here when it needs a package that is not installed."""
    import rlhf.models.settings as model_settings
    from rlhf.models.compute import configure

    params = load_all(path)
    configure(params["compute"])
    model_settings.configure(params["model"], override(params) if override else None)
    return params


def drop_out(stage: str, staging: Path, reason: str, metrics: Path, plot: Path) -> None:
    """A model stage whose inputs are absent: `absent.json` instead of a model in its output
    folder (`staging`), the reason as its metrics, an empty curve."""
    from rlhf.artifacts import write_csv, write_json
    from rlhf.models.folders import write_absent

    write_absent(staging, reason)
    write_json(metrics, {"absent": reason})
    write_csv(plot, [])
    print(f"{stage}: dropped out: {reason}")


def has_rows(path: str | Path) -> bool:
    """Whether a prepared table has rows (prepare writes absent tables with none)."""
    import pyarrow.parquet as pq

    with open(path, "rb") as file:  # opened here, so the end-to-end test's read trace sees it
        return pq.ParquetFile(file).metadata.num_rows > 0


def eval_suite_path(suite: str) -> Path:
    return EVAL_DIR / f"{suite}.parquet"


def candidate_dir(name: str) -> Path:
    """A candidate's folder: `sft`, `merged`, or a policy method's name."""
    if name in ("sft", "merged"):
        return MODELS_DIR / name
    return POLICY_DIR / name
