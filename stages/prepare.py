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
* prm_eval — likewise from a given prm file (the PRM's held-out set);
* unpaired — the training pairs as unpaired rows (chosen: desirable, rejected: not), for KTO;
* prompts — the sft prompts, each with the answer the task reads from its demonstration
  (tasks with checkable answers), for the online methods;
* prm — a given file only: stage prm derives step labels by rollouts when none is given
  (rlhf.rewards.prm_labels).

With no preference file, prefs, prefs_eval and unpaired have no rows: the RM drops out
and params that need it are errors (check_params names the key that would supply it).

Human feedback. The labelling page (`python -m stages.label`, rlhf.feedback) appends the
pairs a person chooses to data/raw/feedback_prefs.jsonl (in git, empty until then). When it
has rows, prepare adds them to the training preference table `prefs` under either source
(validated by the preference contract first; the manifest counts them under `feedback`), so
the next `dvc repro` trains on them. Params checks do not read data files: with
`source: files` and no other preference file, name it (`prepare.files.prefs: {path:
data/raw/feedback_prefs.jsonl}`) for check_params to know there are pairs; its pairs are
then added once, not twice.

    python -m stages.prepare
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf.artifacts import atomic_dir, write_json
from rlhf.data.contracts import looks_like_hub_dataset
from rlhf.params import SafeName, StageConfig
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
DERIVED_FROM = {"prefs_eval": "prefs", "prm_eval": "prm", "unpaired": "prefs", "prompts": "sft"}
# Pairs chosen on the labelling page (stages.label), added to prefs when the file has rows.
FEEDBACK_FILE = Path("data/raw/feedback_prefs.jsonl")


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
    source: Literal["builtin", "files"] = Field(
        "builtin", description="builtin: generate the built-in task (plus any files); files: only the files"
    )
    seed: int = Field(0, description="generator seed of the built-in task, and of the held-out split")
    builtin: BuiltinTask = Field(default_factory=BuiltinTask, description="difficulty and sizes of the built-in task")
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

    def given(self) -> set[str]:
        """The names of the tables this config provides before derivation."""
        names = set(self.files)
        if self.source == "builtin":
            names |= set(FILE_KINDS) | {EVAL_PREFIX + "dev", EVAL_PREFIX + "test"}
            if self.builtin.long_operands:
                names |= {EVAL_PREFIX + "dev_long", EVAL_PREFIX + "test_long"}
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


def read_feedback(path: str | Path = FEEDBACK_FILE):
    """The human feedback pairs in `path` (a preference JSONL file), validated; None when the
    file is absent or has no rows."""
    from rlhf.data.contracts import load_contract

    path = Path(path)
    # Opened here (not only by the contract's reader), so that an empty file is not an error.
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as file:
        if not any(line.strip() for line in file):
            return None
    return load_contract(path, "preference")


def same_file(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def run(config: Config, task, feedback=None) -> tuple[dict, dict]:
    """The prepared tables (DataFrames) keyed by file name, and where each came from. User
    files are validated in full first; then the human `feedback` pairs (a frame from
    `read_feedback`, or None) are added to prefs, and the absent tables are derived or left
    empty."""
    import pandas as pd

    from rlhf.data.contracts import DataValidationError, as_conversation, load_contract

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
            if spec.chat:
                frame = as_conversation(frame)
        except DataValidationError as error:
            errors.append(error)
            continue
        unreadable = answer_problems(frame, task) if kind_of(name) == "prompts" else []
        if kind_of(name) == "prm":
            unreadable += step_problems(frame, task, f"prepare.files.{name}")
        if name.startswith(EVAL_PREFIX) and task.checks_answers and not has_answers(frame):
            unreadable.append(
                f"prepare.files.{name}: no row has an answer, and task.kind {task.name!r} scores an eval suite by "
                "its answers (accuracy, the gate's default tests): map the file's answer column "
                f"(prepare.files.{name}.columns: {{answer: <column>}}), or choose task.kind none"
            )
        if unreadable:
            errors.append(DataValidationError(spec.path, unreadable))
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
    if feedback is not None and len(feedback):
        add_feedback(tables, origins, feedback, config)
    derive(tables, origins, task, config)
    check_one_format(tables, origins)
    return tables, origins


def eval_overlap(tables: dict, origins: dict) -> dict:
    """Per eval suite, how many of its prompts each training table holds too (the model is
    then scored on what it was trained on), printed; {} when none. The manifest keeps it."""
    from rlhf.data.contracts import prompt_key

    def prompts(table) -> set[str]:
        if "messages" in table:  # a conversation's prompt: its turns before the last
            return {prompt_key(list(m)[:-1]) for m in table["messages"]}
        return {prompt_key(p) for p in table["prompt"]} if "prompt" in table else set()

    training = {n: prompts(t) for n, t in tables.items() if not n.startswith(EVAL_PREFIX) and not n.endswith("_eval")}
    overlap = {}
    for suite in (n for n in tables if n.startswith(EVAL_PREFIX)):
        held = prompts(tables[suite])
        found = {n: len(held & keys) for n, keys in training.items() if held & keys}
        if found:
            overlap[suite] = found
            listed = ", ".join(f"{count} in {n}" for n, count in found.items())
            print(f"prepare: {suite} ({origins[suite]}): of its {len(held)} prompts, {listed}; a model trained on "
                  "those is scored on what it was trained on")  # fmt: skip
    return overlap


def check_one_format(tables: dict, origins: dict) -> None:
    """Every table the policy trains, samples or is evaluated on holds one format, text or
    messages (each file already does, by its contract): a policy trained through the chat
    template and sampled or scored without it (or the reverse) is quietly wrong. The PRM's
    tables may differ (its model may be another)."""
    from rlhf.data.contracts import DataValidationError, value_format

    formats: dict[str, list[str]] = {}
    for name, table in tables.items():
        if kind_of(name) == "prm" or not len(table):
            continue
        column = "messages" if "messages" in table.columns else "prompt"
        formats.setdefault(value_format(table[column].iloc[0]), []).append(name)
    if len(formats) < 2:
        return
    sides = sorted(formats.items())
    listed = "; ".join(f"{fmt}: " + ", ".join(f"{n} ({origins[n]})" for n in names) for fmt, names in sides)
    files = [origins[n] for _, names in sides for n in names if Path(origins[n]).exists()]
    raise DataValidationError(
        ", ".join(dict.fromkeys(files)) or "prepare",
        [
            f"the prepared tables mix formats ({listed}); the policy would be trained with the chat template "
            "and sampled or evaluated without it, or the reverse. Give every file in one format (all text or "
            "all messages)"
        ],
    )


def has_answers(frame) -> bool:
    return "answer" in frame and bool(frame["answer"].notna().any())


def answer_problems(frame, task) -> list[str]:
    """The rows of a prompts table whose answer the task cannot read as a reference (a
    numeric task's answer that is not a number, a choice task's letter not among its
    choices): caught here, not after a stage has sampled or evaluated for an hour."""
    if not task.checks_answers or "answer" not in frame:
        return []
    problems = []
    for index, answer in enumerate(frame["answer"]):
        if answer is None or (isinstance(answer, float) and answer != answer):
            continue
        try:
            task.reference_answer(answer)
        except ValueError as error:
            problems.append(f"row {index + 1}: 'answer' {error}; correct it, or leave it empty (no answer)")
    return problems


def step_problems(frame, task, key: str) -> list[str]:
    """The rows of a step-labelled table with a step that holds the task's step separator:
    the PRM would learn those labels on these steps, and then score solutions split at the
    separator (best-of-N, MCTS, the rounds' checks), other steps than those labelled."""
    separator = task.step_separator
    problems = []
    for index, steps in enumerate(frame["completions"]):
        split = [k for k, step in enumerate(steps) if separator in step.strip()]
        if split:
            problems.append(
                f"row {index + 1}: step {split[0] + 1} holds the task's step separator {separator!r} "
                f"({_excerpt(steps[split[0]])}), so the PRM would score it as several steps; split it there "
                f"(with a label for each), or set task.step_separator (the file: {key})"
            )
    return problems


def _excerpt(text: str, chars: int = 40) -> str:
    return repr(text if len(text) <= chars else text[: chars - 3] + "...")


def add_feedback(tables: dict, origins: dict, feedback, config: Config) -> None:
    """The labelling page's pairs, added to prefs (or prefs itself when there is none);
    nothing when prepare.files already names the feedback file."""
    import pandas as pd

    from rlhf.data.contracts import DataValidationError

    if any(same_file(spec.path, FEEDBACK_FILE) for spec in config.files.values() if Path(spec.path).exists()):
        return
    pairs = f"{len(feedback)} human feedback pair{'' if len(feedback) == 1 else 's'}"
    described = f"{FEEDBACK_FILE.as_posix()} ({pairs})"
    prefs = tables.get("prefs")
    if prefs is None:
        tables["prefs"], origins["prefs"] = feedback.reset_index(drop=True), described
        return
    if len(prefs) and isinstance(prefs["prompt"].iloc[0], str) != isinstance(feedback["prompt"].iloc[0], str):
        raise DataValidationError(
            FEEDBACK_FILE,
            ["its prompts and those of the other preference pairs must both be text or both be messages"],
        )
    tables["prefs"] = pd.concat([prefs, feedback], ignore_index=True)
    origins["prefs"] = f"{origins['prefs']} + {described}"


def derive(tables: dict, origins: dict, task, config: Config) -> None:
    """Fill what the given tables imply (module docstring); leave the rest empty."""
    import numpy as np
    import pandas as pd

    from rlhf.data.contracts import CONTRACTS, DataValidationError, prompt_key

    for name, what in (("prefs", "pairs"), ("prm", "step-labelled solutions")):
        table = tables.get(name)
        if table is None or not len(table) or f"{name}_eval" in tables:
            continue
        if len(table) < 2:
            raise DataValidationError(
                origins[name], [f"one row cannot be split into {name} and {name}_eval: add rows, or give {name}_eval"]
            )
        # Whole prompts are held out: several pairs (solutions) of one prompt on both sides
        # would score the held-out set on prompts the model was trained on.
        keys = [prompt_key(p) for p in table["prompt"]]
        distinct = list(dict.fromkeys(keys))
        order = np.random.default_rng(config.seed).permutation(len(distinct))
        if len(distinct) < 2:
            raise DataValidationError(
                origins[name],
                [f"every row has one prompt, which cannot be split into {name} and {name}_eval: give {name}_eval"],
            )
        target, held_keys, held = max(1, round(config.heldout_share * len(table))), set(), 0
        for index in order[:-1]:  # at least one prompt stays for training
            if held >= target:
                break
            held_keys.add(distinct[index])
            held += keys.count(distinct[index])
        held_out = np.array([k in held_keys for k in keys])
        tables[f"{name}_eval"] = table[held_out].reset_index(drop=True)
        tables[name] = table[~held_out].reset_index(drop=True)
        origins[f"{name}_eval"] = (
            f"derived: {held} {what} of {len(held_keys)} prompts held out of {name} (heldout_share "
            f"{config.heldout_share}; no prompt on both sides)"
        )
    prefs = tables.get("prefs")
    if prefs is not None and len(prefs) and "unpaired" not in tables:
        rows = [
            {"prompt": r.prompt, "completion": completion, "label": label}
            for r in prefs.itertuples(index=False)
            for completion, label in ((r.chosen, True), (r.rejected, False))
        ]
        tables["unpaired"] = pd.DataFrame({c: pd.Series([r[c] for r in rows], dtype=object) for c in rows[0]})
        origins["unpaired"] = "derived: prefs pairs as desirable / undesirable rows"
    if "prompts" in tables and "answer" not in tables["prompts"]:
        # The answer is optional in a prompts file; the stages that read the table find the
        # column, empty (the PRM's derived labels, the rounds' answer check then have none).
        tables["prompts"]["answer"] = pd.Series([None] * len(tables["prompts"]), dtype=object)
    if "prompts" not in tables:
        tables["prompts"] = prompts_from_sft(tables["sft"], task)
        answered = int(tables["prompts"]["answer"].notna().sum())
        origins["prompts"] = f"derived: sft prompts, {answered} with an answer read by task {task.name!r}"
        if task.checks_answers and not answered and len(tables["sft"]):
            if task.name == "builtin" and "sft" in config.files:
                # The default kind left as it was with files of another task: the run would
                # train, then fail the gate on the built-in format, pointing the wrong way.
                raise DataValidationError(
                    origins["sft"],
                    [
                        f"none of the {len(tables['sft'])} sft demonstrations ends with `answer N`, the answer "
                        "task.kind 'builtin' reads (the default: the built-in arithmetic task, whose format "
                        "`a+b=c; ...; answer N` the gate also tests): set task.kind to the kind that reads your "
                        "files' answers (gsm8k, math, last_number, regex, choice), or none"
                    ],
                )
            # Not an error for a kind chosen: evaluation reads the eval files' answers (SFT on
            # general data, scored on a task). But a model trained on these demonstrations
            # writes no answer this task reads, and the answer rewards, rounds and the PRM's
            # derived labels have none (they fail at their stage).
            print(
                f"prepare: warning: task.kind {task.name!r} reads no answer in any of the {len(tables['sft'])} sft "
                "demonstrations: a model trained on them writes no answer it can check; set the task.kind that "
                "reads your files' answers (gsm8k, math, last_number, regex, choice) or none"
            )
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
    """One row per distinct sft prompt, with the reference answer the task reads from its
    first demonstration (a prompt whose demonstrations state different answers is warned
    of) (`Task.demonstration_answer`; None where it reads none, or for a task
    with no checkable answers)."""
    import pandas as pd

    prompts = []
    if "messages" in sft.columns:
        pairs = []
        for messages in sft["messages"]:
            if len(messages) >= 2 and messages[-1]["role"] == "assistant":
                pairs.append((list(messages[:-1]), messages[-1]["content"]))
    else:
        pairs = list(zip(sft["prompt"], sft["completion"]))
    first: dict[str, object] = {}  # each prompt's first answer, by its repr
    conflicts: dict[str, set] = {}
    for prompt, completion in pairs:
        key = repr(prompt)
        text = completion if isinstance(completion, str) else "".join(m["content"] for m in completion)
        answer = task.demonstration_answer(text) if task.checks_answers else None
        if key in first:
            if answer is not None and first[key] is not None and answer != first[key]:
                conflicts.setdefault(key, {first[key]}).add(answer)
            continue
        first[key] = answer
        prompts.append(prompt)
    if conflicts:
        key, values = next(iter(conflicts.items()))
        print(
            f"prepare: warning: {len(conflicts)} sft prompt(s) have demonstrations with different answers (e.g. "
            f"{key[:80]}: {', '.join(sorted(map(str, values)))}); prompts keeps the first, and the answer rewards and "
            "rounds count the others wrong: give prepare.files.prompts with the answer to check"
        )
    answers = pd.Series(list(first.values()), dtype=object)
    return pd.DataFrame({"prompt": pd.Series(prompts, dtype=object), "answer": answers})


def table_path(root: Path, name: str) -> Path:
    """Where file `name` goes under `root`: eval_<suite> into the eval folder."""
    if name.startswith(EVAL_PREFIX):
        return root / EVAL_DIR.relative_to(DATA_DIR) / f"{name[len(EVAL_PREFIX) :]}.parquet"
    return root / f"{name}.parquet"


def write_prepared(root: Path, config: Config, tables: dict, origins: dict, feedback=None) -> dict:
    """Every table as Parquet and the manifest, replacing `root` atomically; the manifest."""
    manifest = {
        "source": config.source,
        "rows": {name: len(frame) for name, frame in tables.items()},
        "origin": origins,
        # Eval prompts the training tables hold too, per suite and table.
        "eval_overlap": eval_overlap(tables, origins),
        # The pairs of the labelling page's file (in prefs: added, or named in prepare.files).
        "feedback": {"path": FEEDBACK_FILE.as_posix(), "rows": 0 if feedback is None else len(feedback)},
    }
    with atomic_dir(root) as tmp:
        for name, frame in tables.items():
            path = table_path(tmp, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            frame.to_parquet(path, index=False)
        write_json(tmp / "manifest.json", manifest)
    return manifest


def main() -> None:
    import mlflow

    from rlhf.tasks import get_task
    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_all()
    config = params["prepare"]
    with stage_run("prepare", config):
        feedback = read_feedback(FEEDBACK_FILE)
        tables, origins = run(config, get_task(params["task"]), feedback=feedback)
        manifest = write_prepared(DATA_DIR, config, tables, origins, feedback)
        mlflow.log_metrics(numeric_metrics({"rows": manifest["rows"], "feedback_rows": manifest["feedback"]["rows"]}))
        for name, frame in tables.items():
            print(f"prepare: {name}: {len(frame)} rows ({origins[name]})")


if __name__ == "__main__":
    main()
