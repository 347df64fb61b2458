"""Data at any size: prepare reads, validates and writes a batch at a time, and the training
stages read the prepared tables memory-mapped, with a fingerprint that holds across runs.

Small batches (BATCH_ROWS patched to a few rows) make a small file behave as a large one:
the results must be those of one batch, and every bad row in any batch must be named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import rlhf.data.contracts as contracts
import rlhf.data.readers as readers
from rlhf.data.contracts import DataValidationError, load_contract
from rlhf.tasks import TaskConfig, get_task
from stages.prepare import Config, prepare, run

REPO = Path(__file__).resolve().parents[1]
GSM8K = get_task(TaskConfig(kind="gsm8k"))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def user_files(tmp_path: Path) -> dict:
    pairs = [
        {"prompt": f"What is {a} plus {b}?", "chosen": f"#### {a + b}", "rejected": f"#### {a + b + 1}"}
        for a in range(9)
        for b in range(3)
    ]
    sft = [{"prompt": f"What is {a} plus 1?", "completion": f"{a}+1={a + 1}\n#### {a + 1}"} for a in range(23)]
    sft += sft[:4]  # repeated prompts: prompts has one row each
    return {
        "sft": {"path": write_jsonl(tmp_path / "sft.jsonl", sft)},
        "prefs": {"path": write_jsonl(tmp_path / "prefs.jsonl", pairs)},
        "eval_heldout": {"path": write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "What is 4 plus 1?", "answer": 5}])},
    }


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_prepare_in_small_batches_writes_what_one_batch_writes(tmp_path, monkeypatch, rows):
    """Held-out pairs (whole prompts, by the seed), unpaired rows, prompts with their
    answers, the eval overlap and the manifest: the same whatever the batch size."""
    config = Config(source="files", files=user_files(tmp_path), heldout_share=0.25)
    whole = prepare(tmp_path / "whole", config, GSM8K)
    monkeypatch.setattr(readers, "BATCH_ROWS", rows)
    batched = prepare(tmp_path / "batched", config, GSM8K)
    assert batched == whole
    for name in ("sft", "prefs", "prefs_eval", "unpaired", "prompts", "eval/heldout"):
        a = pd.read_parquet(tmp_path / "whole" / f"{name}.parquet")
        b = pd.read_parquet(tmp_path / "batched" / f"{name}.parquet")
        pd.testing.assert_frame_equal(a, b)
    assert whole["rows"]["prefs_eval"] == 7 and whole["rows"]["unpaired"] == 2 * whole["rows"]["prefs"]
    assert whole["rows"]["prompts"] == 23
    assert whole["eval_overlap"]["eval_heldout"]["sft"] == whole["eval_overlap"]["eval_heldout"]["prompts"] == 1


def test_bad_rows_in_every_batch_are_all_named_and_nothing_is_published(tmp_path, monkeypatch, capsys):
    """Bad rows spread over many batches of a file: each is named with its row number in the
    file and its field, in one error; the earlier prepared tables stay as they were."""
    files = user_files(tmp_path)
    pairs = [json.loads(line) for line in Path(files["prefs"]["path"]).read_text().splitlines()]
    pairs[2]["chosen"] = ""  # row 3
    pairs[13]["rejected"] = pairs[13]["chosen"]  # row 14
    del pairs[25]["prompt"]  # row 26
    write_jsonl(Path(files["prefs"]["path"]), pairs)
    root = tmp_path / "prepared"
    root.mkdir()
    (root / "sft.parquet").write_bytes(b"what the last run wrote")
    monkeypatch.setattr(readers, "BATCH_ROWS", 4)
    with pytest.raises(DataValidationError) as error:
        prepare(root, Config(source="files", files=files), GSM8K)
    problems = error.value.problems
    assert [p.split(": ", 2)[1] for p in problems] == ["row 3", "row 14", "row 26"], problems
    assert "'chosen' is empty" in problems[0] and "identical" in problems[1] and "'prompt' is missing" in problems[2]
    assert all(p.startswith(files["prefs"]["path"]) for p in problems)
    assert sorted(p.name for p in root.iterdir()) == ["sft.parquet"]
    assert (root / "sft.parquet").read_bytes() == b"what the last run wrote"
    assert not list(tmp_path.glob(".prepared.tmp*")), "the staging folder is removed"


def test_bad_json_lines_after_good_batches_are_named_with_the_rows_before_them(tmp_path, monkeypatch):
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(10)]
    rows[1]["chosen"] = ""
    text = "".join(json.dumps(r) + "\n" for r in rows) + "{not json\n" + json.dumps(rows[0]) + "\n[1]\n"
    path.write_text(text)
    monkeypatch.setattr(readers, "BATCH_ROWS", 3)
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    assert [p.split(":")[0] for p in error.value.problems] == ["row 2", "line 11", "line 13"]


def test_kept_problems_are_capped_and_the_rest_counted(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "a"}] * 30)
    monkeypatch.setattr(contracts, "MAX_KEPT_PROBLEMS", 10)
    monkeypatch.setattr(readers, "BATCH_ROWS", 7)
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    assert len(error.value.problems) == 10 and error.value.unlisted == 20
    assert "30 problem(s) found" in str(error.value) and "... and 20 more" in str(error.value)


def test_run_reads_back_what_prepare_wrote_with_missing_values_as_none(tmp_path):
    tables, origins = run(Config(source="files", files=user_files(tmp_path)), get_task(TaskConfig(kind="none")))
    assert tables["prompts"]["answer"].tolist() == [None] * 23
    assert origins["unpaired"].startswith("derived")


FINGERPRINT = """
import sys
import pandas as pd
from rlhf.data.prepared import prepared_dataset
from rlhf.models.loading import build_tokenizer
from rlhf.training.trl_training import fitting_rows
dataset = prepared_dataset(sys.argv[1], "policy@dpo")
kept, counts = fitting_rows(dataset, build_tokenizer(), 40, "policy.dpo.max_length", sys.argv[1])
print("FP", dataset._fingerprint, kept._fingerprint, len(kept), counts["dropped_rows"])
if len(sys.argv) > 2:  # the file rewritten: new fingerprints
    pd.DataFrame({"prompt": ["5+6\\n"], "chosen": ["a"], "rejected": ["b"]}).to_parquet(sys.argv[1])
    print("FP", prepared_dataset(sys.argv[1], "policy@dpo")._fingerprint)
"""


@pytest.mark.slow
def test_a_prepared_table_keeps_its_fingerprint_across_processes_while_its_file_is_unchanged(tmp_path):
    """What lets datasets and TRL find their tokenised cache on the next run: the same file
    gives the same fingerprints in a new process (the row counts too); a rewritten file,
    new ones."""
    path = tmp_path / "prefs.parquet"
    long = "9+" * 30 + "1\n"
    rows = {"prompt": ["1+2\n", "3+4\n", long], "chosen": ["a", "b", "c"], "rejected": ["x", "y", "z"]}
    pd.DataFrame(rows).to_parquet(path)
    env = {"HF_DATASETS_CACHE": str(tmp_path / "cache"), "PATH": str(Path(sys.executable).parent)}

    def fingerprints(*rewrite: str) -> list[list[str]]:
        done = subprocess.run(
            [sys.executable, "-c", FINGERPRINT, str(path), *rewrite], cwd=REPO, capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("FP ")]

    (first,) = fingerprints()
    assert first[2:] == ["2", "1"], "the prompt longer than max_length is left out, and counted"
    again, rewritten = fingerprints("rewrite")
    assert again == first
    assert rewritten[0] != first[0]


def test_sft_packs_on_a_gpu_by_default_and_as_trl_options_say():
    from rlhf.models import compute
    from rlhf.training.methods.sft import Params, packs

    compute.configure(compute.ComputeConfig(device="cpu"))
    assert not packs(Params())
    assert packs(Params(trl={"packing": True}))
    assert packs(Params(trl={"padding_free": True}))
    assert not packs(Params(trl={"packing": False}))


def test_suites_are_read_a_batch_at_a_time_up_to_their_limit_and_columns(tmp_path, monkeypatch):
    """Evaluate, infer and the rounds read only the columns they use, and infer only its
    first `limit` rows: the reader stops after the batch that holds them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import rlhf.data.prepared as prepared
    from rlhf.data.prepared import read_prepared

    path = tmp_path / "dev.parquet"
    table = pd.DataFrame(
        {
            "prompt": [[{"role": "user", "content": f"{i}+1"}] for i in range(50)],
            "answer": [str(i + 1) for i in range(50)],
            "notes": ["x" * 100] * 50,
        }
    )
    pq.write_table(pa.Table.from_pandas(table, preserve_index=False), path, row_group_size=10)
    batches = []
    real = prepared.prepared_batches

    def counted(*args, **kwargs):
        for frame in real(*args, **kwargs):
            batches.append(len(frame))
            yield frame

    monkeypatch.setattr(readers, "BATCH_ROWS", 10)
    monkeypatch.setattr(prepared, "prepared_batches", counted)
    first = read_prepared(path, "infer", ["prompt", "answer"], limit=12)
    assert list(first.columns) == ["prompt", "answer"] and len(first) == 12 and batches == [10, 10]
    assert first["prompt"].tolist() == [[{"role": "user", "content": f"{i}+1"}] for i in range(12)]
    batches.clear()
    whole = read_prepared(path, "evaluate", ["prompt", "answer", "difficulty"])
    assert list(whole.columns) == ["prompt", "answer"] and len(whole) == 50 and batches == [10] * 5
    assert whole["answer"].tolist() == table["answer"].tolist()
    # EWC's sample: the rows pandas' sample of the whole table gives, in its order, read a
    # batch at a time (only the drawn rows are kept); the whole table when it is smaller.
    batches.clear()
    drawn = read_prepared(path, "sft", sample=(7, 3))
    expected = read_prepared(path, "sft").sample(n=7, random_state=3)
    assert batches == [10] * 5 and drawn.index.tolist() == expected.index.tolist()
    assert (
        drawn["answer"].tolist() == expected["answer"].tolist()
        and drawn["prompt"].tolist() == expected["prompt"].tolist()
    )
    assert read_prepared(path, "sft", sample=(80, 3))["answer"].tolist() == table["answer"].tolist()
