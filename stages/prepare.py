"""Stage `prepare`: every data contract the pipeline trains and evaluates on, as Parquet.

In:  params `prepare` — the built-in arithmetic task (default) or the user's files.
Out: data/prepared/<name>.parquet for sft, prefs, prefs_eval, unpaired, prm, prm_eval and
     prompts; data/prepared/eval/<suite>.parquet for each eval suite (the built-in task
     writes `dev`, for tuning and the gate, and `test`, only reported); and
     data/prepared/manifest.json (row counts and source).

The built-in task is generated from a seed (rlhf.tasks.arithmetic), so it is never committed. User files
(JSONL, JSON, Parquet, CSV or a `save_to_disk` folder, standard or conversational) are read,
their columns mapped onto the contract, and every row validated before anything is written:
all problems in all files are reported together, naming file, row and field.

    python -m stages.prepare
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf.artifacts import atomic_dir, write_json
from rlhf.params import StageConfig
from rlhf.tasks.arithmetic import TaskSizes, TaskSpec, generate_datasets
from stages import DATA_DIR, EVAL_DIR, load_config

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
    path: str = Field(description="JSONL, JSON, Parquet, CSV file or a save_to_disk folder")
    columns: dict[str, str] = Field(default_factory=dict, description="contract column -> column in the file")


class Config(StageConfig):
    source: Literal["builtin", "files"] = Field("builtin", description="generate the built-in task, or read files")
    seed: int = Field(0, description="generator seed of the built-in task")
    builtin: BuiltinTask = Field(default_factory=BuiltinTask, description="difficulty and sizes of the built-in task")
    files: dict[str, UserFile] = Field(
        default_factory=dict, description="source=files: name (sft, prefs, ..., eval_<suite>) -> file"
    )

    @model_validator(mode="after")
    def _check_files(self):
        if self.source != "files":
            return self
        problems = []
        for name, spec in self.files.items():
            if name not in FILE_KINDS and not name.startswith(EVAL_PREFIX):
                problems.append(f"files.{name}: unknown file name; use one of {sorted(FILE_KINDS)} or eval_<suite>")
            if not Path(spec.path).exists():
                problems.append(f"files.{name}.path: {spec.path} does not exist")
        if "sft" not in self.files:
            problems.append("files.sft: source=files needs at least an sft file")
        if not any(name.startswith(EVAL_PREFIX) for name in self.files):
            problems.append(
                "files: give at least one eval suite (e.g. eval_heldout: {path: ...}) with prompt and answer"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def kind_of(name: str) -> str:
    return "prompts" if name.startswith(EVAL_PREFIX) else FILE_KINDS[name]


def run(config: Config) -> dict:
    """The prepared tables (DataFrames), keyed by file name; user files are validated in
    full first."""
    import pandas as pd

    from rlhf.data.contracts import DataValidationError, load_contract

    if config.source == "builtin":
        spec = TaskSpec(**config.builtin.model_dump(exclude={"sizes"}))
        sizes = TaskSizes(**config.builtin.sizes)
        return {name: pd.DataFrame(rows) for name, rows in generate_datasets(spec, sizes, config.seed).items()}
    tables, errors = {}, []
    for name, spec in config.files.items():
        try:
            tables[name] = load_contract(spec.path, kind_of(name), spec.columns)
        except DataValidationError as error:
            errors.append(error)
    if errors:
        problems = [f"{e.path}: {p}" for e in errors for p in e.problems]
        raise DataValidationError(", ".join(e.path for e in errors), problems)
    return tables


def table_path(root: Path, name: str) -> Path:
    """Where file `name` goes under `root`: eval_<suite> into the eval folder."""
    if name.startswith(EVAL_PREFIX):
        return root / EVAL_DIR.relative_to(DATA_DIR) / f"{name[len(EVAL_PREFIX) :]}.parquet"
    return root / f"{name}.parquet"


def main() -> None:
    import mlflow

    from rlhf.tracking.runs import numeric_metrics, stage_run

    config = load_config("prepare")
    with stage_run("prepare", config):
        tables = run(config)
        with atomic_dir(DATA_DIR) as tmp:
            for name, frame in tables.items():
                path = table_path(tmp, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                frame.to_parquet(path, index=False)
            manifest = {"source": config.source, "rows": {name: len(frame) for name, frame in tables.items()}}
            write_json(tmp / "manifest.json", manifest)
        mlflow.log_metrics(numeric_metrics({"rows": manifest["rows"]}))
        print(f"prepare: wrote {', '.join(f'{n} ({r})' for n, r in manifest['rows'].items())} to {DATA_DIR}")


if __name__ == "__main__":
    main()
