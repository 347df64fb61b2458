"""The pipeline's DVC stages, one module each (`python -m stages.<name>`).

`SECTIONS` maps each params.yaml section to the class that defines it (a stage module's
`Config`, or the task's), so the whole file can be validated at once (`load_all`) before any
stage does work: every stage validates every section, and a typo anywhere fails the first
stage in a second. For that to take a second, a stage module imports only light modules at
its top (pydantic, the params blocks of `rlhf`); torch, transformers and TRL are imported in
the functions that train or generate.

Rules that span sections (policy's online rewards need a reward model, which needs
preference data) are checked by the section that asks, in its Config's `cross_problems`
(rlhf/rules.py), which `load_all` collects after every section validated alone.

The pipeline's folders are named in rlhf/layout.py (re-exported here for the stage
modules, which add their own files); the library below takes paths from its callers.
"""

from __future__ import annotations

import importlib
import sys
from functools import partial
from pathlib import Path

from rlhf.layout import (  # noqa: F401  (the pipeline's folders, for the stage modules)
    CHAMPION_DIR,
    CHECKPOINTS_DIR,
    COMPRESSOR_DIR,
    DATA_DIR,
    EVAL_DIR,
    EVAL_PREFIX,
    FEEDBACK_FILE,
    MERGED_DIR,
    MODELS_DIR,
    POLICY_DIR,
    PRM_DIR,
    PROMPTS_FILE,
    REF_LOGPS_CACHE,
    REPORTS_DIR,
    REWARD_MODEL_DIRS,
    RM_DIR,
    SFT_DIR,
    TRACKING_OWED_DIR,
)
from rlhf.params import PARAMS_FILE, InputError, ParamsError, cross_section_problems, read_params, validate_params


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
    "compress": "stages.compress:Config",
    "policy": "stages.policy:Config",
    "merge": "stages.merge:Config",
    "evaluate": "stages.evaluate:Config",
    "validate": "stages.validate:Config",
    "gate": "stages.gate:Config",
    "infer": "stages.infer:Config",
    "improve": "stages.improve:Config",
}


def config_class(section: str) -> type:
    module, name = SECTIONS[section].split(":")
    return getattr(importlib.import_module(module), name)


def all_configs() -> dict:
    return {section: config_class(section) for section in SECTIONS}


def load_all(path: str = PARAMS_FILE) -> dict:
    """Every section of params.yaml, validated, then the rules that span sections, which
    each Config checks (`cross_problems`, rlhf/rules.py) against the data the params
    provide; raises one ParamsError listing all problems."""
    params = validate_params(read_params(path), all_configs(), path)
    problems = cross_section_problems(params, run_facts(params))
    if problems:
        raise ParamsError(path, problems)
    if path == PARAMS_FILE:
        warn_if_started_by_hand_on_changed_inputs()
    return params


def hand_run_stage() -> str | None:
    """The dvc.yaml stage this process is, when it was started by hand (`python -m
    stages.<name> [item]`, not by `dvc repro` or the flow, which run under DVC_STAGE) in a
    project whose dvc.lock records it; else None."""
    import os

    if os.environ.get("DVC_STAGE") or not stage_process():
        return None
    spec = sys.modules["__main__"].__spec__
    from rlhf.lockfile import lock_stages

    recorded = lock_stages("dvc.lock")
    if recorded is None:
        return None
    name = spec.name.split(".", 1)[1]
    for stage in ([f"{name}@{sys.argv[1]}"] if len(sys.argv) > 1 else []) + [name]:
        if stage in recorded:
            return stage
    return None


def changed_inputs(stage: str) -> list[str]:
    """The deps of `stage` whose content differs from what dvc.lock recorded, as `dvc
    status` reports them (DVC's own state keeps the hashes of unchanged files: cheap)."""
    from dvc.repo import Repo

    with Repo(".") as repo:
        status = repo.status(targets=[stage])
    deps = {}
    for entry in status.get(stage, []):  # dicts of what changed ("changed deps", "changed outs", ...)
        if isinstance(entry, dict):
            deps.update(entry.get("changed deps") or {})
    changed = []
    for path, how in deps.items():
        if isinstance(how, dict):  # a params file: the keys that changed
            changed += [f"{path}: {key} ({what})" for key, what in how.items()]
        else:
            changed.append(f"{path} ({how})")
    return changed


def warn_if_started_by_hand_on_changed_inputs() -> None:
    """A stage started by hand reads what is on disk; DVC compares it with dvc.lock only
    when it runs the stage. A model damaged on disk (a flipped bit) or an input changed
    since the last run would be read without a word: say which, before anything loads."""
    stage = hand_run_stage()
    if stage is None:
        return
    try:
        changed = changed_inputs(stage)
    except Exception as error:  # the comparison is advice: it never stops the stage
        print(f"{stage}: could not compare its inputs with dvc.lock ({type(error).__name__}: {error})",
              file=sys.stderr)  # fmt: skip
        return
    if changed:
        shown = "; ".join(changed[:6]) + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
        print(f"{stage}: started by hand, and what it reads differs from what dvc.lock recorded: {shown}. It reads "
              f"them as they are now; `dvc status {stage}` shows the difference, `dvc checkout <path>` restores a "
              f"recorded output, `dvc repro {stage}` reruns what changed first", file=sys.stderr)  # fmt: skip


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


# ----------------------------------------------------------------------------- inputs


def run_facts(params: dict, difficulties=None):
    """The `rlhf.rules.Run` of validated `params`: what the sections' cross-section rules
    read (the task, the data given, the eval suites, the pipeline's model folders).
    `difficulties(suite)`: a suite's difficulty labels where known (default: the built-in
    task's; stage check_params reads the user's files)."""
    from rlhf.rules import Run

    return Run(
        params,
        eval_suites(params),
        decision_suite(params),
        MODELS_DIR,
        REWARD_MODEL_DIRS,
        difficulties or partial(builtin_difficulties, params),
    )


def builtin_difficulties(params: dict, suite: str) -> set[str] | None:
    """The difficulties (numbers of operands) of a suite the built-in task generates; None
    for a suite from a file (`suite_difficulties` reads it) or none."""
    prepare = params["prepare"]
    if f"eval_{suite}" in prepare.files:
        return None
    return generated_difficulties(prepare, suite)


def generated_difficulties(prepare, suite: str) -> set[str] | None:
    """The difficulty labels of a generated suite's problems (the arithmetic task's numbers
    of operands, the word problems' families); None when no generator writes that suite."""
    if prepare.source == "word_problems":
        from rlhf.tasks.word_problems import SUITE_FAMILIES

        return set(SUITE_FAMILIES[suite]) if suite in SUITE_FAMILIES else None
    builtin = prepare.builtin
    generated = {"dev", "test"} | ({"dev_long", "test_long"} if builtin.long_operands else set())
    if prepare.source != "builtin" or suite not in generated:
        return None
    low, high = builtin.long_operands if suite.endswith("_long") else (builtin.min_operands, builtin.max_operands)
    return {str(n) for n in range(low, high + 1)}


def load_config(section: str, path: str = PARAMS_FILE):
    return load_all(path)[section]


def load_model_stage(path: str = PARAMS_FILE, override=None, key: str | None = None) -> dict:
    """`load_all` for a stage that runs a model: also sets this process's device and dtype
    from the `compute` section (rlhf.models.compute), and how models load from the `model`
    section with the stage's own `model:` block (`override(params)` gives it: None for a
    stage without one, `key` its params key), failing here when it needs a package that is
    not installed or kernels this device cannot run."""
    import rlhf.models.settings as model_settings
    from rlhf.models.compute import configure

    params = load_all(path)
    placement = configure(params["compute"])
    model_settings.configure(params["model"], override(params) if override else None, placement.device, key)
    if stage_process():
        import rlhf.models.loading  # noqa: F401  (torch, transformers: what every model stage reads)
        import rlhf.tracking.runs  # noqa: F401  (MLflow)
        from rlhf.models.compute import freeze_startup_objects

        freeze_startup_objects()
    return params


def stage_process() -> bool:
    """Whether this process is a stage's own (`python -m stages.<name>`: by DVC, the flow, a
    launcher's ranks or by hand), not a process that calls a stage's main (the tests)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name.startswith("stages.")


def drop_out(stage: str, staging: Path, reason: str, metrics: Path, plot: Path) -> None:
    """A model stage whose inputs are absent: `absent.json` instead of a model in its output
    folder (`staging`), the reason as its metrics, an empty curve."""
    from rlhf.atomic import write_csv, write_json
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
