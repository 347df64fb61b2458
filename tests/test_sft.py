"""SFT on a user's data: rows longer than `max_length` are counted, rows with no completion
token left are left out (none left is an error naming the key), and conversations trained
on the assistant's turns need a chat template TRL can mask, checked before the model loads.
Real TRL SFTTrainer runs on the micro model."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf.training.methods.sft import SFTParams
from tests.conftest import tiny_params, write_params

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
    from rlhf.training.methods.sft import SFTDataError
    from tests.conftest import train_sft

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


def test_sft_with_ewc_pulls_towards_its_start_and_a_max_length_no_earlier_row_fits_fails_first(
    base, tmp_path, mlflow_store
):
    """SFT with EWC (a round's method sft): the penalty is reported after training (the
    weights left their start). Earlier data none of whose prompts fits max_length fails
    before the model loads, naming the key (a round's train.max_length) and the file."""
    from rlhf.training.methods.sft import SFTDataError
    from rlhf.training.params import EwcParams
    from tests.conftest import train_sft

    data, earlier = tmp_path / "sft.parquet", tmp_path / "earlier.parquet"
    pd.DataFrame({"prompt": ["1+1\n", "2+2\n", "3+3\n", "4+4\n"], "completion": ["2", "4", "6", "8"]}).to_parquet(data)
    pd.DataFrame({"prompt": ["5+5\n", "6+6\n"], "completion": ["10", "12"]}).to_parquet(earlier)
    ewc = (EwcParams(strength=10.0), earlier)
    metrics, _ = train_sft(
        params(max_length=12, learning_rate=1e-2), base, data, tmp_path / "out", tmp_path / "ckpt", "round-r1", ewc,
        "improve.rounds.r1.train",
    )  # fmt: skip
    assert metrics["ewc_penalty"] > 0
    pd.DataFrame({"prompt": ["1234+5678+9\n"] * 2, "completion": ["6913"] * 2}).to_parquet(earlier)
    with pytest.raises(
        SFTDataError, match=r"^improve.rounds.r1.train.max_length 12: every one of the 2 rows of .*earlier"
    ):
        train_sft(params(max_length=12), base, data, tmp_path / "never", tmp_path / "ckpt", "round-r1", ewc,
                  "improve.rounds.r1.train")  # fmt: skip
    assert not (tmp_path / "never").exists()


def test_conversations_need_a_template_that_can_mask_the_assistant(base, tmp_path, mlflow_store):
    """loss_on: completion on `messages` rows trains the assistant's turns through the
    template's generation markers. A template without them, which TRL cannot patch, fails
    before the model loads naming sft.loss_on and what to do; loss_on: all trains; the
    built-in template (with markers) trains on the assistant's turns."""
    from transformers import AutoTokenizer

    from rlhf.training.methods.sft import SFTDataError
    from tests.conftest import train_sft

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


@pytest.mark.slow  # two trainings
def test_the_verifier_puts_its_loss_where_sft_did_unless_told(in_project):
    """Conversations and a template TRL cannot mask: the user sets `sft.loss_on: all` once.
    The verifier (the SFT model trained further on the same rows) takes it (its
    `loss_on` is null by default) and trains, logging the resolved value; its own
    `loss_on: completion` still fails, naming verifier.loss_on, before its model loads."""
    import mlflow
    from transformers import AutoTokenizer

    import stages.base
    import stages.prepare
    import stages.sft
    import stages.verifier
    from rlhf.training.methods.sft import SFTDataError

    root = in_project
    write_params(root, tiny_params(sft={"loss_on": "all"}))
    stages.prepare.main()
    stages.base.main()
    conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    pd.DataFrame({"messages": [conversation] * 16}).to_parquet(root / "data/prepared/sft.parquet")
    tokenizer = AutoTokenizer.from_pretrained(root / "models/base")
    tokenizer.chat_template = UNMARKED
    tokenizer.save_pretrained(root / "models/base")
    stages.sft.main()
    stages.verifier.main()
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.stage` = 'verifier'")
    assert runs["params.loss_on"].tolist() == ["all"]
    write_params(root, tiny_params(sft={"loss_on": "all"}, verifier={"loss_on": "completion"}))
    with pytest.raises(SFTDataError, match=r"^verifier.loss_on: completion trains on the assistant's messages only"):
        stages.verifier.main()


@pytest.mark.slow
def test_packed_sft_trains_with_trls_trainer_on_the_pretokenised_rows(base, tmp_path, mlflow_store):
    """`trl.packing: true` (the default on a CUDA GPU): TRL's SFTTrainer packs the rows the
    stage tokenised (input_ids and completion mask) into max_length rows, padding-free, and
    trains: the loss is finite and the weights move."""
    import math

    from safetensors.torch import load_file

    from tests.conftest import train_sft

    rows = {"prompt": [f"{a}+{a}\n" for a in range(24)], "completion": [f"{2 * a}" for a in range(24)]}
    data = tmp_path / "sft.parquet"
    pd.DataFrame(rows).to_parquet(data)
    config = params(max_length=32, trl={"packing": True}, learning_rate=1e-2)
    metrics, curve = train_sft(config, base, data, tmp_path / "out", tmp_path / "checkpoints")
    assert metrics["packed"] is True and metrics["steps"] == 2 and math.isfinite(metrics["train_loss"])
    before, after = load_file(base / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before if k in after)


def test_a_missing_sft_table_is_named_with_how_to_provide_it(base, tmp_path):
    """Before anything loads: the table's path and the params key that would supply it, not
    a bare `[Errno 2]` from the first read."""
    from tests.conftest import train_sft

    missing = tmp_path / "data/prepared/sft.parquet"
    with pytest.raises(
        FileNotFoundError, match=r"^sft needs .*sft\.parquet, which prepare did not write.*prepare\.files\.sft"
    ):
        train_sft(params(), base, missing, tmp_path / "out", tmp_path / "checkpoints")
    assert not (tmp_path / "out").exists()
