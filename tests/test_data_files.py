"""Reading a data file (rlhf.data.readers.read_batches, through load_contract): files that
cannot be parsed, folders that are not datasets, paths that do not exist, splits and
configurations, Hub dataset names online and offline. Each failure is one error naming
the file and what to do. (Validating the rows read: tests/test_data.py.)"""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

from rlhf.data.contracts import DataValidationError, load_contract
from tests.test_data import PREFS, records, write


def test_a_damaged_save_to_disk_folder_is_named_with_the_fix(tmp_path):
    """Its Arrow file missing or cut short: one error naming the folder, no traceback."""
    folder = tmp_path / "heldout"
    Dataset.from_list(PREFS).save_to_disk(folder)
    arrow = next(folder.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    with pytest.raises(DataValidationError, match="save it again with `save_to_disk`") as error:
        load_contract(folder, "preference")
    assert str(folder) in str(error.value)
    arrow.unlink()
    with pytest.raises(DataValidationError, match="cannot be read as a save_to_disk folder"):
        load_contract(folder, "preference")


def test_a_file_that_is_not_utf8_says_so(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        json.dumps({"prompt": "caf\u00e9", "chosen": "a", "rejected": "b"}).encode().replace(b"\\u00e9", b"\xe9")
        + b"\n"
    )
    with pytest.raises(DataValidationError, match=r"is not UTF-8 text \(byte 0xe9 .*save the file as UTF-8"):
        load_contract(path, "preference")


def test_a_config_on_a_local_file_is_refused(tmp_path):
    with pytest.raises(DataValidationError, match="config 'main': a local file or folder has no configurations"):
        load_contract(write(tmp_path / "prefs.jsonl", PREFS), "preference", config="main")


def test_unsupported_extension(tmp_path):
    path = tmp_path / "prefs.txt"
    path.write_text("prompt\tchosen\trejected\n")
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    message = str(error.value)
    assert str(path) in message
    assert "unsupported file type '.txt'" in message


def test_folder_that_is_not_a_dataset(tmp_path):
    folder = tmp_path / "not_a_dataset"
    folder.mkdir()
    with pytest.raises(DataValidationError, match="save_to_disk"):
        load_contract(folder, "preference")


def test_unparseable_jsonl_names_every_bad_line(tmp_path):
    """Line 2 is cut short, line 3 is blank (skipped, not an error), line 5 is a list, not an
    object, and line 6 has a trailing comma: each bad line by 1-based number, with its start."""
    good = json.dumps(PREFS[0])
    path = tmp_path / "broken.jsonl"
    path.write_text(f'{good}\n{{"prompt": \n\n{good}\n[1, 2]\n{{"prompt": "a",}}\n')
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    assert str(path) in str(error.value)
    assert error.value.problems == [
        'line 2: invalid JSON (Expecting value at column 12): {"prompt":',
        "line 5: expected a JSON object {...}, got list",
        'line 6: invalid JSON (Expecting property name enclosed in double quotes at column 16): {"prompt": "a",}',
    ]


def test_long_bad_jsonl_line_is_shortened(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "' + "x" * 200 + "\n")
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    (problem,) = error.value.problems
    assert problem.startswith("line 1: invalid JSON (Unterminated string") and problem.endswith("xxx...")
    assert len(problem) < 150


def test_unparseable_json_names_line_and_column(tmp_path):
    """A .json file is one document: the error gives json's line and column and the text
    around it; JSON Lines content in a .json file gets a hint to rename it."""
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"prompt": "a", "chosen": "b" "rejected": "c"}\n]\n')
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    (problem,) = error.value.problems
    assert problem.startswith("line 2 column 33: invalid JSON (Expecting ',' delimiter) near ")
    assert '"rejected"' in problem
    path.write_text(json.dumps(PREFS[0]) + "\n" + json.dumps(PREFS[1]) + "\n")
    with pytest.raises(DataValidationError, match="name the file .jsonl"):
        load_contract(path, "preference")


def test_jsonl_keeps_values_as_parsed(tmp_path):
    """Read line by line, not by pandas: an int answer beside a null one stays '8', not '8.0'."""
    frame = load_contract(write(tmp_path / "p.jsonl", [{"prompt": "5+3\n", "answer": 8}, {"prompt": "x"}]), "prompts")
    assert frame["answer"].tolist() == ["8", None]


def test_nonexistent_path(tmp_path, monkeypatch):
    """A missing local path says so (no raw [Errno 2]); a path under an existing folder, or with
    a data-file suffix, is never taken for a Hugging Face dataset name."""
    path = tmp_path / "nowhere" / "prefs.jsonl"
    with pytest.raises(DataValidationError) as error:  # prepare reports it beside the other files' problems
        load_contract(path, "preference")
    assert str(error.value).startswith(f"{path}: 1 problem(s) found:\n  does not exist")
    assert "Errno" not in str(error.value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for relative in ["data/prefs", "raw/prefs.jsonl", "trian.jsonl"]:
        with pytest.raises(DataValidationError, match=f"^{relative}: 1 problem.*\n  does not exist"):
            load_contract(relative, "preference")


def test_a_split_names_a_part_of_a_dataset_with_splits_only_and_a_bom_is_read(tmp_path):
    """`split` picks a Hub dataset's or a saved DatasetDict's split; a file or a saved
    Dataset has none, and a split named for one is an error (it read the whole file as
    that split). A JSONL or JSON file saved with a byte-order mark reads as without."""
    path = write(tmp_path / "prefs.jsonl", PREFS)
    with pytest.raises(DataValidationError, match="split 'test': a file has no splits"):
        load_contract(path, "preference", split="test")
    Dataset.from_list(PREFS).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataValidationError, match="split 'test': this saved Dataset has no splits"):
        load_contract(tmp_path / "saved", "preference", split="test")
    assert records(load_contract(tmp_path / "saved", "preference")) == PREFS
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert records(load_contract(bom, "preference")) == PREFS


# ----------------------------------------------------------------------------- implicit prompts


def test_dataset_dict_folder_split(tmp_path):
    """A save_to_disk DatasetDict: `split` picks the split (default train); an absent one is
    named with the splits there are."""
    from datasets import DatasetDict

    folder = tmp_path / "prefs_dict"
    DatasetDict({"train": Dataset.from_list(PREFS[:2]), "test": Dataset.from_list(PREFS[2:])}).save_to_disk(folder)
    assert records(load_contract(folder, "preference")) == PREFS[:2]
    assert records(load_contract(folder, "preference", split="test")) == PREFS[2:]
    with pytest.raises(DataValidationError, match=r"no split 'dev' in this DatasetDict; found \['test', 'train'\]"):
        load_contract(folder, "preference", split="dev")


def test_hub_dataset_name_is_loaded_with_config_and_split(tmp_path, monkeypatch):
    """A path that is not local but reads owner/name goes to `datasets.load_dataset`."""
    import datasets

    calls = []

    def load_dataset(name, config=None, *, split=None):
        calls.append((name, config, split))
        return Dataset.from_list(PREFS)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    frame = load_contract("trl-lib/ultrafeedback_binarized", "preference", split="test", config="default")
    assert records(frame) == PREFS
    assert calls == [("trl-lib/ultrafeedback_binarized", "default", "test")]


def test_hub_dataset_offline(tmp_path, monkeypatch):
    """Offline and not cached: one error naming the dataset and what to do. datasets reads
    HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, at import, so its config is patched as well as
    the environment (huggingface_hub's too, so that nothing reaches for the network)."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataValidationError) as error:
        load_contract("openai/gsm8k", "prompts", config="main", columns={"prompt": "question"})
    assert error.value.path == "openai/gsm8k"
    (problem,) = error.value.problems
    assert "Hugging Face dataset 'openai/gsm8k' (config 'main'), split 'train'" in problem
    assert "HF_HUB_OFFLINE is set" in problem
    assert "download it while online" in problem and "save_to_disk" in problem and "JSONL" in problem
