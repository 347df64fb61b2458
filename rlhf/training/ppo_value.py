"""PPO's value model (rlhf/training/ppo.py trains it): a token-classification model or a
decoder body with a head of ours (`load_value_model`), LoRA adapters of its own
(`value_adapters`), or under LoRA from SFT a second adapter and a head on the policy's
weights (`SharedTrunkValue`); and which parameters each optimizer steps (`trained_parameters`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForTokenClassification

from rlhf.models.folders import check_model_dir, resolve_model_dir
from rlhf.training.trainer_setup import merged_model


class ValueHeadModel(torch.nn.Module):
    """A decoder body (`AutoModel`) with a linear head giving one value per position, for
    architectures transformers has no token-classification class for (Gemma 3, OLMo, OPT,
    GPT-J...); called like one (`.logits`, shape (B, T, 1)). Ours because transformers has
    no generic value head and TRL's (`AutoModelForCausalLMWithValueHead`) left with its old
    PPO trainer."""

    def __init__(self, body, hidden_size: int):
        super().__init__()
        self.body = body
        self.score = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.score.weight)
        torch.nn.init.zeros_(self.score.bias)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return _Values(self.score(hidden.to(self.score.weight.dtype)))


@dataclass
class _Values:
    logits: torch.Tensor


def load_value_model(path: str | Path, trust_remote_code: bool = False, adapters: bool = False):
    """A token-classification model with one output per position (the value head), from a
    causal LM directory (`value_init: sft`: a new head, zero-initialised so that V = 0 at
    the start and the load is deterministic) or a reward-model directory
    (`value_init: rm`: a classifier member's Llama-style `score` head carries over, its new
    bias at 0; a likelihood member gives its trained LM body and a new, zeroed head). An
    architecture without a token-classification class gets its body and a new, zeroed
    head (`ValueHeadModel`). With `adapters` (PPO's LoRA: `value_adapters` follows) the
    frozen weights load in the compute dtype, else as float32 master weights."""
    from transformers import AutoModel

    from rlhf.models.loading import init_kwargs, missing_classifier_type

    path = check_model_dir(resolve_model_dir(path), "value model init")
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code, num_labels=1)
    config.classifier_dropout = 0.0
    # Trained in full: float32 master weights unless params `model` asks for pure half precision.
    kwargs = init_kwargs(training=True, adapters=adapters, trust_remote_code=trust_remote_code)
    kwargs.pop("quantization_config", None)  # refused for PPO by the params check: never a quantized value model
    kwargs.pop("device_map", None)
    if missing_classifier_type(path, trust_remote_code):
        body = AutoModel.from_pretrained(str(path), **kwargs)
        text = getattr(config, "text_config", None) or config
        return ValueHeadModel(body, text.hidden_size)
    model, info = AutoModelForTokenClassification.from_pretrained(
        str(path), config=config, output_loading_info=True, **kwargs
    )
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for key in info["missing_keys"]:  # the new head only (any other gap would fail the load)
            if key in parameters:
                parameters[key].zero_()
    return model


def value_adapters(value_model, lora):
    """LoRA on the value model, as on the policy (params `lora`: the same rank and targets):
    adapters on its body, its head (hidden size x 1) trained in full in float32 (peft's
    `modules_to_save` for a token-classification model, the head reading its input in its
    own dtype). The value model then holds one frozen copy of its weights in the compute
    dtype instead of float32 master weights, their gradients and AdamW's two moments: 16
    bytes a parameter, 8 GB at 0.5B. Returns the model to train (peft wraps a
    token-classification model; a `ValueHeadModel`'s body is wrapped in place)."""
    from peft import get_peft_model

    if isinstance(value_model, ValueHeadModel):  # its own float32 head reads the hidden state cast
        value_model.body = get_peft_model(value_model.body, lora.peft_config("FEATURE_EXTRACTION"))
        return value_model
    config = lora.peft_config("TOKEN_CLS")
    config.exclude_modules = list(VALUE_HEADS)  # `all-linear` would adapt the head it trains in full
    model = get_peft_model(value_model, config)
    heads = {name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name}
    for name, module in model.named_modules():
        if name in heads:
            module.float()
            module.register_forward_pre_hook(_input_in_weights_dtype)
    return model


VALUE_HEADS = ("score", "classifier")  # a token-classification model's head: peft's names for TOKEN_CLS


def _input_in_weights_dtype(module, args):
    return tuple(a.to(module.weight.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def unwrapped_value_model(value_model):
    """The plain value model after `value_adapters`: its adapters merged."""
    if isinstance(value_model, ValueHeadModel):
        value_model.body = merged_model(value_model.body)
        return value_model
    return merged_model(value_model)


VALUE_ADAPTER = "value"  # the value model's adapter on a shared trunk, beside the policy's ("default")


class SharedTrunkValue(nn.Module):
    """The value model under LoRA with `value_init: sft`: the policy's own frozen weights with
    a second LoRA adapter (`VALUE_ADAPTER`, switched on for value passes only) and a linear
    head, zeroed (V = 0 at the start) and trained in float32. It equals a separate value
    model loaded from the SFT weights with adapters of its own, without a second copy of the
    weights. Its parameters are the head and the value adapter's (the policy's weights
    are not its own). A value pass runs without gradient checkpointing: a layer recomputed
    in the backward pass would run with the policy's adapter."""

    def __init__(self, policy, lora):
        super().__init__()
        policy.add_adapter(VALUE_ADAPTER, lora.peft_config())
        self._policy = (policy,)  # a tuple: not a submodule, its weights are the policy's
        self.adapter = {n: p for n, p in policy.named_parameters() if f".{VALUE_ADAPTER}." in n}
        for parameter in self.adapter.values():
            parameter.requires_grad_(True)
        hidden = policy.get_base_model().config.get_text_config().hidden_size
        self.score = nn.Linear(hidden, 1, dtype=torch.float32)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self.score.named_parameters(prefix="score")
        yield from self.adapter.items()

    def parameters(self, recurse: bool = True):
        for _, parameter in self.named_parameters():
            yield parameter

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        own = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        policy = self._policy[0]
        base = policy.get_base_model()
        body = getattr(base, base.base_model_prefix)
        recomputing = [
            m for m in policy.modules() if getattr(m, "gradient_checkpointing", False) is True and m.training
        ]
        flags = {p: p.requires_grad for p in policy.parameters()}
        policy.set_adapter(VALUE_ADAPTER)
        for module in recomputing:
            module.training = False
        try:
            hidden = body(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
            ).last_hidden_state
        finally:
            policy.set_adapter("default")
            for module in recomputing:
                module.training = True
            for parameter, flag in flags.items():  # peft's set_adapter froze the other adapter
                parameter.requires_grad_(flag)
        return _Values(self.score(hidden.to(self.score.weight.dtype)))


def trained_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters PPO's optimizer steps for `model`: those that require gradients, less a
    shared trunk's value adapter on the policy (`SharedTrunkValue` steps it)."""
    own = isinstance(model, SharedTrunkValue)
    marker = f".{VALUE_ADAPTER}."
    return {n: p for n, p in model.named_parameters() if p.requires_grad and (own or marker not in n)}
