"""Assembling the prepared data folder (data/prepared: one Parquet table per contract and
one per eval suite, plus manifest.json) from the built-in generators, the user's files and
the labelling page's pairs: validation of every row of every file before anything is
published, the held-out splits by whole prompts, and the tables derived from others.

Stage prepare (stages/prepare.py) holds the params (`Config`: its docstring says what a
user gives and what is derived) and calls `prepare`; the functions here take that Config
and a task (rlhf.tasks) and stream the tables through rlhf.data.prepared's writers, so a
file larger than memory is prepared a batch at a time. Written here: the contracts, the
held-out split by whole prompts and the derived tables are this pipeline's own; the reading
is the libraries' (rlhf.data.readers: pandas, pyarrow, `datasets` for saved and Hub
datasets).
"""

from __future__ import annotations

from pathlib import Path

from rlhf.atomic import write_json
from rlhf.layout import DATA_DIR, EVAL_DIR, EVAL_PREFIX, FEEDBACK_FILE
from rlhf.tasks.arithmetic import TaskSizes, TaskSpec, generate_datasets
from rlhf.tasks.word_problems import WordProblemSizes

# File names in data/prepared and the contract each follows; eval_<suite> are prompts.
FILE_KINDS = {
    "sft": "sft",
    "prefs": "preference",
    "prefs_eval": "preference",
    "unpaired": "unpaired",
    "prm": "prm",
    "prm_eval": "prm",
    "prompts": "prompts",
    "compress": "context",
}
# What each file can be derived from (prepare itself, or stage prm for the step labels).
DERIVED_FROM = {"prefs_eval": "prefs", "prm_eval": "prm", "unpaired": "prefs", "prompts": "sft"}
# Pairs chosen on the labelling page (rlhf.cli.label) are in FEEDBACK_FILE (rlhf/layout.py),
# added to prefs when the file has rows.


def kind_of(name: str) -> str:
    return "prompts" if name.startswith(EVAL_PREFIX) else FILE_KINDS[name]


def read_feedback(path: str | Path = FEEDBACK_FILE):
    """The human feedback pairs in `path` (a preference JSONL file), validated; None when the
    file is absent or has no rows. Read under a shared lock: the labelling page appends
    under an exclusive one, so no row lands while prepare reads; a file that changed anyway
    (a writer that takes no lock) fails, rather than being recorded as read."""
    import fcntl
    import os

    from rlhf.data.contracts import DataValidationError

    path = Path(path)
    # Opened here (not only by the contract's reader), so that an empty file is not an error.
    if not path.is_file():
        return None
    with open(path, "rb") as file:
        fcntl.flock(file, fcntl.LOCK_SH)
        before = os.fstat(file.fileno())
        if not any(line.strip() for line in file):
            return None
        frame = load_contract_of_feedback(path)
        after = os.stat(path)
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise DataValidationError(
            path, ["changed while prepare read it (written without the labelling page's lock); run prepare again"]
        )
    return frame


def load_contract_of_feedback(path: Path):
    from rlhf.data.contracts import load_contract

    return load_contract(path, "preference")


def same_file(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def prepare(root: Path, config, task, feedback=None) -> dict:
    """Write every prepared table and the manifest into `root`, replacing it atomically; the
    manifest. User files are read, validated and written one batch at a time (rlhf.data:
    `contract_batches`, `TableWriter`), every row of every file validated before anything
    is published: on any problem `root` is left as it was. Then the human `feedback` pairs
    (a frame from `read_feedback`, or None) are added to prefs, and the absent tables are
    derived (streaming the written tables) or left empty."""

    from rlhf.atomic import atomic_dir

    with atomic_dir(root) as tmp:
        tables = Tables(tmp, config)
        for name, frame in generated_tables(config):
            tables.write(name, frame, config.source)
        write_files(tables, config, task)
        if feedback is not None and len(feedback):
            add_feedback(tables, feedback, config)
        derive(tables, task, config)
        check_one_format(tables)
        manifest = {
            "source": config.source,
            "rows": {name: writer.rows for name, writer in tables.writers.items()},
            "origin": {name: writer.origin for name, writer in tables.writers.items()},
            # Eval prompts the training tables hold too, per suite and table.
            "eval_overlap": eval_overlap(tables),
            # The pairs of the labelling page's file (in prefs: added, or named in prepare.files).
            "feedback": {"path": FEEDBACK_FILE.as_posix(), "rows": 0 if feedback is None else len(feedback)},
        }
        write_json(tmp / "manifest.json", manifest)
    return manifest


def generated_tables(config):
    """(file name, frame) of every table the built-in generator `config.source` names
    writes; nothing for source files."""
    import pandas as pd

    from rlhf.data.contracts import as_conversation

    if config.source == "builtin":
        spec = TaskSpec(**config.builtin.model_dump(exclude={"sizes"}))
        for name, rows in generate_datasets(spec, TaskSizes(**config.builtin.sizes), config.seed).items():
            yield name, pd.DataFrame(rows)
    elif config.source == "word_problems":
        from rlhf.tasks import word_problems

        sizes = WordProblemSizes(**config.word_problems.sizes)
        chars = config.word_problems.context_chars
        for name, rows in word_problems.generate_datasets(sizes, config.seed, context_chars=chars).items():
            frame = pd.DataFrame(rows)
            yield name, as_conversation(frame) if config.word_problems.chat else frame


class Tables:
    """The tables being written under `root`, by file name (`TableWriter`s). prefs and prm,
    when their held-out table is to be derived, are staged first (keyed by prompt) and split
    by `derive`."""

    def __init__(self, root: Path, config):
        self.root, self.writers = root, {}
        given = config.given()
        self.staged = {name for name in ("prefs", "prm") if f"{name}_eval" not in given}

    def writer(self, name: str, origin: str):
        from rlhf.data.prepared import TableWriter

        if name not in self.writers:
            if name in self.staged:
                self.writers[name] = TableWriter(self.root / f".{name}.all.parquet", origin, keyed=True)
            else:
                self.writers[name] = TableWriter(table_path(self.root, name), origin)
        return self.writers[name]

    def write(self, name: str, frame, origin: str) -> None:
        self.writer(name, origin).write(frame, origin)


def write_files(tables: Tables, config, task) -> None:
    """Every user file, validated batch by batch and appended to its table; one
    `DataValidationError` naming every problem of every file."""
    from rlhf.data.contracts import DataValidationError, as_conversation, contract_batches

    errors = []
    for name, spec in config.files.items():
        kind = kind_of(name)
        answered = False
        existing = tables.writers.get(name)
        added = existing is not None and existing.rows > 0  # to the built-in table

        def checks(batch, first_row, name=name, kind=kind, spec=spec):
            problems = answer_problems(batch, task, first_row) if kind == "prompts" else []
            if kind == "prm":
                problems += step_problems(batch, task, f"prepare.files.{name}", first_row)
            return problems

        try:
            for batch in contract_batches(
                spec.path, kind, spec.columns, split=spec.split, config=spec.config, checks=checks
            ):
                if spec.chat:
                    batch = as_conversation(batch)
                answered = answered or has_answers(batch)
                if added and set(batch.columns) != set(existing.columns):
                    raise DataValidationError(
                        spec.path,
                        [f"prepare.files.{name}: columns {sorted(batch.columns)} cannot be added to the built-in "
                         f"table's {sorted(existing.columns)}; give the same format, or use source: files"],
                    )  # fmt: skip
                if not errors:  # after a problem, files are only validated
                    tables.write(name, batch, str(spec.path))
        except DataValidationError as error:
            errors.append(error)
            continue
        if name.startswith(EVAL_PREFIX) and task.checks_answers and not answered:
            errors.append(DataValidationError(spec.path, [
                f"prepare.files.{name}: no row has an answer, and task.kind {task.name!r} scores an eval suite by "
                "its answers (accuracy, the gate's default tests): map the file's answer column "
                f"(prepare.files.{name}.columns: {{answer: <column>}}), or choose task.kind none"
            ]))  # fmt: skip
            continue
        if added:
            existing.origin = f"builtin + {spec.path}"
    if errors:
        problems = [f"{e.path}: {p}" for e in errors for p in e.problems]
        raise DataValidationError(", ".join(e.path for e in errors), problems, sum(e.unlisted for e in errors))


def prompt_columns(writer) -> list[str]:
    """The columns that hold a table's prompts (rlhf.data.prepared.row_prompts)."""
    columns = list(writer.columns or ())
    return ["messages"] if "messages" in columns else [c for c in ("prompt", "context") if c in columns]


def eval_overlap(tables: Tables) -> dict:
    """Per eval suite, how many of its prompts each training table holds too (the model is
    then scored on what it was trained on), printed; {} when none. The manifest keeps it.
    The suites' prompt keys are held; the training tables are streamed."""
    from rlhf.data.prepared import prepared_batches, prompt_hash, row_prompts

    suites = {}
    for name, writer in tables.writers.items():
        if name.startswith(EVAL_PREFIX) and writer.rows:
            suites[name] = {prompt_hash(p) for batch in prepared_batches(writer.path, prompt_columns(writer))
                            for p in row_prompts(batch)}  # fmt: skip
    if not suites:
        return {}
    every = set().union(*suites.values())
    found: dict[str, set] = {}
    for name, writer in tables.writers.items():
        if name.startswith(EVAL_PREFIX) or name.endswith("_eval") or not writer.rows:
            continue
        for batch in prepared_batches(writer.path, prompt_columns(writer)):
            found.setdefault(name, set()).update(k for k in map(prompt_hash, row_prompts(batch)) if k in every)
    overlap = {}
    for suite, held in suites.items():
        counts = {n: len(held & keys) for n, keys in found.items() if held & keys}
        if counts:
            overlap[suite] = counts
            listed = ", ".join(f"{count} in {n}" for n, count in counts.items())
            print(f"prepare: {suite} ({tables.writers[suite].origin}): of its {len(held)} prompts, {listed}; a model "
                  "trained on those is scored on what it was trained on")  # fmt: skip
    return overlap


def check_one_format(tables: Tables) -> None:
    """Every table the policy trains, samples or is evaluated on holds one format, text or
    messages (each file already does, by its contract): a policy trained through the chat
    template and sampled or scored without it (or the reverse) is quietly wrong. The PRM's
    tables may differ (its model may be another)."""
    from rlhf.data.contracts import DataValidationError

    formats: dict[str, list[str]] = {}
    for name, writer in tables.writers.items():
        if kind_of(name) == "prm" or not writer.rows or writer.first_format is None:
            continue
        formats.setdefault(writer.first_format, []).append(name)
    if len(formats) < 2:
        return
    origins = {name: writer.origin for name, writer in tables.writers.items()}
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


def answer_problems(frame, task, first_row: int = 0) -> list[str]:
    """The rows of a prompts table whose answer the task cannot read as a reference (a
    numeric task's answer that is not a number, a choice task's letter not among its
    choices): caught here, not after a stage has sampled or evaluated for an hour.
    `first_row`: the number of rows before `frame` in its file."""
    if not task.checks_answers or "answer" not in frame:
        return []
    problems = []
    for index, answer in enumerate(frame["answer"], start=first_row + 1):
        if answer is None or (isinstance(answer, float) and answer != answer):
            continue
        try:
            task.reference_answer(answer)
        except ValueError as error:
            problems.append(f"row {index}: 'answer' {error}; correct it, or leave it empty (no answer)")
    return problems


def step_problems(frame, task, key: str, first_row: int = 0) -> list[str]:
    """The rows of a step-labelled table with a step that holds the task's step separator:
    the PRM would learn those labels on these steps, and then score solutions split at the
    separator (best-of-N, MCTS, the rounds' checks), other steps than those labelled."""
    separator = task.step_separator
    problems = []
    for index, steps in enumerate(frame["completions"], start=first_row + 1):
        split = [k for k, step in enumerate(steps) if separator in step.strip()]
        if split:
            problems.append(
                f"row {index}: step {split[0] + 1} holds the task's step separator {separator!r} "
                f"({_excerpt(steps[split[0]])}), so the PRM would score it as several steps; split it there "
                f"(with a label for each), or set task.step_separator (the file: {key})"
            )
    return problems


def _excerpt(text: str, chars: int = 40) -> str:
    return repr(text if len(text) <= chars else text[: chars - 3] + "...")


def add_feedback(tables: Tables, feedback, config) -> None:
    """The labelling page's pairs, added to prefs (or prefs itself when there is none);
    nothing when prepare.files already names the feedback file."""
    from rlhf.data.contracts import DataValidationError, value_format

    if any(same_file(spec.path, FEEDBACK_FILE) for spec in config.files.values() if Path(spec.path).exists()):
        return
    pairs = f"{len(feedback)} human feedback pair{'' if len(feedback) == 1 else 's'}"
    described = f"{FEEDBACK_FILE.as_posix()} ({pairs})"
    prefs = tables.writers.get("prefs")
    if prefs is None or not prefs.rows:
        tables.write("prefs", feedback.reset_index(drop=True), described)
        tables.writers["prefs"].origin = described
        return
    if prefs.first_format != value_format(feedback["prompt"].iloc[0]):
        raise DataValidationError(
            FEEDBACK_FILE,
            ["its prompts and those of the other preference pairs must both be text or both be messages"],
        )
    prefs.write(feedback.reset_index(drop=True), str(FEEDBACK_FILE))
    prefs.origin = f"{prefs.origin} + {described}"


def held_out_keys(keys, share: float, seed: int):
    """The prompt keys held out of a table whose rows have prompt `keys` (in row order):
    whole prompts, drawn from `seed` in the order of their first row, until `share` of the
    rows is held; at least one prompt stays. (the keys held, the rows held, the prompts)."""
    import numpy as np

    distinct, first, counts = np.unique(keys, return_index=True, return_counts=True)
    order_of_appearance = np.argsort(first)
    distinct, counts = distinct[order_of_appearance], counts[order_of_appearance]
    order = np.random.default_rng(seed).permutation(len(distinct))
    target, held_keys, held = max(1, round(share * len(keys))), [], 0
    for index in order[:-1]:  # at least one prompt stays for training
        if held >= target:
            break
        held_keys.append(distinct[index])
        held += int(counts[index])
    return np.sort(np.array(held_keys, dtype=np.uint64)), held, len(distinct)


def split_staged(tables: Tables, name: str, what: str, config) -> None:
    """Split the staged table `name` into `name` and `<name>_eval` by whole prompts
    (`held_out_keys`), streaming it."""
    import numpy as np

    from rlhf.data.contracts import DataValidationError
    from rlhf.data.prepared import TableWriter, prepared_batches

    staged = tables.writers[name]
    staged.close()
    origin = staged.origin
    keys = staged.all_keys()
    if len(keys) < 2:
        raise DataValidationError(
            origin, [f"one row cannot be split into {name} and {name}_eval: add rows, or give {name}_eval"]
        )
    # Whole prompts are held out: several pairs (solutions) of one prompt on both sides
    # would score the held-out set on prompts the model was trained on.
    held_keys, held, distinct = held_out_keys(keys, config.heldout_share, config.seed)
    if distinct < 2:
        raise DataValidationError(
            origin, [f"every row has one prompt, which cannot be split into {name} and {name}_eval: give {name}_eval"]
        )
    kept = TableWriter(table_path(tables.root, name), origin)
    out = TableWriter(table_path(tables.root, f"{name}_eval"), (
        f"derived: {held} {what} of {len(held_keys)} prompts held out of {name} (heldout_share "
        f"{config.heldout_share}; no prompt on both sides)"
    ))  # fmt: skip
    offset = 0
    for batch in prepared_batches(staged.path):
        mask = np.isin(keys[offset : offset + len(batch)], held_keys)
        offset += len(batch)
        out.write(batch[mask].reset_index(drop=True))
        kept.write(batch[~mask].reset_index(drop=True))
    for writer in (kept, out):
        writer.close(staged.columns)
    staged.path.unlink()
    tables.writers[name], tables.writers[f"{name}_eval"] = kept, out


def derive(tables: Tables, task, config) -> None:
    """Fill what the given tables imply (module docstring); leave the rest empty."""
    import pandas as pd

    from rlhf.data.contracts import CONTRACTS
    from rlhf.data.prepared import prepared_batches

    for name, what in (("prefs", "pairs"), ("prm", "step-labelled solutions")):
        if name in tables.staged and name in tables.writers and tables.writers[name].rows:
            split_staged(tables, name, what, config)
        elif name in tables.writers and name in tables.staged:  # staged, but with no rows: an empty table
            tables.writers[name].close()
            tables.writers[name].path.unlink(missing_ok=True)
            del tables.writers[name]
    tables.staged = set()  # what is written from here on is final
    for writer in tables.writers.values():
        writer.close()
    prefs = tables.writers.get("prefs")
    if prefs is not None and prefs.rows and "unpaired" not in tables.writers:
        unpaired = tables.writer("unpaired", "derived: prefs pairs as desirable / undesirable rows")
        for batch in prepared_batches(prefs.path, ["prompt", "chosen", "rejected"]):
            unpaired.write(pd.DataFrame({
                "prompt": pd.Series([p for p in batch["prompt"] for _ in (0, 1)], dtype=object),
                "completion": pd.Series([c for pair in zip(batch["chosen"], batch["rejected"]) for c in pair],
                                        dtype=object),
                "label": [label for _ in range(len(batch)) for label in (True, False)],
            }))  # fmt: skip
        unpaired.close()
    if "prompts" in tables.writers and "answer" not in (tables.writers["prompts"].columns or ()):
        # The answer is optional in a prompts file; the stages that read the table find the
        # column, empty (the PRM's derived labels, the rounds' answer check then have none).
        given = tables.writers.pop("prompts")
        staged = given.path.with_name(".prompts.given.parquet")
        given.path.rename(staged)
        with_answers = tables.writer("prompts", given.origin)
        for batch in prepared_batches(staged):
            with_answers.write(batch.assign(answer=pd.Series([None] * len(batch), dtype=object)))
        with_answers.close(("prompt", "answer"))
        staged.unlink()
    if "prompts" not in tables.writers:
        sft = tables.writers.get("sft")
        prompts = tables.writer("prompts", "")
        answered = 0
        if sft is not None and sft.rows:
            for batch in sft_prompts(prepared_batches(sft.path), task):
                answered += int(batch["answer"].notna().sum())
                prompts.write(batch)
        prompts.close(("prompt", "answer"))
        prompts.origin = f"derived: sft prompts, {answered} with an answer read by task {task.name!r}"
        sft_rows = sft.rows if sft is not None else 0
        if task.checks_answers and not answered and sft_rows:
            if task.name == "builtin" and "sft" in config.files:
                # The default kind left as it was with files of another task: the run would
                # train, then fail the gate on the built-in format, pointing the wrong way.
                from rlhf.data.contracts import DataValidationError

                raise DataValidationError(
                    sft.origin,
                    [
                        f"none of the {sft_rows} sft demonstrations ends with `answer N`, the answer "
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
                f"prepare: warning: task.kind {task.name!r} reads no answer in any of the {sft_rows} sft "
                "demonstrations: a model trained on them writes no answer it can check; set the task.kind that "
                "reads your files' answers (gsm8k, math, last_number, regex, choice) or none"
            )
    for name, kind in FILE_KINDS.items():
        if name not in tables.writers:
            writer = tables.writer(name, (
                "absent: stage prm derives step labels by rollouts, or give prepare.files.prm"
                if kind == "prm"
                else f"absent: give prepare.files.{DERIVED_FROM.get(name, name)}"
            ))  # fmt: skip
            writer.close(CONTRACTS[kind]["required"])
    for writer in tables.writers.values():
        writer.close()


def prompts_from_sft(sft, task):
    """`sft_prompts` of one SFT frame, as one frame."""
    import pandas as pd

    frames = list(sft_prompts([sft], task))
    if not frames:
        return pd.DataFrame({"prompt": pd.Series([], dtype=object), "answer": pd.Series([], dtype=object)})
    return pd.concat(frames, ignore_index=True)


def sft_prompts(batches, task):
    """One row per distinct sft prompt of the SFT frames `batches`, with the reference answer
    the task reads from its first demonstration (a prompt whose demonstrations state
    different answers is warned of) (`Task.demonstration_answer`; None where it reads
    none, or for a task with no checkable answers), a frame per batch. Holds a key and an
    answer per distinct prompt."""
    import pandas as pd

    from rlhf.data.prepared import prompt_hash

    first: dict[int, object] = {}  # each prompt's first answer, by its key
    conflicts: dict[int, set] = {}
    example: tuple[str, set] | None = None
    for sft in batches:
        if "messages" in sft.columns:
            pairs = [(list(m[:-1]), m[-1]["content"]) for m in sft["messages"]
                     if len(m) >= 2 and m[-1]["role"] == "assistant"]  # fmt: skip
        else:
            pairs = list(zip(sft["prompt"], sft["completion"]))
        prompts, answers = [], []
        for prompt, completion in pairs:
            key = prompt_hash(prompt)
            text = completion if isinstance(completion, str) else "".join(m["content"] for m in completion)
            answer = task.demonstration_answer(text) if task.checks_answers else None
            if key in first:
                if answer is not None and first[key] is not None and answer != first[key]:
                    conflicts.setdefault(key, {first[key]}).add(answer)
                    if example is None or example[0] == repr(prompt):
                        example = (repr(prompt), conflicts[key])
                continue
            first[key] = answer
            prompts.append(prompt)
            answers.append(answer)
        if prompts:
            yield pd.DataFrame({"prompt": pd.Series(prompts, dtype=object), "answer": pd.Series(answers, dtype=object)})
    if conflicts:
        text, values = example
        print(
            f"prepare: warning: {len(conflicts)} sft prompt(s) have demonstrations with different answers (e.g. "
            f"{text[:80]}: {', '.join(sorted(map(str, values)))}); prompts keeps the first, and the answer rewards and "
            "rounds count the others wrong: give prepare.files.prompts with the answer to check"
        )


def table_path(root: Path, name: str) -> Path:
    """Where file `name` goes under `root`: eval_<suite> into the eval folder."""
    if name.startswith(EVAL_PREFIX):
        return root / EVAL_DIR.relative_to(DATA_DIR) / f"{name[len(EVAL_PREFIX) :]}.parquet"
    return root / f"{name}.parquet"
