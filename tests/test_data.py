"""Data contracts (rlhf.data.contracts): every supported format, column mapping, and validation
that reports every problem of a file in one error. (A file that cannot be read:
tests/test_data_files.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from datasets import Dataset

from rlhf.data.contracts import DataValidationError, load_contract

PREFS = [
    {"prompt": "23+58-17\n", "chosen": "23+58=81; 81-17=64; answer 64", "rejected": "23+58=81; answer 81"},
    {"prompt": "5+3\n", "chosen": "5+3=8; answer 8", "rejected": "5+3=9; answer 9"},
    {"prompt": "9-4\n", "chosen": "9-4=5; answer 5", "rejected": "9-4=5; answer 6"},
]
PRM = [
    {"prompt": "5+3+3\n", "completions": ["5+3=8", "8+3=11", "answer 11"], "labels": [True, True, True]},
    {"prompt": "5+3+3\n", "completions": ["5+3=8", "answer 8"], "labels": [True, False]},
]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
        "chosen": [{"role": "assistant", "content": "Paris"}],
        "rejected": [{"role": "assistant", "content": "Lyon"}],
    },
]


def write(path: Path, rows: list[dict]) -> Path:
    """`rows` in the format that `path`'s suffix names (a folder: `save_to_disk`)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif path.suffix == ".csv":
        encoded = [{k: v if isinstance(v, str) else json.dumps(v) for k, v in row.items()} for row in rows]
        pd.DataFrame(encoded).to_csv(path, index=False)
    else:
        Dataset.from_list(rows).save_to_disk(str(path))
    return path


def row_problems(path: Path, rows: list[dict], kind: str) -> list[str]:
    """The problems validating `rows` (written to `path` as JSONL) as a `kind` file finds; it must find some."""
    with pytest.raises(DataValidationError) as error:
        load_contract(write(path, rows), kind)
    return error.value.problems


def records(frame: pd.DataFrame) -> list[dict]:
    return frame.to_dict(orient="records")


FORMATS = ["prefs.jsonl", "prefs.json", "prefs.parquet", "prefs.csv", "prefs_dataset"]


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_reads_the_same_preference_rows(tmp_path, name):
    frame = load_contract(write(tmp_path / name, PREFS), "preference")
    assert list(frame.columns) == ["prompt", "chosen", "rejected"]
    assert records(frame) == PREFS


@pytest.mark.parametrize("name", ["prm.jsonl", "prm.json", "prm.parquet", "prm.csv", "prm_dataset"])
def test_every_format_reads_the_same_prm_rows(tmp_path, name):
    """List columns come back as plain lists of str and bool, whatever the storage: numpy
    arrays from Parquet/Arrow and JSON-encoded strings from CSV are normalised."""
    frame = load_contract(write(tmp_path / name, PRM), "prm")
    assert records(frame) == PRM
    assert all(type(label) is bool for labels in frame["labels"] for label in labels)


@pytest.mark.parametrize("name", ["conv.jsonl", "conv.json", "conv.parquet", "conv_dataset"])
def test_conversational_preference_rows(tmp_path, name):
    frame = load_contract(write(tmp_path / name, CONVERSATIONAL), "preference")
    assert records(frame) == CONVERSATIONAL


def test_conversational_sft_messages(tmp_path):
    """An sft file with only `messages` (a whole conversation) is valid on its own."""
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]},
    ]
    frame = load_contract(write(tmp_path / "sft.jsonl", rows), "sft")
    assert records(frame) == rows


def test_column_mapping(tmp_path):
    """`columns` maps contract names to the file's: question -> prompt, good -> chosen."""
    rows = [{"question": r["prompt"], "good": r["chosen"], "rejected": r["rejected"], "extra": 1} for r in PREFS]
    frame = load_contract(
        write(tmp_path / "q.jsonl", rows), "preference", columns={"prompt": "question", "chosen": "good"}
    )
    assert records(frame) == PREFS  # renamed, and the unmapped `extra` is dropped


def test_a_mapped_field_replaces_the_files_column_of_that_name(tmp_path):
    """MATH-500's layout (problem, solution, answer, level) with prompt <- problem, answer <-
    solution, difficulty <- level: the file's own `answer` column gives way to the mapped
    one (renaming beside it made two `answer` columns, and every later field took its
    neighbour's value). A mapping to a field the contract does not have is named."""
    rows = [{"problem": "1/2+1/4?", "solution": "We get 3/4.", "answer": "3/4", "level": "2"}]
    path = write(tmp_path / "math.jsonl", rows)
    frame = load_contract(path, "prompts", columns={"prompt": "problem", "answer": "solution", "difficulty": "level"})
    assert records(frame) == [{"prompt": "1/2+1/4?", "answer": "We get 3/4.", "difficulty": "2"}]
    with pytest.raises(DataValidationError, match=r"'answers' -> 'solution': 'answers' is not a field of a prompts"):
        load_contract(path, "prompts", columns={"prompt": "problem", "answers": "solution"})


def test_column_mapping_to_a_missing_column(tmp_path):
    path = write(tmp_path / "q.jsonl", PREFS)
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference", columns={"prompt": "question"})
    message = str(error.value)
    assert "'prompt' -> 'question'" in message
    assert "no column 'question'" in message
    assert "['prompt', 'chosen', 'rejected']" in message  # what the file has instead


def test_unpaired_labels_are_normalised(tmp_path):
    """`label` accepts booleans, 0/1 and true/false/yes/no/desirable/undesirable strings."""
    rows = [
        {"prompt": "a", "completion": "x", "label": True},
        {"prompt": "b", "completion": "y", "label": 0},
        {"prompt": "c", "completion": "z", "label": "Yes"},
        {"prompt": "d", "completion": "w", "label": "undesirable"},
    ]
    frame = load_contract(write(tmp_path / "kto.jsonl", rows), "unpaired")
    assert frame["label"].tolist() == [True, False, True, False]


def test_prompts_with_optional_answer(tmp_path):
    """`answer` is optional; when present it is text, stripped, and a missing one is None."""
    rows = [{"prompt": "5+3\n", "answer": 8}, {"prompt": "9-4\n", "answer": None}, {"prompt": "1+1\n", "answer": " 2 "}]
    frame = load_contract(write(tmp_path / "prompts.jsonl", rows), "prompts")
    assert frame["answer"].tolist() == ["8", None, "2"]
    frame = load_contract(write(tmp_path / "bare.jsonl", [{"prompt": "5+3\n"}]), "prompts")
    assert list(frame.columns) == ["prompt"]


def test_an_integer_column_with_an_empty_cell_keeps_integer_answers(tmp_path):
    """Parquet (like `datasets` and the Hub) stores an integer column with an empty cell as
    floats: answers 3 and 12 read back as 3.0 and 12.0. They are written as `3` and `12`, so
    an exact check matches the model's `3`; a real fraction stays as it is."""
    table = pd.DataFrame({"prompt": ["a", "b", "c", "d"], "answer": [3, None, 12, 2.5], "difficulty": [2, 2, None, 3]})
    table.to_parquet(tmp_path / "prompts.parquet")
    assert pd.read_parquet(tmp_path / "prompts.parquet")["difficulty"].dtype == "float64"
    frame = load_contract(tmp_path / "prompts.parquet", "prompts")
    assert frame["answer"].tolist() == ["3", None, "12", "2.5"]
    assert frame["difficulty"].tolist() == ["2", "2", None, "3"]


def test_every_problem_of_a_preference_file_in_one_error(tmp_path):
    """Row 2 has an empty 'chosen', row 4 has no 'rejected' key, row 5 a whitespace-only
    'prompt': three problems, all named with file, row and field in one error."""
    rows = [dict(row) for row in PREFS + PREFS[:2]]  # 5 rows
    rows[1]["chosen"] = ""
    del rows[3]["rejected"]
    rows[4]["prompt"] = "   "
    path = write(tmp_path / "prefs.jsonl", rows)
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    message = str(error.value)
    assert message.startswith(f"{path}: 3 problem(s) found:")
    assert "row 2: 'chosen' is empty" in message
    assert "row 4: 'rejected' is missing" in message
    assert "row 5: 'prompt' is empty" in message
    assert error.value.path == str(path)
    assert len(error.value.problems) == 3


def test_every_problem_of_an_unpaired_file_in_one_error(tmp_path):
    """Row 2: empty completion; row 3: label 'maybe' is not a boolean; row 4: label 2 is
    not 0/1 and the prompt is missing (two problems in one row)."""
    rows = [
        {"prompt": "a", "completion": "x", "label": True},
        {"prompt": "b", "completion": "", "label": False},
        {"prompt": "c", "completion": "z", "label": "maybe"},
        {"prompt": None, "completion": "w", "label": 2},
    ]
    path = write(tmp_path / "kto.json", rows)
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "unpaired")
    message = str(error.value)
    assert str(path) in message
    assert "row 2: 'completion' is empty" in message
    assert "row 3: 'label' must be a boolean (true/false), got 'maybe'" in message
    assert "row 4: 'prompt' is missing" in message
    assert "row 4: 'label' must be a boolean (true/false), got 2" in message
    assert len(error.value.problems) == 4
    assert "row 1" not in message


def test_missing_column_lists_the_columns(tmp_path):
    rows = [{"prompt": r["prompt"], "chosen": r["chosen"]} for r in PREFS]
    path = write(tmp_path / "prefs.parquet", rows)
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    message = str(error.value)
    assert str(path) in message
    assert "missing column(s) ['rejected'] for a preference file (columns: ['prompt', 'chosen'])" in message


def test_prm_step_and_label_counts_must_agree(tmp_path):
    """Row 1: 3 steps, 2 labels. Row 2 agrees. Row 3: 1 step, 2 labels."""
    rows = [
        {"prompt": "p", "completions": ["a", "b", "c"], "labels": [True, False]},
        {"prompt": "p", "completions": ["a"], "labels": [True]},
        {"prompt": "p", "completions": ["a"], "labels": [True, True]},
    ]
    problems = row_problems(tmp_path / "prm.jsonl", rows, "prm")
    assert problems == [
        "row 1: 'completions' has 3 steps but 'labels' has 2; give one label per step",
        "row 3: 'completions' has 1 steps but 'labels' has 2; give one label per step",
    ]


def test_prm_csv_with_json_list_columns(tmp_path):
    """CSV cells hold JSON lists; string booleans inside a list are accepted too."""
    path = tmp_path / "prm.csv"
    pd.DataFrame(
        {
            "prompt": ["5+3\n", "9-4\n"],
            "completions": ['["5+3=8", "answer 8"]', '["9-4=5", "answer 6"]'],
            "labels": ["[true, true]", '["true", "false"]'],
        }
    ).to_csv(path, index=False)
    frame = load_contract(path, "prm")
    assert frame["completions"].tolist() == [["5+3=8", "answer 8"], ["9-4=5", "answer 6"]]
    assert frame["labels"].tolist() == [[True, True], [True, False]]


def test_prm_bad_list_cells(tmp_path):
    """Row 1: labels is not JSON; row 2: an empty step and a label 'perhaps'; row 3: no steps."""
    path = tmp_path / "prm.csv"
    pd.DataFrame(
        {
            "prompt": ["p", "p", "p"],
            "completions": ['["a"]', '["a", " "]', "[]"],
            "labels": ["[true", '[true, "perhaps"]', "[]"],
        }
    ).to_csv(path, index=False)
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "prm")
    assert error.value.problems == [
        "row 1: 'labels' must be a list of booleans, one per step",
        "row 2: 'completions' has empty or non-string step(s) at [1]",
        "row 2: 'labels' item 1 must be a boolean (true/false), got 'perhaps'",
        "row 3: 'completions' is an empty list; give at least one step",
    ]


def test_bad_messages(tmp_path):
    """Row 1: a message without 'content'; row 2: an empty message list."""
    rows = [
        {"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"},
        {"prompt": [], "chosen": "a", "rejected": "b"},
    ]
    problems = row_problems(tmp_path / "conv.jsonl", rows, "preference")
    assert problems[0].startswith("row 1: 'prompt' message 0 must be a {'role', 'content'} mapping")
    assert problems[1] == "row 2: 'prompt' is an empty list of messages"


def test_conversations_with_unknown_roles_or_no_assistant_turn(tmp_path):
    """ShareGPT's human/gpt roles: a chat template renders nothing of them (or fails), and
    an SFT conversation without an assistant turn trains on nothing; both named by row."""
    rows = [
        {"messages": [{"role": "human", "content": "2+2?"}, {"role": "gpt", "content": "4"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]
    problems = row_problems(tmp_path / "chat.jsonl", rows, "sft")
    assert problems == [
        "row 1: 'messages' message 0 role 'human' is not one of system, developer, user, assistant, tool, function, "
        "ipython (ShareGPT's 'human' is 'user': rename it)",
        "row 2: 'messages' has no assistant turn: SFT trains on the assistant's turns",
    ]


def test_an_answer_that_is_a_list_or_a_bool_is_refused(tmp_path):
    """str() of a list of aliases is "['Jupiter', 'planet Jupiter']", which no reply matches."""
    rows = [
        {"prompt": "Largest planet?", "answer": ["Jupiter", "planet Jupiter"]},
        {"prompt": "Is 2 even?", "answer": True},
        {"prompt": "2+2?", "answer": 4},
    ]
    problems = row_problems(tmp_path / "eval.jsonl", rows, "prompts")
    assert problems == [
        "row 1: 'answer' must be a string or a number, got a list; give one answer per row",
        "row 2: 'answer' must be a string or a number, got bool; give one answer per row",
    ]


def test_empty_file(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("prompt,chosen,rejected\n")
    with pytest.raises(DataValidationError, match="the file has no rows"):
        load_contract(path, "preference")


HH = [
    {
        "chosen": "\n\nHuman: What color is the sky?\n\nAssistant: It is blue.",
        "rejected": "\n\nHuman: What color is the sky?\n\nAssistant: It is bland.",
    },
    {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 4",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 5",
    },
]


@pytest.mark.parametrize("name", ["hh.jsonl", "hh.parquet", "hh_dataset"])
def test_implicit_prompt_text_hh_layout(tmp_path, name):
    """HH-RLHF rows (no prompt column): the prompt ends at the last '\\n\\nAssistant:' turn.
    TRL's character-wise prefix alone would put 'It is bl' into the prompt (checked below, so
    this test notices when TRL changes)."""
    from trl.data_utils import extract_prompt

    assert extract_prompt(HH[0])["prompt"].endswith("Assistant: It is bl")
    frame = load_contract(write(tmp_path / name, HH), "preference")
    assert records(frame) == [
        {
            "prompt": "\n\nHuman: What color is the sky?\n\nAssistant:",
            "chosen": " It is blue.",
            "rejected": " It is bland.",
        },
        {"prompt": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant:", "chosen": " 4", "rejected": " 5"},
    ]


def test_implicit_prompt_text_cut_at_a_word_boundary(tmp_path):
    """Without a turn marker the shared prefix is cut back to a word boundary: row 1 TRL would
    split 'bl|ue'; row 2 (one reply begins with the other) TRL gives 'blu' + 'e'/'e-ish';
    row 3 '=8|1' becomes '=' + '81'. The space before a reply goes with the reply, as in TRL."""
    rows = [
        {"chosen": "Q: sky?\nA: It is blue.", "rejected": "Q: sky?\nA: It is bland."},
        {"chosen": "Q: sky?\nA: It is blue", "rejected": "Q: sky?\nA: It is blue-ish"},
        {"chosen": "23+58=81", "rejected": "23+58=82"},
    ]
    frame = load_contract(write(tmp_path / "p.jsonl", rows), "preference")
    assert records(frame) == [
        {"prompt": "Q: sky?\nA: It is", "chosen": " blue.", "rejected": " bland."},
        {"prompt": "Q: sky?\nA: It is", "chosen": " blue", "rejected": " blue-ish"},
        {"prompt": "23+58=", "chosen": "81", "rejected": "82"},
    ]


def test_implicit_prompt_conversational(tmp_path):
    """Messages split by whole message (TRL): the shared turns are the prompt."""
    rows = [
        {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]} for row in CONVERSATIONAL
    ]
    frame = load_contract(write(tmp_path / "conv.parquet", rows), "preference")
    assert records(frame) == CONVERSATIONAL


def test_implicit_prompt_with_column_mapping(tmp_path):
    rows = [{"good": row["chosen"], "bad": row["rejected"]} for row in HH]
    frame = load_contract(write(tmp_path / "hh.csv", rows), "preference", columns={"chosen": "good", "rejected": "bad"})
    assert list(frame.columns) == ["prompt", "chosen", "rejected"]
    assert frame["chosen"].tolist() == [" It is blue.", " 4"]


def test_implicit_prompt_problems_name_the_row(tmp_path):
    """Text: row 1 is fine, row 2 has no common prefix, row 3 is identical. Messages: row 1
    is fine; row 2's conversations differ at the user's turn, so no reply follows the shared
    prompt; row 3 has no common first message; row 4 puts text beside messages."""
    user = {"role": "user", "content": "q"}
    text_rows = [HH[0], {"chosen": "Yes.", "rejected": "No."}, {"chosen": "same", "rejected": "same"}]
    problems = row_problems(tmp_path / "text.jsonl", text_rows, "preference")
    assert problems == [
        "row 2: chosen and rejected share no prompt (no common prefix); add a prompt column",
        "row 3: chosen and rejected are identical",
    ]
    conversational = CONVERSATIONAL[0]
    message_rows = [
        {
            "chosen": conversational["prompt"] + conversational["chosen"],
            "rejected": conversational["prompt"] + conversational["rejected"],
        },
        {
            "chosen": [{"role": "system", "content": "s"}, user, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}],
        },
        {"chosen": [user], "rejected": [{"role": "user", "content": "p"}]},
        {"chosen": "text", "rejected": [user]},
    ]
    problems = row_problems(tmp_path / "messages.jsonl", message_rows, "preference")
    assert problems == [
        "row 2: chosen and rejected differ before the reply (at a 'user' message); add a prompt column",
        "row 3: chosen and rejected share no prompt (no common first message); add a prompt column",
        "row 4: 'chosen' is text, 'rejected' is messages; a row's fields must all be text or all be messages",
    ]


def test_one_format_per_file(tmp_path):
    """TRL reads a dataset's format from its first row and applies the chat template to
    every field or to none: a file that mixes text and messages, between rows or within a
    row, fails naming each row, before any model loads."""
    user = [{"role": "user", "content": "2+2?"}]
    rows = [
        {"prompt": "1+1?", "completion": "2"},
        {"prompt": user, "completion": [{"role": "assistant", "content": "4"}]},
        {"prompt": user, "completion": "4"},
        {"prompt": "3+3?", "completion": "6"},
    ]
    problems = row_problems(tmp_path / "sft.jsonl", rows, "sft")
    assert problems == [
        "row 2: its fields are messages but row 1's are text; a file holds one format (all text or all "
        "messages): convert the rows, or split them into two files",
        "row 3: 'prompt' is messages, 'completion' is text; a row's fields must all be text or all be messages",
    ]
    prompts = [{"prompt": user, "answer": "4"}, {"prompt": "1+1?", "answer": "2"}]
    with pytest.raises(DataValidationError, match="row 2: its fields are text but row 1's are messages"):
        load_contract(write(tmp_path / "prompts.jsonl", prompts), "prompts")


def test_identical_chosen_and_rejected(tmp_path):
    """Compared after normalising: the conversation's messages differ only by a key the
    contract drops."""
    rows = [dict(PREFS[0], rejected=PREFS[0]["chosen"]), PREFS[1]]
    problems = row_problems(tmp_path / "p.jsonl", rows, "preference")
    assert problems == ["row 1: chosen and rejected are identical"]
    rows = [
        CONVERSATIONAL[0],
        {
            "prompt": [{"role": "user", "content": "2+2?"}],
            "chosen": [{"role": "assistant", "content": "4", "name": "bot"}],
            "rejected": [{"role": "assistant", "content": "4"}],
        },
    ]
    problems = row_problems(tmp_path / "c.jsonl", rows, "preference")
    assert problems == ["row 2: chosen and rejected are identical"]


# ----------------------------------------------------------------------------- splits and the Hub


def test_unknown_contract(tmp_path):
    with pytest.raises(ValueError, match="unknown data contract 'pairs'"):
        load_contract(write(tmp_path / "prefs.jsonl", PREFS), "pairs")


def test_error_lists_at_most_25_problems(tmp_path):
    """30 rows with an empty 'chosen': the message shows 25 and says 5 more; `problems`
    keeps all 30."""
    rows = [{"prompt": "p", "chosen": "", "rejected": "r"}] * 30
    with pytest.raises(DataValidationError) as error:
        load_contract(write(tmp_path / "prefs.jsonl", rows), "preference")
    assert len(error.value.problems) == 30
    message = str(error.value)
    assert "30 problem(s) found" in message
    assert "row 25: 'chosen' is empty" in message
    assert "row 26:" not in message
    assert "... and 5 more" in message


def test_read_prepared_says_how_to_provide_a_missing_table(tmp_path):
    """A stage whose input table prepare did not write (user data without prefs) fails
    with the path and the params key that would provide it."""
    from rlhf.data.prepared import read_prepared

    with pytest.raises(FileNotFoundError) as error:
        read_prepared(tmp_path / "prefs.parquet", "rm")
    message = str(error.value)
    assert "rm needs" in message and "prefs.parquet" in message and "prepare.files.prefs" in message


def test_a_chat_suite_reads_back_as_json_ready_messages_and_scores_a_sampled_reply(tmp_path):
    """Parquet gives message lists back as numpy arrays; read_prepared turns them into
    lists of dicts (reports write them as JSON), and a reward model reads a text reply to a
    chat prompt as the assistant's message."""
    from rlhf.data.prepared import read_prepared
    from rlhf.models.generation import reward_text
    from rlhf.models.loading import build_tokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    pd.DataFrame({"prompt": [chat], "answer": ["4"]}).to_parquet(tmp_path / "heldout.parquet")
    prompt = read_prepared(tmp_path / "heldout.parquet", "infer")["prompt"].iloc[0]
    assert prompt == chat and json.loads(json.dumps({"prompt": prompt})) == {"prompt": chat}
    tokenizer = build_tokenizer()
    reply = [{"role": "assistant", "content": "4"}]
    assert reward_text(tokenizer, prompt, "4") == reward_text(tokenizer, prompt, reply)


def test_float32_answers_read_as_written(tmp_path):
    """A float32 answer column (`datasets.Value("float32")`) read as Python floats gave
    0.10000000149011612 for 0.1, which no completion states; whole numbers stay integers."""
    frame = pd.DataFrame({"prompt": ["a", "b", "c", "d"], "answer": [0.1, 2.3, 3.0, None]}).astype(
        {"answer": "float32"}
    )
    frame.to_parquet(tmp_path / "eval.parquet")
    assert load_contract(tmp_path / "eval.parquet", "prompts")["answer"].tolist() == ["0.1", "2.3", "3", None]


def test_integer_answers_beside_an_empty_cell_keep_every_digit(tmp_path):
    """An integer column with an empty cell (Parquet, a saved Dataset) became float64 in
    pandas: 8 read as 8.0, and an answer above 2**53 lost its last digits."""
    import datasets
    import pyarrow as pa

    table = pa.table({"prompt": ["a", "b", "c"], "answer": pa.array([12345678901234567, None, 8], pa.int64())})
    datasets.Dataset(table).to_parquet(tmp_path / "eval.parquet")
    datasets.Dataset(table).select([2, 0, 1]).save_to_disk(tmp_path / "saved")
    assert load_contract(tmp_path / "eval.parquet", "prompts")["answer"].tolist() == ["12345678901234567", None, "8"]
    assert load_contract(tmp_path / "saved", "prompts")["answer"].tolist() == ["8", "12345678901234567", None]


def test_a_csv_file_reads_empty_cells_as_missing_and_json_conversations_as_messages(tmp_path):
    """CSV holds text only: an empty optional cell is no answer (not an empty one), and a
    cell holding a JSON list of {'role', 'content'} objects is a conversation, as a JSONL
    file would give it (it stayed JSON text, and the policy would train on it)."""
    eval_file = tmp_path / "eval.csv"
    eval_file.write_text("prompt,answer,difficulty\n1+1?,2,easy\n2+2?,,\n")
    assert records(load_contract(eval_file, "prompts")) == [
        {"prompt": "1+1?", "answer": "2", "difficulty": "easy"},
        {"prompt": "2+2?", "answer": None, "difficulty": None},
    ]
    user = json.dumps([{"role": "user", "content": "hi"}])
    reply = json.dumps([{"role": "assistant", "content": "hello"}])
    frame = pd.DataFrame(
        {"prompt": [user], "chosen": [reply], "rejected": [json.dumps([{"role": "assistant", "content": "go"}])]}
    )
    frame.to_csv(tmp_path / "prefs.csv", index=False)
    (row,) = records(load_contract(tmp_path / "prefs.csv", "preference"))
    assert row["prompt"] == [{"role": "user", "content": "hi"}] and row["chosen"] == [
        {"role": "assistant", "content": "hello"}
    ]


def test_conversations_beside_their_first_prompt_are_read_as_conversations(tmp_path):
    """UltraChat's layout: `prompt` (the first user turn) beside `messages` (the whole
    conversation), no completion column: the conversation is the row (it failed as a
    prompt/completion file missing its completion)."""
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    frame = load_contract(write(tmp_path / "ultrachat.jsonl", [{"prompt": "2+2?", "messages": chat}]), "sft")
    assert records(frame) == [{"messages": chat}]


def test_a_text_prompt_beside_conversations_that_hold_it_is_split_off_them(tmp_path):
    """HuggingFaceH4/ultrafeedback_binarized: `prompt` as text beside chosen and rejected
    conversations that begin with that user turn (it failed as mixed formats). As TRL's
    `maybe_extract_prompt` does, the prompt is split off the conversations."""
    user = {"role": "user", "content": "2+2?"}
    row = {
        "prompt": "2+2?",
        "chosen": [user, {"role": "assistant", "content": "4"}],
        "rejected": [user, {"role": "assistant", "content": "5"}],
    }
    frame = load_contract(write(tmp_path / "ultrafeedback.jsonl", [row]), "preference")
    assert records(frame) == [
        {
            "prompt": [user],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        }
    ]


def test_a_lone_surrogate_is_a_bad_row_named_by_row_and_field(tmp_path):
    """JSON's "\\ud800" escape without its pair reads as a lone surrogate, which the contract
    passed and Parquet then refused with a raw UnicodeEncodeError mid-prepare."""
    path = tmp_path / "prefs.jsonl"
    path.write_text(
        '{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\n'
        '{"prompt": "3+3?", "chosen": "6 \\ud800", "rejected": "7"}\n'
        '{"prompt": [{"role": "user", "content": "x\\udfff"}], "chosen": "a", "rejected": "b"}\n'
    )
    with pytest.raises(DataValidationError) as error:
        load_contract(path, "preference")
    problems = error.value.problems
    assert problems[0].startswith(
        "row 2: 'chosen' is not valid Unicode text (a lone surrogate '\\ud800' at character 3"
    )
    assert any(p.startswith("row 3: 'prompt' message 0 content is not valid Unicode") for p in problems)
