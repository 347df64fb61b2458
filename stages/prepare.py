"""Stage `prepare`: every data contract the pipeline trains and evaluates on, as Parquet.

In:  params `prepare` (the built-in arithmetic task, the user's files, or both) and `task`
     (which reads the answers of derived prompts).
Out: data/prepared/<name>.parquet for sft, prefs, prefs_eval, unpaired, prm, prm_eval and
     prompts (always all seven: a file with nothing to fill it is written with no rows, and
     the stages that would read it drop out); data/prepared/eval/<suite>.parquet for each
     eval suite (the built-in task writes `dev`, for tuning and the gate, and `test`, only
     reported); and data/prepared/manifest.json (rows and origin of every file).

Sources. `source: builtin` generates the built-in task from a seed (rlhf.tasks.arithmetic),
so it is never committed; any `files` given too are added to its tables (for example
extra human preference pairs) or become extra eval suites. `source: files` reads only the
user's files. Files are JSONL, JSON, Parquet, CSV, a `save_to_disk` folder or a Hugging Face
dataset name (with `split` and `config`), standard or conversational; their columns are
mapped onto the contract, and every row of every file is validated before anything is
written: all problems in all files are reported together, naming file, row and field.

What a user must give: an sft file and one eval suite. Everything else is either given or
derived here, and the manifest says which:

* prefs_eval — `heldout_share` of the preference pairs, held out (the RM's held-out set);
* unpaired — the training pairs as unpaired rows (chosen: desirable, rejected: not), for KTO;
* prompts — the sft prompts, each with the answer the task reads from its demonstration
  (tasks with checkable answers), for the online methods;
* prm / prm_eval — given files only: stage prm derives step labels by rollouts when none
  are given (rlhf.rewards.prm_labels).

With no preference file, prefs, prefs_eval and unpaired have no rows: the RM drops out
and params that need it are errors (check_params names the key that would supply it).

    python -m stages.prepare
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf.artifacts import atomic_dir, write_json
from rlhf.models.folders import looks_like_hub_id
from rlhf.params import StageConfig
from rlhf.tasks.arithmetic import TaskSizes, TaskSpec, generate_datasets
from stages import DATA_DIR, EVAL_DIR, load_all

# File names in data/prepared and the contract each follows; eval_<suite> are prompts.
FILE_KINDS = {
    "sft": "sft",
    "prefs": "preference",
    "prefs_eval": "preference",
    "unpaired": "unpaired",
    "prm": "prm",
    "prm_eval": "prm",
    "prompts": "prompts",
}
EVAL_PREFIX = "eval_"
# What each file can be derived from (prepare itself, or stage prm for the step labels).
DERIVED_FROM = {"prefs_eval": "prefs", "unpaired": "prefs", "prompts": "sft"}


class BuiltinTask(StageConfig):
    min_operands: int = Field(3, ge=2, description="fewest numbers in a problem")
    max_operands: int = Field(5, ge=2, le=8, description="most numbers in a problem")
    max_value: int = Field(29, ge=2, le=999, description="largest number in a problem")
    shortcut_rate: float = Field(
        0.75, ge=0, le=1, description="share of SFT demonstrations of short problems that give the answer alone"
    )
    shortcut_max_operands: int = Field(3, ge=0, le=8, description="problems with at most this many numbers are short")
    sizes: dict[str, int] = Field(default_factory=dict, description="rows per file, overriding TaskSizes defaults")

    @model_validator(mode="after")
    def _check(self):
        if self.min_operands > self.max_operands:
            raise ValueError(f"min_operands ({self.min_operands}) is larger than max_operands ({self.max_operands})")
        known = set(TaskSizes.__dataclass_fields__)
        unknown = sorted(set(self.sizes) - known)
        if unknown:
            raise ValueError(f"sizes: unknown file(s) {unknown}; known: {sorted(known)}")
        bad = {k: v for k, v in self.sizes.items() if v <= 0}
        if bad:
            raise ValueError(f"sizes must be positive, got {bad}")
        return self


class UserFile(StageConfig):
    path: str = Field(description="JSONL, JSON, Parquet, CSV, a save_to_disk folder, or a Hub dataset name")
    columns: dict[str, str] = Field(default_factory=dict, description="contract column -> column in the file")
    split: str = Field("train", description="split of a save_to_disk DatasetDict or a Hub dataset")
    config: str | None = Field(None, description="configuration (subset) of a Hub dataset, e.g. main")


class Config(StageConfig):
    source: Literal["builtin", "files"] = Field(
        "builtin", description="builtin: generate the built-in task (plus any files); files: only the files"
    )
    seed: int = Field(0, description="generator seed of the built-in task, and of the held-out split")
    builtin: BuiltinTask = Field(default_factory=BuiltinTask, description="difficulty and sizes of the built-in task")
    files: dict[str, UserFile] = Field(
        default_factory=dict, description="name (sft, prefs, ..., eval_<suite>) -> file; added to builtin tables"
    )
    heldout_share: float = Field(
        0.1, gt=0, lt=1, description="share of prefs held out as prefs_eval when no prefs_eval file is given"
    )

    @model_validator(mode="after")
    def _check_files(self):
        problems = []
        for name, spec in self.files.items():
            if name not in FILE_KINDS and not name.startswith(EVAL_PREFIX):
                problems.append(f"files.{name}: unknown file name; use one of {sorted(FILE_KINDS)} or eval_<suite>")
            if not Path(spec.path).exists() and not looks_like_hub_id(spec.path):
                problems.append(f"files.{name}.path: {spec.path} does not exist (nor is it a Hub dataset name)")
        if self.source == "files":
            if "sft" not in self.files:
                problems.append("files.sft: source=files needs at least an sft file (prompt, completion)")
            if not any(name.startswith(EVAL_PREFIX) for name in self.files):
                problems.append(
                    "files: give at least one eval suite (e.g. eval_heldout: {path: ...}) with prompt and answer"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def given(self) -> set[str]:
        """The names of the tables this config provides before derivation."""
        names = set(self.files)
        if self.source == "builtin":
            names |= set(FILE_KINDS) | {EVAL_PREFIX + "dev", EVAL_PREFIX + "test"}
        return names

    def available(self) -> set[str]:
        """The tables prepare writes with rows: given, or derived here."""
        names = self.given()
        for name, source in DERIVED_FROM.items():
            if source in names:
                names.add(name)
        return names


def kind_of(name: str) -> str:
    return "prompts" if name.startswith(EVAL_PREFIX) else FILE_KINDS[name]


def run(config: Config, task) -> tuple[dict, dict]:
    """The prepared tables (DataFrames) keyed by file name, and where each came from. User
    files are validated in full first; then the absent tables are derived or left empty."""
    import pandas as pd

    from rlhf.data.contracts import DataValidationError, load_contract

    tables: dict = {}
    origins: dict[str, str] = {}
    if config.source == "builtin":
        spec = TaskSpec(**config.builtin.model_dump(exclude={"sizes"}))
        sizes = TaskSizes(**config.builtin.sizes)
        for name, rows in generate_datasets(spec, sizes, config.seed).items():
            tables[name], origins[name] = pd.DataFrame(rows), "builtin"
    errors = []
    for name, spec in config.files.items():
        try:
            frame = load_contract(spec.path, kind_of(name), spec.columns, split=spec.split, config=spec.config)
        except DataValidationError as error:
            errors.append(error)
            continue
        if name in tables:
            if set(frame.columns) != set(tables[name].columns):
                errors.append(
                    DataValidationError(
                        spec.path,
                        [
                            f"prepare.files.{name}: columns {sorted(frame.columns)} cannot be added to the built-in "
                            f"table's {sorted(tables[name].columns)}; give the same format, or use source: files"
                        ],
                    )
                )
                continue
            tables[name] = pd.concat([tables[name], frame], ignore_index=True)
            origins[name] = f"builtin + {spec.path}"
        else:
            tables[name], origins[name] = frame, str(spec.path)
    if errors:
        problems = [f"{e.path}: {p}" for e in errors for p in e.problems]
        raise DataValidationError(", ".join(e.path for e in errors), problems)
    derive(tables, origins, task, config)
    return tables, origins


def derive(tables: dict, origins: dict, task, config: Config) -> None:
    """Fill what the given tables imply (module docstring); leave the rest empty."""
    import numpy as np
    import pandas as pd

    from rlhf.data.contracts import CONTRACTS

    prefs = tables.get("prefs")
    if prefs is not None and len(prefs) and "prefs_eval" not in tables:
        if len(prefs) < 2:
            raise ValueError("prepare: a preference file with one pair cannot be split; add pairs or prefs_eval")
        order = np.random.default_rng(config.seed).permutation(len(prefs))
        held = max(1, round(config.heldout_share * len(prefs)))
        tables["prefs_eval"] = prefs.iloc[np.sort(order[:held])].reset_index(drop=True)
        tables["prefs"] = prefs = prefs.iloc[np.sort(order[held:])].reset_index(drop=True)
        origins["prefs_eval"] = f"derived: {held} pairs held out of prefs (heldout_share {config.heldout_share})"
    if prefs is not None and len(prefs) and "unpaired" not in tables:
        rows = [
            {"prompt": r.prompt, "completion": completion, "label": label}
            for r in prefs.itertuples(index=False)
            for completion, label in ((r.chosen, True), (r.rejected, False))
        ]
        tables["unpaired"] = pd.DataFrame({c: pd.Series([r[c] for r in rows], dtype=object) for c in rows[0]})
        origins["unpaired"] = "derived: prefs pairs as desirable / undesirable rows"
    if "prompts" not in tables:
        tables["prompts"] = prompts_from_sft(tables["sft"], task)
        answered = int(tables["prompts"]["answer"].notna().sum())
        origins["prompts"] = f"derived: sft prompts, {answered} with an answer read by task {task.name!r}"
    for name, kind in FILE_KINDS.items():
        if name not in tables:
            columns = CONTRACTS[kind]["required"]
            tables[name] = pd.DataFrame({c: pd.Series([], dtype=object) for c in columns})
            origins[name] = (
                "absent: stage prm derives step labels by rollouts, or give prepare.files.prm"
                if kind == "prm"
                else f"absent: give prepare.files.{DERIVED_FROM.get(name, name)}"
            )


def prompts_from_sft(sft, task):
    """One row per distinct sft prompt, with the answer the task reads from its
    demonstration (None where it reads none, or for a task with no checkable answers)."""
    import pandas as pd

    prompts, answers, seen = [], [], set()
    if "messages" in sft.columns:
        pairs = []
        for messages in sft["messages"]:
            if len(messages) >= 2 and messages[-1]["role"] == "assistant":
                pairs.append((list(messages[:-1]), messages[-1]["content"]))
    else:
        pairs = list(zip(sft["prompt"], sft["completion"]))
    for prompt, completion in pairs:
        key = repr(prompt)
        if key in seen:
            continue
        seen.add(key)
        text = completion if isinstance(completion, str) else "".join(m["content"] for m in completion)
        prompts.append(prompt)
        answers.append(task.extract_answer(text) if task.checks_answers else None)
    return pd.DataFrame({"prompt": pd.Series(prompts, dtype=object), "answer": pd.Series(answers, dtype=object)})


def table_path(root: Path, name: str) -> Path:
    """Where file `name` goes under `root`: eval_<suite> into the eval folder."""
    if name.startswith(EVAL_PREFIX):
        return root / EVAL_DIR.relative_to(DATA_DIR) / f"{name[len(EVAL_PREFIX) :]}.parquet"
    return root / f"{name}.parquet"


def main() -> None:
    import mlflow

    from rlhf.tasks import get_task
    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_all()
    config = params["prepare"]
    with stage_run("prepare", config):
        tables, origins = run(config, get_task(params["task"]))
        with atomic_dir(DATA_DIR) as tmp:
            for name, frame in tables.items():
                path = table_path(tmp, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                frame.to_parquet(path, index=False)
            manifest = {
                "source": config.source,
                "rows": {name: len(frame) for name, frame in tables.items()},
                "origin": origins,
            }
            write_json(tmp / "manifest.json", manifest)
        mlflow.log_metrics(numeric_metrics({"rows": manifest["rows"]}))
        for name, frame in tables.items():
            print(f"prepare: {name}: {len(frame)} rows ({origins[name]})")


if __name__ == "__main__":
    main()
