"""Which checkpoint a resumed run trusts (rlhf.training.checkpoints): the newest whole one;
a damaged newer one is named and removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlhf.training.checkpoints import checkpoint_problem, usable_checkpoint


def write_checkpoint(folder: Path, step: int, state: str = "trainer_state.json") -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.ones(64)}}}, path / "optimizer.pt")
    (path / state).write_text(json.dumps({"global_step": step}))
    return path


def truncate(file: Path, keep: float = 0.5) -> None:
    file.write_bytes(file.read_bytes()[: int(file.stat().st_size * keep)])


def test_a_whole_checkpoint_has_no_problem(tmp_path):
    assert checkpoint_problem(write_checkpoint(tmp_path, 3)) is None


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda p: truncate(p / "model.safetensors"), "model.safetensors"),
        (lambda p: truncate(p / "model.safetensors", keep=0.001), "model.safetensors"),
        (lambda p: truncate(p / "optimizer.pt"), "optimizer.pt"),
        (lambda p: (p / "trainer_state.json").unlink(), "trainer_state.json"),
        (lambda p: (p / "trainer_state.json").write_text("{"), "trainer_state.json"),
    ],
    ids=["weights-cut", "weights-header-cut", "optimizer-cut", "no-state", "state-not-json"],
)
def test_a_damaged_newest_checkpoint_is_discarded_for_the_older_whole_one(tmp_path, capsys, damage, named):
    older = write_checkpoint(tmp_path, 3)
    newest = write_checkpoint(tmp_path, 6)
    damage(newest)
    assert usable_checkpoint(tmp_path, "checkpoint", "sft") == older
    assert not newest.exists()
    line = capsys.readouterr().out
    assert f"sft: discarding damaged checkpoint {newest}: " in line and named in line


def test_a_flipped_byte_inside_the_optimizer_state_fails_its_crc(tmp_path):
    path = write_checkpoint(tmp_path, 3)
    data = bytearray((path / "optimizer.pt").read_bytes())
    # Flip a byte of the stored tensor data (after the archive's first entry header).
    index = data.index(b"\x00\x00\x80\x3f") if b"\x00\x00\x80\x3f" in data else len(data) // 2
    data[index] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(data))
    assert "optimizer.pt" in checkpoint_problem(path)


def test_no_whole_checkpoint_means_a_fresh_start_and_ppo_steps_are_read_too(tmp_path):
    only = write_checkpoint(tmp_path, 4)
    truncate(only / "model.safetensors")
    assert usable_checkpoint(tmp_path, "checkpoint", "sft") is None
    assert usable_checkpoint(tmp_path / "missing", "checkpoint", "sft") is None
    step = tmp_path / "ppo" / "step-2"
    step.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, str(step / "policy.safetensors"))
    (step / "state.json").write_text(json.dumps({"iteration": 2}))
    assert usable_checkpoint(tmp_path / "ppo", "step", "ppo") == step


def test_a_checkpoint_resumes_only_under_the_same_task_and_trust(tmp_path):
    """The key of a run's checkpoints held its params block and input files only: a GRPO run
    killed and rerun after task.kind changed (how answer_match reads answers) resumed and
    mixed two rewards. The task's identity is in the key now; TRL's configs that load a
    reference from the policy's path get trust_remote_code (they failed on custom code)."""
    from trl import RLOOConfig
    from trl.experimental.orpo import ORPOConfig

    from rlhf.tasks import TaskConfig, get_task
    from rlhf.training.params import TrainingParams
    from rlhf.training.trainer_setup import fingerprint, trl_config

    params = TrainingParams()
    data = tmp_path / "prompts.parquet"
    data.write_text("x")
    last_number = get_task(TaskConfig(kind="last_number")).identity()
    regex = get_task(TaskConfig(kind="regex", pattern=r"Final: (\S+)")).identity()
    other_regex = get_task(TaskConfig(kind="regex", pattern=r"Answer: (\S+)")).identity()
    keys = {fingerprint(params, [data], {"task": t}) for t in (last_number, regex, other_regex)}
    assert len(keys) == 3
    assert fingerprint(params, [data], {"task": regex}) == fingerprint(params, [data], {"task": dict(regex)})
    assert trl_config(RLOOConfig, params, tmp_path / "out", trust_remote_code=True).trust_remote_code is True
    assert trl_config(RLOOConfig, params, tmp_path / "out").trust_remote_code is False
    trl_config(ORPOConfig, params, tmp_path / "out", trust_remote_code=True)  # no such field: not passed


def test_a_length_error_names_the_published_file_not_the_staging_folder():
    """A round trains on a table in its staging folder (atomic_dir's `.r1.tmp-<pid>-<hex>`),
    gone once the error is read: the message names where the file is published."""
    from rlhf.atomic import published_path
    from rlhf.training.trainer_setup import TrainingDataError, length_report

    staged = Path("data/rounds/.r1.tmp-25576-b2280401/train.parquet")
    assert published_path(staged) == Path("data/rounds/r1/train.parquet")
    assert published_path("models/.sft.tmp-7-0123abcd") == Path("models/sft")
    assert published_path("data/.hidden/x.tmp") == Path("data/.hidden/x.tmp")
    with pytest.raises(TrainingDataError, match=r" every prompt of data/rounds/r1/train.parquet fills it"):
        length_report([20], [25], [False], 16, "improve.rounds.r1.train.max_length", staged)


def test_offline_rows_cut_at_max_length_are_counted_and_pairs_cut_alike_are_named(tmp_path, capsys):
    """TRL cuts prompt + response at max_length without a word: the cut rows were counted 0
    (the prompt's length was passed as the whole row's), and pairs whose chosen and
    rejected differ only after the cut carried no preference unnoticed."""
    import pandas as pd
    from datasets import Dataset

    from rlhf.models.loading import build_tokenizer
    from rlhf.training.trl_training import fitting_rows

    tokenizer = build_tokenizer()  # one token a character
    table = pd.DataFrame(
        {
            "prompt": ["1+2\n", "3+4\n", "9+9+9+9+9+9\n"],
            "chosen": ["1+2=3; answer 3", "3+4=7; answer 7", "x"],
            "rejected": ["1+2=3; answer 4", "3+4=8; answer 8", "y"],
        }
    )
    # max_length 16: prompts of 4 tokens leave 12; "1+2=3; answer 3" (15) is cut after "1+2=3; answe" in
    # both sides (alike), "3+4=7; ..." differs at its fifth token; the 12-token prompt fills 16 - room
    table = Dataset.from_pandas(table, preserve_index=False)
    kept, counts = fitting_rows(table, tokenizer, 16, "policy.dpo.max_length", tmp_path / "prefs.parquet", room=5)
    assert counts == {"truncated_rows": 2, "dropped_rows": 1, "indistinct_pairs": 1}
    assert len(kept) == 2
    assert "1 pairs of" in capsys.readouterr().out
    _, roomy = fitting_rows(table, tokenizer, 64, "policy.dpo.max_length", tmp_path / "prefs.parquet")
    assert roomy == {"truncated_rows": 0, "dropped_rows": 0, "indistinct_pairs": 0}


def test_lora_target_modules_the_model_lacks_fail_naming_the_key():
    """A typo in lora.target_modules failed inside peft (NoMatchingPeftModuleError), and an
    adapter on lm_head inside TRL's DPO trainer, both with a traceback naming no key."""
    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.params import ParamsError
    from rlhf.training.params import LoraParams

    model = build_tiny_model("micro", build_tokenizer(), seed=0)
    key = "policy.dpo.lora.target_modules"
    with pytest.raises(ParamsError, match=r"policy.dpo.lora.target_modules: \['q_prj'\] match no module .*q_proj"):
        LoraParams(enabled=True, target_modules=["q_prj", "v_proj"]).check_targets(model, key)
    head = LoraParams(enabled=True, target_modules=["q_proj", "lm_head"])
    head.check_targets(model, key)  # a trainer that can adapt it
    with pytest.raises(ParamsError, match=r"lm_head is the output layer, which this trainer cannot adapt"):
        head.check_targets(model, key, output_layer=False)
    LoraParams(enabled=True).check_targets(model, key, output_layer=False)  # all-linear: peft's own choice


def test_kto_rows_derived_from_pairs_are_not_read_side_by_side():
    """prepare derives KTO's unpaired rows from pairs, each prompt's chosen and rejected side
    by side, and TRL's KTO reads them in file order, pairing each row's prompt with its
    neighbour's completion for the KL term: half of those were the prompt's own other
    answer, in the same order whatever policy.kto.seed. The stage reads them in an order
    drawn from the seed."""
    import pandas as pd
    from datasets import Dataset

    from rlhf.training.trl_training import seeded_order

    rows = [(f"p{i}", side, side == "chosen") for i in range(200) for side in ("chosen", "rejected")]
    table = pd.DataFrame(rows, columns=["prompt", "completion", "label"])

    def neighbours_alike(frame) -> float:
        prompts = frame["prompt"].tolist()
        return sum(a == b for a, b in zip(prompts, prompts[1:] + prompts[:1])) / len(prompts)

    assert neighbours_alike(table) == 0.5
    dataset = Dataset.from_pandas(table, preserve_index=False)
    first, again, other = (seeded_order(dataset, seed).to_pandas() for seed in (0, 0, 1))
    assert neighbours_alike(first) < 0.05 and first.equals(again) and not first.equals(other)
    assert sorted(map(tuple, first.values.tolist())) == sorted(map(tuple, table.values.tolist()))


@pytest.mark.slow
@pytest.mark.parametrize("resumable", [True, False], ids=["train_resumable", "plain-train"])
def test_a_stage_keeps_its_periodic_checkpoints_but_writes_none_at_the_last_step(tmp_path, resumable):
    """train_resumable saves every save_steps, but not at the last step (the stage saves the
    model next and then deletes its checkpoints): a plain Trainer.train writes checkpoint-4
    here, a stage's training does not."""
    from transformers import Trainer, TrainingArguments

    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.training.trainer_setup import train_resumable

    tokenizer = build_tokenizer()
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 20, (8, 6)).tolist()]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, save_steps=2, per_device_train_batch_size=2, use_cpu=True,
        report_to="none", disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=build_tiny_model("micro", tokenizer, seed=0), args=args, train_dataset=rows)
    train_resumable(trainer, "sft", "test") if resumable else trainer.train()
    assert trainer.state.global_step == 4 and (tmp_path / "checkpoint-2/trainer_state.json").is_file()
    assert (tmp_path / "checkpoint-4").exists() == (not resumable)


@pytest.mark.slow
def test_the_fused_lm_head_in_smaller_cpu_chunks_gives_the_same_log_probs_and_gradients():
    """cpu_lm_head_chunks sets TRL's chunk (a private constant of the pinned TRL, read at each
    call) while a CPU trainer trains, and restores it: the same log-probs and gradients as
    TRL's default chunk, for a bf16 head over a vocabulary wider than both chunks."""
    import trl.trainer.utils as trl_utils
    from trl.kernels import ChunkedLogProbFunction

    from rlhf.training.trainer_setup import CPU_LM_HEAD_CHUNK, cpu_lm_head_chunks

    default = 32768  # TRL 1.16's
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == default, "restored after every stage's training"
    cpu = type("Trainer", (), {"args": type("Args", (), {"device": torch.device("cpu")})()})()
    with cpu_lm_head_chunks(cpu):
        assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == CPU_LM_HEAD_CHUNK < default
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == default
    torch.manual_seed(0)
    hidden = torch.randn(24, 32, dtype=torch.bfloat16)
    weight = torch.randn(40_000, 32, dtype=torch.bfloat16) * 0.1
    targets = torch.randint(0, 40_000, (24,))

    def log_probs(chunk: int):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = ChunkedLogProbFunction.apply(h, w, None, targets, 1.0, chunk, None, 1.0, ("log_probs",))[0]
        out.float().sum().backward()
        return out.float(), h.grad.float(), w.grad.float()

    for small, large in zip(log_probs(CPU_LM_HEAD_CHUNK), log_probs(default)):
        torch.testing.assert_close(small, large, rtol=1e-2, atol=1e-3)
