"""Stage `prepare`: every data contract the pipeline trains and evaluates on, as Parquet.

In:  params `prepare` (the built-in arithmetic task, the user's files, or both) and `task`
     (which reads the answers of derived prompts).
Out: data/prepared/<name>.parquet for sft, prefs, prefs_eval, unpaired, prm, prm_eval and
     prompts (always all seven: a file with nothing to fill it is written with no rows, and
     the stages that would read it drop out); data/prepared/eval/<suite>.parquet for each
     eval suite (the built-in task writes `dev`, for tuning and the gate, and `test`, only
     reported); and data/prepared/manifest.json (rows and origin of every file).

Sources. `source: builtin` generates the built-in arithmetic task from a seed
(rlhf.tasks.arithmetic), so it is never committed; `source: word_problems` generates the
built-in word problems (rlhf.tasks.word_problems: GSM8K-style, read by task kind gsm8k,
with the suites dev, test and test_unseen, a family no training table holds), as
conversations unless `word_problems.chat` is off. Any `files` given too are added to a
generated task's tables (for example extra human preference pairs) or become extra eval
suites. `source: files` reads only the user's files. Files are JSONL, JSON, Parquet, CSV, a `save_to_disk` folder or a Hugging Face
dataset name (with `split` and `config`), standard or conversational; their columns are
mapped onto the contract, and every row of every file is validated before anything is
written: all problems in all files are reported together, naming file, row and field.

What a user must give: an sft file and one eval suite. Everything else is either given or
derived here, and the manifest says which:

* prefs_eval — `heldout_share` of the preference pairs, held out (the RM's held-out set);
* prm_eval — likewise from a given prm file (the PRM's held-out set);
* unpaired — the training pairs as unpaired rows (chosen: desirable, rejected: not), for KTO;
* prompts — the sft prompts, each with the answer the task reads from its demonstration
  (tasks with checkable answers), for the online methods;
* prm — a given file only: stage prm derives step labels by rollouts when none is given
  (rlhf.rewards.prm_labels).

With no preference file, prefs, prefs_eval and unpaired have no rows: the RM drops out
and params that need it are errors (check_params names the key that would supply it).

Human feedback. The labelling page (`rlhf label`, rlhf.feedback) appends the
pairs a person chooses to data/raw/feedback_prefs.jsonl (in git, empty until then). When it
has rows, prepare adds them to the training preference table `prefs` under either source
(validated by the preference contract first; the manifest counts them under `feedback`), so
the next `dvc repro` trains on them. Params checks do not read data files: with
`source: files` and no other preference file, name it (`prepare.files.prefs: {path:
data/raw/feedback_prefs.jsonl}`) for check_params to know there are pairs; its pairs are
then added once, not twice.

How: rlhf/data/preparation.py (the tables, their validation, splits and derivations).

    python -m stages.prepare
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf.data.preparation import DERIVED_FROM, FILE_KINDS, prepare, read_feedback, table_path
from rlhf.data.readers import looks_like_hub_dataset
from rlhf.params import SafeName, StageConfig
from rlhf.tasks.arithmetic import TaskSizes
from rlhf.tasks.word_problems import SUITE_FAMILIES, WordProblemSizes
from stages import DATA_DIR, EVAL_PREFIX, FEEDBACK_FILE, load_all


class BuiltinTask(StageConfig):
    min_operands: int = Field(3, ge=2, description="fewest numbers in a problem")
    max_operands: int = Field(5, ge=2, le=8, description="most numbers in a problem")
    max_value: int = Field(29, ge=2, le=999, description="largest number in a problem")
    shortcut_rate: float = Field(
        0.75, ge=0, le=1, description="share of SFT demonstrations of short problems that give the answer alone"
    )
    shortcut_max_operands: int = Field(3, ge=0, le=8, description="problems with at most this many numbers are short")
    long_operands: tuple[int, int] | None = Field(
        None, description="[fewest, most] numbers of the extra held-out suites dev_long and test_long; null: none"
    )
    sizes: dict[str, int] = Field(default_factory=dict, description="rows per file, overriding TaskSizes defaults")

    @model_validator(mode="after")
    def _check(self):
        if self.min_operands > self.max_operands:
            raise ValueError(f"min_operands ({self.min_operands}) is larger than max_operands ({self.max_operands})")
        if self.long_operands and not 2 <= self.long_operands[0] <= self.long_operands[1] <= 12:
            raise ValueError(
                f"long_operands {list(self.long_operands)}: want [fewest, most] with 2 <= fewest <= most <= 12"
            )
        checked_sizes(self.sizes, TaskSizes)
        return self


class WordProblems(StageConfig):
    chat: bool = Field(
        True,
        description="rows as conversations (a user turn, an assistant turn): an instruct model reads them "
        "through its chat template",
    )
    sizes: dict[str, int] = Field(
        default_factory=dict, description="rows per file, overriding rlhf.tasks.word_problems.WordProblemSizes"
    )
    context_chars: int | None = Field(
        None,
        ge=50,
        description="long contexts (rlhf/tasks/long_context.py): each eval problem's facts hidden in a context of at "
        "least this many characters of distractors, and a compress table for stage compress; null: none",
    )

    @field_validator("sizes")
    @classmethod
    def _check_sizes(cls, sizes):
        return checked_sizes(sizes, WordProblemSizes)


def checked_sizes(sizes: dict[str, int], known) -> dict[str, int]:
    """`sizes` when every name is a file of the generator's `known` sizes and every count positive."""
    names = set(known.__dataclass_fields__)
    unknown = sorted(set(sizes) - names)
    if unknown:
        raise ValueError(f"sizes: unknown file(s) {unknown}; known: {sorted(names)}")
    bad = {k: v for k, v in sizes.items() if v <= 0}
    if bad:
        raise ValueError(f"sizes must be positive, got {bad}")
    return sizes


class UserFile(StageConfig):
    path: str = Field(description="JSONL, JSON, Parquet, CSV, a save_to_disk folder, or a Hub dataset name")
    columns: dict[str, str] = Field(default_factory=dict, description="contract column -> column in the file")
    split: str | None = Field(
        None, description="split of a save_to_disk DatasetDict or a Hub dataset (null: train); a file has none"
    )
    config: str | None = Field(None, description="configuration (subset) of a Hub dataset, e.g. main")
    chat: bool = Field(
        False,
        description="text rows as conversations: the prompt a user turn, each response an assistant turn (so that "
        "an instruct model reads them through its chat template)",
    )


class Config(StageConfig):
    source: Literal["builtin", "word_problems", "files"] = Field(
        "builtin",
        description="builtin: generate the arithmetic task; word_problems: generate GSM8K-style word problems "
        "(task.kind gsm8k); either plus any files; files: only the files",
    )
    seed: int = Field(0, description="generator seed of a built-in task, and of the held-out split")
    builtin: BuiltinTask = Field(default_factory=BuiltinTask, description="difficulty and sizes of the built-in task")
    word_problems: WordProblems = Field(
        default_factory=WordProblems, description="source word_problems: its format and sizes"
    )
    files: dict[SafeName, UserFile] = Field(
        default_factory=dict, description="name (sft, prefs, ..., eval_<suite>) -> file; added to builtin tables"
    )
    heldout_share: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="share of prefs (prm) held out as prefs_eval (prm_eval) when that file is not given",
    )

    @model_validator(mode="after")
    def _check_files(self):
        problems = []
        for name, spec in self.files.items():
            if name not in FILE_KINDS and not name.startswith(EVAL_PREFIX):
                problems.append(f"files.{name}: unknown file name; use one of {sorted(FILE_KINDS)} or eval_<suite>")
            if name == EVAL_PREFIX:
                problems.append(f"files.{name}: name the suite after {EVAL_PREFIX} (e.g. {EVAL_PREFIX}heldout)")
            if not Path(spec.path).exists() and not looks_like_hub_dataset(spec.path):
                problems.append(
                    f"files.{name}.path: {spec.path} does not exist (nor is it a Hub dataset name, owner/name)"
                )
            elif spec.config is not None and Path(spec.path).exists():
                problems.append(
                    f"files.{name}.config: {spec.path} is a local path; config names a Hub dataset's configuration: "
                    "remove it"
                )
        given = self.given()  # params checks read no data file: the feedback file counts once named (docstring)
        for held_out, source in (("prefs_eval", "prefs"), ("prm_eval", "prm")):
            if held_out in self.files and source not in given:  # read by nothing: RM / PRM train without it
                problems.append(f"files.{held_out}: given without files.{source}, which it is held out of; add "
                                f"files.{source}, or remove {held_out}")  # fmt: skip
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

    def cross_problems(self, run, section: str) -> list[str]:
        """The word problems end in GSM8K's `#### N`, which task kind gsm8k reads."""
        if self.source == "word_problems" and run.task.name != "gsm8k":
            return [
                f"task.kind: {run.task.name!r} cannot read the word problems' answers (`#### N`, GSM8K's answer "
                "line), which prepare.source word_problems generates: set task.kind: gsm8k"
            ]
        return []

    def given(self) -> set[str]:
        """The names of the tables this config provides before derivation."""
        names = set(self.files)
        generated = set(FILE_KINDS) - {"compress"}  # the compress table only with long contexts
        if self.source == "builtin":
            names |= generated | {EVAL_PREFIX + "dev", EVAL_PREFIX + "test"}
            if self.builtin.long_operands:
                names |= {EVAL_PREFIX + "dev_long", EVAL_PREFIX + "test_long"}
        elif self.source == "word_problems":
            names |= generated | {EVAL_PREFIX + suite for suite in SUITE_FAMILIES}
            if self.word_problems.context_chars is not None:
                names.add("compress")
        return names

    def available(self) -> set[str]:
        """The tables prepare writes with rows: given, or derived here."""
        names = self.given()
        for name, source in DERIVED_FROM.items():
            if source in names:
                names.add(name)
        return names


def run(config: Config, task, feedback=None) -> tuple[dict, dict]:
    """The prepared tables read back as frames, keyed by file name, and where each came from:
    `prepare` into a temporary folder (for small data: tests, a look at what prepare makes)."""
    import tempfile

    from rlhf.data.prepared import read_prepared

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "prepared"
        manifest = prepare(root, config, task, feedback)
        tables = {name: read_prepared(table_path(root, name), "prepare") for name in manifest["rows"]}
    # Missing values as None, as the rows were validated (Parquet's text columns read as NaN).
    return {n: t.astype(object).where(t.notna(), None) for n, t in tables.items()}, manifest["origin"]


def main() -> None:
    import mlflow

    from rlhf.tasks import get_task
    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_all()
    config = params["prepare"]
    with stage_run("prepare", config):
        feedback = read_feedback(FEEDBACK_FILE)
        manifest = prepare(DATA_DIR, config, get_task(params["task"]), feedback=feedback)
        mlflow.log_metrics(numeric_metrics({"rows": manifest["rows"], "feedback_rows": manifest["feedback"]["rows"]}))
        for name, rows in manifest["rows"].items():
            print(f"prepare: {name}: {rows} rows ({manifest['origin'][name]})")


if __name__ == "__main__":
    main()
