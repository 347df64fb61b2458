"""Gradient checkpointing of a context compressor (rlhf/models/compressor_checkpointing.py):
the served model's layers recompute in the backward pass with the adapter as it was, and a
model in transformers' old checkpointing format is refused. The stage under
`model.gradient_checkpointing` is tested in tests/test_compressor.py."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.compressor import CompressorError, ContextCompressor
from rlhf.models.loading import build_tiny_model, build_tokenizer


@pytest.fixture
def micro():
    tokenizer = build_tokenizer()
    return build_tiny_model("micro", tokenizer, seed=0), tokenizer


def test_checkpointing_recomputes_the_served_layers_and_leaves_the_loss_and_gradients_as_they_were(micro):
    """params model.gradient_checkpointing: transformers' Trainer calls the compressor's
    `activation_checkpointing_enable`; the served model's layers then run again in the
    backward pass (for the chunks encoded with gradients and the decoder's reading) in place
    of keeping their activations, and the loss and every trained part's gradient are what
    they are without it."""
    model, tokenizer = micro
    compressor = ContextCompressor.new(model, tokens=2, chunk_tokens=16, served_path="m", window=256, select=1)
    torch.manual_seed(0)
    for name, param in compressor.named_parameters():
        if "lora_B" in name:  # LoRA's B starts at zero: give A a gradient to compare too
            torch.nn.init.normal_(param, std=0.1)
    filler = "Filler words here. Other words there. More filler words. "
    contexts = [filler + "The code is 41.", "The code is 7. " + filler]
    relevant = ["The code is 41.", "The code is 7."]
    prompts = [[{"role": "user", "content": "Code?"}]] * 2
    answers = [[{"role": "assistant", "content": a}] for a in ("41", "7")]
    # transformers checkpoints a layer's `forward`, so a module inside it is entered again in the
    # recompute (a pre-hook: the recompute stops once it has what the backward pass needs)
    inner = compressor.model.get_base_model().base_model.layers[0].mlp
    calls = []
    inner.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))

    def step(twice: bool = False) -> tuple[torch.Tensor, dict, int, int]:
        compressor.zero_grad()
        calls.clear()
        torch.manual_seed(1)  # the chunk drawn at random per row
        loss = compressor.loss(tokenizer, contexts, prompts, answers, relevant)
        forward = len(calls)
        if twice:  # a second backward pass over the same graph recomputes again
            loss.backward(retain_graph=True)
            compressor.zero_grad()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in compressor.named_parameters() if p.requires_grad}
        return loss.detach(), grads, forward, len(calls) - forward

    compressor.train()
    loss, grads, forward, recomputed = step()
    assert forward == 3 and recomputed == 0, "scoring pass, chunks read, decoder; nothing again"
    embed = compressor.model.get_input_embeddings()
    compressor.activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers=1, offload=False)
    assert not embed._forward_hooks, "no hook makes every chunk's embeddings require gradients"
    checked_loss, checked_grads, forward, recomputed = step(twice=True)
    assert forward == 3 and recomputed == 4, "the two passes with gradients run again in each backward pass"
    assert torch.allclose(checked_loss, loss, atol=1e-6)
    assert grads.keys() == checked_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        assert torch.allclose(checked_grads[name], grad, atol=1e-5, rtol=1e-4), name
    assert all(p.requires_grad for n, p in compressor.named_parameters() if "lora_" in n), "the adapter is back on"


def test_checkpointing_a_model_in_transformers_old_format_fails_naming_the_key(micro):
    """A model whose own code checkpoints its layers the old way (`_set_gradient_checkpointing(module,
    value)`, remote code) drops the recompute context that switches the adapter off for the
    decoder's layers: with the adapter off while reading, that would train on wrong
    gradients, so it fails naming the key; with the adapter on throughout it is allowed."""
    _, tokenizer = micro

    def old_format():
        model = build_tiny_model("micro", tokenizer, seed=0)

        class OldFormat(type(model)):
            def _set_gradient_checkpointing(self, module, value=False):
                if hasattr(module, "gradient_checkpointing"):
                    module.gradient_checkpointing = value
                    module._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint

        model.__class__ = OldFormat
        return model

    compressor = ContextCompressor.new(old_format(), tokens=2, chunk_tokens=16, served_path="m", window=256)
    with pytest.raises(CompressorError, match=r"compress\.model\.gradient_checkpointing: false"):
        compressor.activation_checkpointing_enable()
    reads = ContextCompressor.new(old_format(), 2, 16, "m", window=256, adapter_reads=True)
    reads.activation_checkpointing_enable()
