"""Gradient checkpointing for a context compressor (rlhf.models.compressor), under params
`model.gradient_checkpointing`: the served model recomputes its layers in the backward
pass, and a layer that read slots with the adapter off recomputes with it off.

Our own because transformers' checkpointing knows nothing of an adapter switched off for
part of a forward pass (PEFT's `disable_adapter`): torch's non-reentrant checkpoint takes
a `context_fn`, and this module gives the compressor's.
"""

from __future__ import annotations

import contextlib

from rlhf.models.chunking import CompressorError


def enable(compressor, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False) -> None:
    """`ContextCompressor.activation_checkpointing_enable`: the served model recomputes its
    decoder layers' activations in the backward pass in place of keeping them, for the
    encoder's chunks and the decoder's reading alike (the activations of the chunks encoded
    with gradients are most of a training step's memory). Always torch's non-reentrant
    checkpoint, whose recompute `as_computed` puts the adapter in the state it had, and
    without transformers' hook that makes the input embeddings require gradients (for PEFT
    under the reentrant one): the memory embeddings and the slots already do, and the hook
    would keep a gradient of every chunk's embeddings. A model checkpointing in
    transformers' old format, which drops the recompute context, is refused where the
    adapter is switched off while reading."""
    kwargs = {**(activation_checkpointing_kwargs or {}), "use_reentrant": False, "context_fn": compressor._as_computed}
    base = compressor.model.get_base_model()
    hooked = bool(getattr(base, "_require_grads_hooks", None))
    if hasattr(base, "activation_checkpointing_enable"):  # transformers 5.23 and later
        base.activation_checkpointing_enable(kwargs, every_n_layers, offload)
    else:
        base.gradient_checkpointing_enable(kwargs)
    if not hooked and hasattr(base, "disable_input_require_grads"):
        base.disable_input_require_grads()
    functions = [
        getattr(module, "_gradient_checkpointing_func", None)
        for module in base.modules()
        if getattr(module, "gradient_checkpointing", False) is True
    ]
    if not compressor.adapter_reads and not all(
        getattr(f, "keywords", {}).get("context_fn") == compressor._as_computed for f in functions
    ):
        raise CompressorError(
            f"model.gradient_checkpointing: {type(base).__name__} checkpoints its layers in transformers' old "
            "format, which drops the compressor's recompute context: its layers that read slots with the adapter "
            "off would recompute with it on (wrong gradients). Set compress.model.gradient_checkpointing: false, or "
            "compress.adapter_reads: true (the adapter on throughout)"
        )


def as_computed(compressor):
    """torch's checkpoint `context_fn`: (the forward's context, the recompute's). A layer
    recomputes in the backward pass, after `reading` has switched the adapter back on,
    so one that ran with the adapter off (the model reading slots as it is) recomputes
    with it off again: the same function, so the same activations. The recompute's context
    is entered once per recompute (again for a second backward pass over the same graph)."""
    return contextlib.nullcontext(), (AdapterOff(compressor) if compressor._adapter_off else contextlib.nullcontext())


def adapted_layers(compressor) -> list:
    """The served model's layers that carry the adapter (PEFT's tuner layers), found once."""
    if compressor._adapted is None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        compressor._adapted = [m for m in compressor.model.modules() if isinstance(m, BaseTunerLayer)]
    return compressor._adapted


class AdapterOff:
    """A compressor's LoRA layers switched off while open, and back on after, as PEFT's
    `disable_adapter` does (`enable_adapters` on each adapted layer), but reusable (a
    checkpointed layer may recompute more than once) and without PEFT's walk over the
    whole model to read its status (per layer recomputed); a no-op inside `reading`, where
    the adapter is off already."""

    def __init__(self, compressor):
        self.compressor, self.switched = compressor, False

    def __enter__(self):
        self.switched = not self.compressor._adapter_off
        if self.switched:
            for layer in adapted_layers(self.compressor):
                layer.enable_adapters(False)

    def __exit__(self, *exc) -> None:
        if self.switched:
            for layer in adapted_layers(self.compressor):
                layer.enable_adapters(True)
