"""SFT on a user's data: rows longer than `max_length` are counted, rows with no completion
token left are left out (none left is an error naming the key), and conversations trained
on the assistant's turns need a chat template TRL can mask, checked before the model loads.
Real TRL SFTTrainer runs on the micro model."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf.training.params import SFTParams

# The built-in template without its {% generation %} markers (a Zephyr-style template).
UNMARKED = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def params(**fields) -> SFTParams:
    return SFTParams(max_steps=2, per_device_train_batch_size=4, logging_steps=1, save_steps=100, **fields)


@pytest.fixture
def base(micro_dir):
    """The untrained micro model and the built-in tokenizer (conftest's micro_dir)."""
    return micro_dir


def test_rows_beyond_max_length_are_counted_and_prompts_that_fill_it_left_out(base, tmp_path, mlflow_store):
    """One character is one token of the built-in tokenizer. max_length 12: '1+1\\n' + '2' +
    EOS (6 tokens) fits; a 9-character prompt with a 6-character completion (16 tokens) is
    cut at its end; a 12-character prompt leaves no completion token and is left out.
    Every prompt of 12 characters or more: an error naming sft.max_length."""
    from rlhf.training.sft import SFTDataError, train_sft

    rows = {
        "prompt": ["1+1\n", "2+2\n", "123+456\n\n", "1234+5678+9\n", "3+3\n", "4+4\n"],
        "completion": ["2", "4", "579 ok", "6913", "6", "8"],
    }
    data = tmp_path / "sft.parquet"
    pd.DataFrame(rows).to_parquet(data)
    metrics, _ = train_sft(params(max_length=12), base, data, tmp_path / "out", tmp_path / "checkpoints")
    assert metrics["truncated_rows"] == 1 and metrics["dropped_rows"] == 1
    assert metrics["steps"] == 2
    long = tmp_path / "long.parquet"
    pd.DataFrame({"prompt": ["1234+5678+9\n"] * 4, "completion": ["6913"] * 4}).to_parquet(long)
    with pytest.raises(SFTDataError, match=r"sft.max_length 12: every prompt of .*long.parquet fills it"):
        train_sft(params(max_length=12), base, long, tmp_path / "never", tmp_path / "checkpoints")
    assert not (tmp_path / "never").exists()


def test_conversations_need_a_template_that_can_mask_the_assistant(base, tmp_path, mlflow_store):
    """loss_on: completion on `messages` rows trains the assistant's turns through the
    template's generation markers. A template without them, which TRL cannot patch, fails
    before the model loads naming sft.loss_on and what to do; loss_on: all trains; the
    built-in template (with markers) trains on the assistant's turns."""
    from transformers import AutoTokenizer

    from rlhf.training.sft import SFTDataError, train_sft

    conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    data = tmp_path / "chat.parquet"
    pd.DataFrame({"messages": [conversation] * 8}).to_parquet(data)
    metrics, _ = train_sft(params(max_length=32), base, data, tmp_path / "marked", tmp_path / "checkpoints")
    assert metrics["steps"] == 2 and metrics["dropped_rows"] == 0
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = UNMARKED
    tokenizer.save_pretrained(base)
    with pytest.raises(SFTDataError, match=r"sft.loss_on: completion trains on the assistant's messages only"):
        train_sft(params(max_length=32), base, data, tmp_path / "unmarked", tmp_path / "checkpoints")
    metrics, _ = train_sft(params(max_length=32, loss_on="all"), base, data, tmp_path / "all", tmp_path / "checkpoints")
    assert metrics["steps"] == 2
