"""Length-bucketed SFT (rlhf.training.bucketed_sft): a batch run as sorted sub-batches has
exactly the loss and the gradients of the whole batch, and logs the same metrics."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trl import SFTConfig

from rlhf.models.loading import build_tiny_model, build_tokenizer
from rlhf.training.bucketed_sft import LengthBucketedSFTTrainer, right_padded

ROWS = [
    {"prompt": f"{a}+{b}-{c}\n", "completion": f"{a}+{b}={a + b}; {a + b}-{c}={a + b - c}; answer {a + b - c}"}
    for a, b, c in [(1, 2, 3), (12, 7, 3), (25, 14, 9), (3, 3, 1), (120, 45, 7), (9, 9, 9), (40, 2, 1), (7, 70, 77)]
] + [{"prompt": "5+5\n", "completion": "answer 10"}, {"prompt": "1000+2000+3000\n", "completion": "answer 6000"}]


def trainer(tmp_path, buckets: int, dataset: Dataset | None = None) -> LengthBucketedSFTTrainer:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model("micro", tokenizer, seed=0)
    args = SFTConfig(output_dir=str(tmp_path / f"b{buckets}"), per_device_train_batch_size=len(ROWS), report_to=[],
                     use_cpu=True, max_length=96, completion_only_loss=True, bf16=False)  # fmt: skip
    return LengthBucketedSFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset if dataset is not None else Dataset.from_list(ROWS),
        processing_class=tokenizer,
        buckets=buckets,
    )


def loss_and_grads(trainer: LengthBucketedSFTTrainer, batch: dict, num_items) -> tuple[float, dict]:
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=num_items)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("given_count", [True, False], ids=["count-given", "count-computed"])
def test_sub_batches_give_the_batch_loss_and_gradients(tmp_path, given_count):
    """Ten rows of 6 to 45 tokens, right-padded to the longest: the loss of 4 (and of 3)
    length-sorted sub-batches equals the whole batch's to 1e-6, and so does every gradient,
    whether the Trainer passes the batch's token count or the trainer counts it; the logged
    accuracy and entropy are one token-weighted entry per batch, equal to the plain ones."""
    plain, bucketed, three = trainer(tmp_path, 1), trainer(tmp_path, 4), trainer(tmp_path, 3)
    batch = next(iter(plain.get_train_dataloader()))
    assert right_padded(batch["attention_mask"]) and batch["attention_mask"].sum(1).unique().numel() > 4
    count = (batch["labels"][:, 1:] != -100).sum() if given_count else None
    loss, grads = loss_and_grads(plain, batch, count)
    for other in (bucketed, three):
        other_loss, other_grads = loss_and_grads(other, batch, count)
        assert other_loss == pytest.approx(loss, abs=1e-6)
        assert grads.keys() == other_grads.keys()
        worst = max(float((grads[k] - other_grads[k]).abs().max()) for k in grads)
        assert worst < 1e-6, worst
        for name in ("mean_token_accuracy", "entropy"):
            assert len(other._metrics["train"][name]) == 1
            assert other._metrics["train"][name][0] == pytest.approx(plain._metrics["train"][name][0], abs=1e-5)
        assert other._total_train_tokens == int(batch["attention_mask"].sum())


def test_left_padded_batches_take_trls_path(tmp_path):
    """A left-padded batch is not cut into sub-batches (the padding would come first)."""
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert not right_padded(mask) and right_padded(mask.flip(1))


def test_batched_tokenisation_matches_trls_own(tmp_path):
    """SFTTrainer given raw prompt/completion rows and given `tokenize_prompt_completion`'s
    rows ends with the same input_ids and labels, row for row (EOS appended, the completion
    mask starting after the prompt: for '5+5\\n' + 'answer 10', 4 masked tokens then 10)."""
    from rlhf.training.bucketed_sft import tokenize_prompt_completion

    tokenizer = build_tokenizer()
    ours = tokenize_prompt_completion(tokenizer, [r["prompt"] for r in ROWS], [r["completion"] for r in ROWS])
    assert ours["completion_mask"][8] == [0] * 4 + [1] * 10
    assert ours["input_ids"][8][-1] == tokenizer.eos_token_id
    raw = trainer(tmp_path, 1).train_dataset
    pretokenized = trainer(tmp_path, 1, dataset=ours).train_dataset
    assert pretokenized["input_ids"] == raw["input_ids"]
    assert pretokenized["labels"] == raw["labels"]
