"""lm-evaluation-harness as an evaluate backend: any harness task, and the pipeline's own
eval suites as local harness tasks.

Wraps EleutherAI's lm-eval (its `HFLM` model wrapper, task registry and `simple_evaluate`)
rather than re-implementing prompt building, batching and metric aggregation. Two halves:

* `write_suite_task` turns a prepared eval suite (Parquet: `prompt`, `answer`, optional
  `difficulty`) into a harness task YAML that reads the file through `datasets`' parquet
  builder, so nothing is downloaded. The task is zero-shot, feeds the prompt verbatim
  (no description, no target delimiter, no few-shot), decodes greedily for
  `max_new_tokens` and stops at the tokenizer's EOS only: an empty `until` leaves only the
  EOS that `HFLM.generate_until` always adds (with no `until`, lm-eval stops at the
  `fewshot_delimiter`: ``"\\n\\n"`` by default, which would cut the built-in task's
  completions short, and after one token when it is empty). Each completion is scored
  by the pipeline's own `Task` (`score_completion`), so the harness accuracy is evaluate's
  accuracy by construction whenever the generations are the same, and they are: run with
  the default `add_bos_token=None` (the tokenizer's own choice), `run_harness` encodes
  prompts as `rlhf.models.generation.generate` does (the BOS a Llama-style tokenizer puts
  before plain text, nothing else), pads on the left and decodes without special tokens
  (tests/test_harness.py checks both).
* `run_harness` evaluates an already-loaded model and tokenizer on harness tasks: names
  from lm-eval's registry, tasks in `include_path` (a folder of task YAMLs, e.g. the one
  `write_suite_task` wrote) or paths to task YAMLs. A suite task opens no connection,
  with the Hub on or off (tested with sockets refused). Stock harness tasks download their
  datasets from the Hugging Face Hub into the `datasets` cache on first use: with
  ``HF_HUB_OFFLINE=1`` (or no network) they run only from a warm cache.

Metric names. lm-eval keys results as ``"<metric>,<filter>"`` (``"acc,none"``,
``"acc_stderr,none"``, ``"exact_match,strict-match"``). `clean_metrics` keeps the numeric
ones and maps a key with the default filter ``none`` to ``<metric>`` and any other to
``<metric>/<filter>``: ``acc``, ``acc_stderr``, ``exact_match/strict-match``,
``exact_match_stderr/strict-match``. A stderr lm-eval could not compute (``"N/A"``) is
left out.

Side effects of lm-eval worth knowing: `simple_evaluate` reseeds Python's, NumPy's and
torch's global generators (restored here afterwards), logs environment details (about 2 s:
`torch.utils.collect_env`), and indexing its ~15,000 built-in task YAMLs takes about 9 s
on one core, which is skipped when every task named is found in `include_path` alone.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
import re
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from rlhf.params import InputError
from rlhf.tasks import Task, TaskConfig, get_task

# The split name `datasets` gives a single data file loaded without a split mapping.
_SPLIT = "train"
_TASK_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_DEFAULT_FILTER = "none"


# ----------------------------------------------------------------------------- suite tasks


def write_suite_task(
    suite_parquet: str | Path,
    task_name: str,
    out_dir: str | Path,
    *,
    max_new_tokens: int,
    task_config: TaskConfig | None = None,
) -> Path:
    """Write `<out_dir>/<task_name>.yaml`, a harness task over the eval suite in
    `suite_parquet`, and `<task_name>_scoring.py` beside it (its `process_results`, which
    calls `score_completion` with `task_config`: lm-eval resolves ``!function`` against
    files next to the YAML first, and a YAML cannot pass arguments to a function).

    Returns the YAML's path; `run_harness(..., tasks=[task_name], include_path=out_dir)`
    runs it, and so does ``lm_eval --include_path <out_dir> --tasks <task_name>``.
    """
    import pandas as pd
    import yaml

    suite_parquet, out_dir = Path(suite_parquet).resolve(), Path(out_dir)
    if not _TASK_NAME_RE.match(task_name):
        raise ValueError(
            f"harness task name {task_name!r}: use letters, digits, '_' and '-' only "
            "(it names the task's YAML and scoring module)"
        )
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not suite_parquet.is_file():
        raise FileNotFoundError(f"eval suite {suite_parquet} does not exist; stage prepare writes the suites")
    suite = pd.read_parquet(suite_parquet)
    missing = [c for c in ("prompt", "answer") if c not in suite.columns]
    if missing:
        raise ValueError(
            f"{suite_parquet}: a harness suite needs columns prompt and answer; missing {missing} "
            f"(found {list(suite.columns)})"
        )
    not_text = [i + 1 for i, p in enumerate(suite["prompt"]) if not isinstance(p, str)]
    if not_text:
        raise ValueError(
            f"{suite_parquet} rows {not_text[:10]}: 'prompt' is a conversation; a suite task feeds text prompts "
            "only (evaluate scores a conversational suite itself: leave it out of evaluate.harness.suites)"
        )
    task_config = task_config or TaskConfig()
    # Only the keys the user set (and the kind): a kind rejects settings it does not read.
    config = {"kind": task_config.kind, **task_config.model_dump(mode="json", exclude_unset=True)}
    metrics = ["accuracy"] + (["format_rate"] if get_task(TaskConfig(**config)).has_format else [])
    spec = {
        "task": task_name,
        "dataset_path": "parquet",
        "dataset_kwargs": {"data_files": str(suite_parquet)},
        "test_split": _SPLIT,
        "output_type": "generate_until",
        # A column name: lm-eval returns the value as it is (no template, no stripping).
        "doc_to_text": "prompt",
        "doc_to_target": "answer",
        "description": "",
        "target_delimiter": "",
        "fewshot_delimiter": "",
        "num_fewshot": 0,
        "generation_kwargs": {"until": [], "do_sample": False, "max_gen_toks": max_new_tokens},
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in metrics],
        "metadata": {"version": 1.0, "suite": str(suite_parquet), "rlhf_task": config},
    }
    module = f"{task_name}_scoring"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{module}.py").write_text(
        f'"""Scores harness task {task_name!r}: written by rlhf.evaluation.harness.write_suite_task."""\n\n'
        "from rlhf.evaluation.harness import score_completion\n\n"
        f"TASK_CONFIG = {config!r}\n\n\n"
        "def process_results(doc, results):\n"
        "    return score_completion(TASK_CONFIG, doc, results)\n"
    )
    path = out_dir / f"{task_name}.yaml"
    text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
    path.write_text(
        f"# Written by rlhf.evaluation.harness.write_suite_task from {suite_parquet}\n"
        f"{text}process_results: !function {module}.process_results\n"
    )
    return path


@functools.cache
def _task(config_json: str) -> Task:
    return get_task(TaskConfig(**json.loads(config_json)))


def score_completion(task_config: Mapping, doc: Mapping, results: Sequence[str]) -> dict[str, float]:
    """A suite task's per-problem metrics (lm-eval's `process_results`): `accuracy` is the
    pipeline task's `is_correct` against the row's answer (left out for a row without
    one, as evaluate leaves it out), `format_rate` its `is_well_formatted` (tasks with a
    format)."""
    task = _task(json.dumps(dict(task_config), sort_keys=True))
    completion = results[0]
    metrics: dict[str, float] = {}
    answer = doc.get("answer")
    if answer is not None and not (isinstance(answer, float) and answer != answer):
        metrics["accuracy"] = float(task.is_correct(completion, answer))
    if task.has_format:
        metrics["format_rate"] = float(task.is_well_formatted(completion))
    return metrics


# ----------------------------------------------------------------------------- running


def evaluate_harness(
    model,
    tokenizer,
    tasks: Sequence[str],
    *,
    include_path: str | Path | Sequence[str | Path] | None = None,
    limit: int | None = None,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    device: str | None = None,
    apply_chat_template: bool | str = False,
    system_instruction: str | None = None,
    add_bos_token: bool | None = None,
    bootstrap_iters: int = 100_000,
    log_samples: bool = False,
) -> dict:
    """lm-eval's whole results dict (`simple_evaluate`) for `model` on `tasks`.

    `tasks`: harness task names (lm-eval's registry, or `include_path`: one folder of task
    YAMLs or several) or task YAML paths.
    `limit`: the first problems of each task. `max_new_tokens`: a cap for every generative
    task (None keeps each task's own; a suite task's is the one given to
    `write_suite_task`). `device`: moves `model` there first (None: where it is).
    `apply_chat_template`: render prompts through the tokenizer's chat template (True) or a
    named one, for chat models. `add_bos_token`: None lets the tokenizer decide (lm-eval's
    default, as in published harness numbers, and what the pipeline's `generate` does);
    True or False forces a BOS or none. `log_samples`: keep every document and generation under
    ``results["samples"]`` (see `harness_completions`).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    tasks = [str(t) for t in tasks]
    task_manager = _task_manager(tasks, include_path)
    if device is not None:
        model.to(device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=add_bos_token)
    with _restored_rng():
        results = simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=task_manager,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
            apply_chat_template=apply_chat_template,
            system_instruction=system_instruction,
            gen_kwargs={"max_gen_toks": max_new_tokens} if max_new_tokens is not None else None,
        )
    return results


def run_harness(model, tokenizer, tasks: Sequence[str], **kwargs) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of `model` on harness `tasks`; metric names as
    `clean_metrics` writes them, e.g. ``{"rlhf_dev": {"accuracy": 0.5,
    "accuracy_stderr": 0.08, ...}}``. Keyword arguments: those of `evaluate_harness`."""
    return clean_metrics(evaluate_harness(model, tokenizer, tasks, **kwargs))


def clean_metrics(results: Mapping) -> dict[str, dict[str, float]]:
    """The numeric metrics of lm-eval's ``results["results"]``, keyed as the module
    docstring says (``"acc,none"`` → ``acc``, ``"f1,strict"`` → ``f1/strict``)."""
    cleaned: dict[str, dict[str, float]] = {}
    for task_name, values in results["results"].items():
        metrics = {}
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            metrics[metric if filter_name == _DEFAULT_FILTER else f"{metric}/{filter_name}"] = float(value)
        cleaned[task_name] = metrics
    return cleaned


def harness_completions(results: Mapping, task_name: str, filter_name: str = _DEFAULT_FILTER) -> list[str]:
    """The generations of `task_name` in document order, after the filter `filter_name`
    (`evaluate_harness(..., log_samples=True)` keeps them)."""
    return [row["filtered_resps"][0] for row in _samples(results, task_name, filter_name)]


def harness_outcomes(results: Mapping, task_name: str, metric: str, filter_name: str = _DEFAULT_FILTER) -> list[float]:
    """The per-problem values of `metric` for `task_name` in document order (problems
    without one left out, e.g. a suite row without an answer): what evaluate's bootstrap
    intervals, per-difficulty accuracy and the gate's paired tests read."""
    return [float(row[metric]) for row in _samples(results, task_name, filter_name) if metric in row]


def _samples(results: Mapping, task_name: str, filter_name: str) -> list[dict]:
    samples = (results.get("samples") or {}).get(task_name)
    if samples is None:
        raise KeyError(f"no logged samples of harness task {task_name!r}; run evaluate_harness with log_samples=True")
    return sorted((s for s in samples if s["filter"] == filter_name), key=lambda s: s["doc_id"])


def check_tasks(tasks: Sequence[str], include_path=None) -> None:
    """Fail (naming close matches) when a task is in neither lm-eval's registry nor
    `include_path`: what a stage calls before it loads any model."""
    _task_manager([str(t) for t in tasks], include_path)


class HarnessDataError(InputError, RuntimeError):
    """A harness task whose documents cannot be loaded (its dataset is not in the cache and
    the Hub cannot be reached, or no longer has it)."""


def load_tasks(tasks: Sequence[str], include_path=None, key: str = "evaluate.harness.tasks") -> None:
    """Load each task's documents as `simple_evaluate` will (downloading a registry task's
    dataset into the `datasets` cache on first use), so that a task that cannot be had
    fails here, naming it and `key`, before any model is evaluated (not inside lm-eval
    after the eval suites of the first model)."""
    from lm_eval.tasks import get_task_dict

    tasks = [str(t) for t in tasks]
    manager = _task_manager(tasks, include_path)
    for name in tasks:
        try:
            get_task_dict([name], manager)
        except Exception as error:  # datasets' and the Hub client's errors: connection, not found, gated
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise HarnessDataError(
                f"{key}: harness task {name!r} cannot load its documents ({type(error).__name__}: {first}). "
                "Run once with the network (its dataset is cached for offline runs), or remove the task"
            ) from error


def _task_manager(tasks: list[str], include_path):
    """lm-eval's task index, built from `include_path` alone when every task named is a
    task there or a YAML path (indexing the built-in tasks takes ~9 s), else with the
    built-in tasks as well. Unknown names raise here, before any model work. The index is
    kept for the process while its folders are unchanged (`_indexed`): evaluate scores
    each model with the same tasks, and a task manager is only read (each
    `simple_evaluate` builds its tasks afresh from it)."""
    from lm_eval.tasks._index import Kind

    paths = [] if include_path is None else [include_path] if isinstance(include_path, (str, Path)) else include_path
    paths = [str(p) for p in paths]
    for path in paths:
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"harness include_path {path} is not a folder; point it at a folder of lm-eval task YAMLs "
                "(write_suite_task writes one per eval suite)"
            )
    if not tasks:
        raise ValueError("no harness tasks named")
    names = [t for t in tasks if not (t.endswith((".yaml", ".yml")) and Path(t).is_file())]
    if paths:
        local = _indexed(tuple(paths), False, _folders_stamp(paths))
        if all(n in local.task_index and local.task_index[n].kind in (Kind.TASK, Kind.PY_TASK) for n in names):
            return local
    manager = _indexed(tuple(paths), True, _folders_stamp(paths))
    unknown = [n for n in names if n not in manager.task_index]
    if unknown:
        where = " or ".join(["lm-eval's registry", *paths])
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hints.append(f"{name!r}" + (f" (close: {', '.join(close)})" if close else ""))
        raise ValueError(
            f"unknown harness task(s) {', '.join(hints)}: not in {where}. Name a registered task "
            "(`lm_eval ls tasks`), a task YAML in include_path, or a suite task written by write_suite_task"
        )
    return manager


def _folders_stamp(paths: Sequence[str]) -> tuple:
    """What the index of `paths` depends on: each file's path, size and modification time."""
    files = [(path, [(f, f.stat()) for f in Path(path).rglob("*") if f.is_file()]) for path in paths]
    return tuple(
        (path, tuple(sorted((str(f), st.st_size, st.st_mtime_ns) for f, st in found))) for path, found in files
    )


@functools.lru_cache(maxsize=4)
def _indexed(paths: tuple[str, ...], defaults: bool, stamp: tuple):
    """A TaskManager over `paths` (and the built-in tasks with `defaults`); `stamp` is
    `_folders_stamp(paths)`, so a folder that changed is indexed again."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths) or None, include_defaults=defaults)


@contextmanager
def _restored_rng():
    """simple_evaluate seeds the global generators; give the caller its own back."""
    import numpy as np
    import torch

    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
