"""Building the built-in tiny model, and loading and saving any local causal LM.

`builtin:tiny` is a small Llama-style model with a character-level tokenizer, built here
from a seed so that the default pipeline needs no hub. With `nope_layers` some (or all) of
its attention layers use no position embedding (NoPE): the model is then built as
transformers' SmolLM3 architecture, which is Llama's with per-layer `no_rope_layers`, so
every Hugging Face tool loads it without custom code. Rotary embeddings let a model find
things by their distance, which does not extend past the lengths it trained on; NoPE layers
must find them by content, which can (on the built-in task, a RoPE model trained on 3-5
numbers writes at most four steps on longer problems; an all-NoPE one writes them all).
With `rope_window` the RoPE layers attend to the last few tokens only (a sliding window):
positions then serve what is near (the digits of one step's arithmetic), and what is far
(the next number of the problem) must be found by content, in the NoPE layers.

The tokenizer's chat template wraps the assistant turn in ``{% generation %}`` markers, which is what TRL's
``assistant_only_loss`` reads to train on the assistant's tokens only.

A user model is any local Hugging Face causal-LM directory. It is checked for the files
it needs before anything is loaded, with an error that says what is missing and how to
make such a directory.
"""

from __future__ import annotations

import contextlib
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    TokenizersBackend,
)

from rlhf.models.compute import current
from rlhf.models.folders import BUILTIN_SIZES, POINTER_FILE, check_model_dir, check_nope_layers, resolve_model_dir

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, USER, ASSISTANT, END]

# Every printable ASCII character is one token; anything else maps to <unk>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII with chat special tokens."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in string.printable:
        if char not in vocab and char not in "\t\r\x0b\x0c":
            vocab[char] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT, END],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=256,
    )
    return tokenizer


def build_tiny_model(
    size: str,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    max_length: int = 256,
    nope_layers: list[int] | tuple[int, ...] = (),
    rope_window: int | None = None,
) -> PreTrainedModel:
    """A built-in model of `size` (rlhf.models.folders.BUILTIN_SIZES), seeded; the layers
    numbered in `nope_layers` (from 0) use no position embedding, and with `rope_window` the
    other layers attend to the last `rope_window` tokens only (see the module docstring)."""
    if size not in BUILTIN_SIZES:
        raise ValueError(f"unknown built-in model size {size!r}; expected one of {sorted(BUILTIN_SIZES)}")
    check_nope_layers(size, nope_layers)
    hidden, layers, heads, intermediate = BUILTIN_SIZES[size]
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    if nope_layers or rope_window:
        rope = [int(layer not in nope_layers) for layer in range(layers)]  # 1: the layer uses RoPE
        config = SmolLM3Config(
            **shape,
            no_rope_layers=rope,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # Llama's, for the RoPE layers
            use_sliding_window=rope_window is not None,
            sliding_window=rope_window,
            layer_types=["sliding_attention" if r and rope_window else "full_attention" for r in rope],
        )
        model = SmolLM3ForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# ----------------------------------------------------------------------------- loading


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a model folder: a stage's, or the user's folder a pointer names,
    unless the pointer's own folder holds a tokenizer (stage base's, with the chat template
    `base.chat_template` put on it)."""
    path = Path(path)
    own = (path / POINTER_FILE).is_file() and (path / "tokenizer_config.json").is_file()
    source = path if own else resolve_model_dir(path)
    if declared_class(source) == "TokenizersBackend" and (source / "tokenizer.json").is_file():
        # As saved: transformers (5.24) gives some model types (qwen2, phi3...) their own
        # class whatever the folder declares, rebuilt from the vocabulary; a character
        # tokenizer beside a Qwen2 config then lost every newline. tokenizer.json holds
        # the whole pipeline (normaliser, pre-tokenizer, model, decoder).
        tokenizer = TokenizersBackend.from_pretrained(str(source))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Generation batches prompts of different lengths: pad on the left.
    tokenizer.padding_side = "left"
    return tokenizer


def declared_class(folder: Path) -> str | None:
    """The tokenizer class a model folder's tokenizer_config.json names, if any."""
    import json

    config = folder / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except (OSError, ValueError):
        return None  # AutoTokenizer reports what is wrong with the file


def load_causal_lm(
    path: str | Path,
    trust_remote_code: bool = False,
    what: str = "model",
    placement=None,
    training: bool = False,
    adapters: bool = False,
    settings=None,
    dtype: str | None = None,
) -> PreTrainedModel:
    """A local causal LM, loaded as params `model` says (rlhf.models.settings; `settings`
    replaces this process's): for inference, and as the frozen base of LoRA `adapters`, in
    the compute dtype; for `training` in full, float32 master weights (the trainer's mixed
    precision does the rest); quantized when asked. `dtype` forces one (merging averages
    weights in float32). On the process's device, except a quantized model (bitsandbytes
    places it as it loads) and a model a sharded launch (FSDP, ZeRO-3) will shard."""
    from rlhf.models.compute import sharded_launch

    path = check_model_dir(resolve_model_dir(path), what)
    placement = placement or current()
    kwargs = init_kwargs(settings, training=training, adapters=adapters, trust_remote_code=trust_remote_code,
                         placement=placement, dtype=dtype)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if "device_map" in kwargs or (training and sharded_launch()):
        return model
    return model.to(placement.device)


def init_kwargs(
    settings=None,
    *,
    training: bool = False,
    adapters: bool = False,
    trust_remote_code: bool = False,
    placement=None,
    dtype: str | None = None,
) -> dict:
    """`from_pretrained` keyword arguments for params `model` (`settings`, else this process's):
    the weights' dtype (`rlhf.models.settings.weights_dtype`), the attention implementation,
    and with quantization the `BitsAndBytesConfig` and a device map that puts the whole
    model on this process's device (TRL's `get_kbit_device_map`). The same arguments go to
    TRL's trainers as `model_init_kwargs`, so a trainer's reference model loads like the
    policy. Only safetensors are read."""
    import rlhf.models.settings as model_settings

    settings = settings or model_settings.current()
    placement = placement or current()
    name = dtype or model_settings.weights_dtype(settings, placement.dtype, training, adapters)
    kwargs = {
        "dtype": getattr(torch, name),
        "attn_implementation": settings.attn_implementation,
        "trust_remote_code": trust_remote_code,
        "use_safetensors": True,
    }
    if settings.quantization is not None:
        kwargs["quantization_config"] = quantization_config(settings.quantization, placement)
        kwargs["device_map"] = {"": placement.device if placement.device != "cuda" else torch.cuda.current_device()}
    return kwargs


def quantization_config(quantization, placement):
    """transformers' `BitsAndBytesConfig` for params `model.quantization`, as TRL's
    `get_quantization_config` builds it: 4-bit with its data type, double quantization,
    the compute dtype of the matmuls and the storage dtype; or 8-bit."""
    from transformers import BitsAndBytesConfig

    if quantization.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = placement.dtype if quantization.compute_dtype == "auto" else quantization.compute_dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization.quant_type,
        bnb_4bit_use_double_quant=quantization.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, compute),
        bnb_4bit_quant_storage=getattr(torch, quantization.quant_storage or "uint8"),
    )


def empty_causal_lm(path: str | Path, trust_remote_code: bool = False) -> PreTrainedModel:
    """The model in `path` with no weights (on the meta device): its modules and shapes, for
    checks before the real load, in milliseconds whatever its size."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(resolve_model_dir(path)), trust_remote_code=trust_remote_code)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def resized_copy(path: str | Path, tokenizer, out_dir: str | Path, trust_remote_code: bool = False) -> None:
    """The model in `path`, in its checkpoint's dtype on the CPU, with its embeddings grown to
    `tokenizer` (new rows at the mean of the old, transformers' default) and the tokenizer's
    EOS among the tokens generation stops at, saved with `tokenizer` into `out_dir`."""
    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir(path)), dtype="auto", trust_remote_code=trust_remote_code, use_safetensors=True
    )
    model.resize_token_embeddings(len(tokenizer))
    stops = model.generation_config.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops or [])
    model.generation_config.eos_token_id = list(dict.fromkeys([*stops, tokenizer.eos_token_id]))
    save_model(model, tokenizer, out_dir)


def merge_adapter(
    base_dir: str | Path, adapter_dir: str | Path, trust_remote_code: bool = False, auto_class=None, **kwargs
) -> PreTrainedModel:
    """The LoRA adapter in `adapter_dir` merged into the base in `base_dir`, the base loaded
    on the CPU in the compute dtype, unquantized (a QLoRA adapter's base trained in 4 bits:
    the merged weights are the unquantized base's plus B·A, as QLoRA's users merge).
    `auto_class` (a causal LM unless given) and `kwargs` load the base as it was trained
    (a reward model: AutoModelForSequenceClassification with num_labels=1)."""
    from peft import PeftModel

    dtype = current().torch_dtype
    base = (auto_class or AutoModelForCausalLM).from_pretrained(
        str(resolve_model_dir(base_dir)), dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True,
        **kwargs,
    )  # fmt: skip
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def load_reward_model(path: str | Path, trust_remote_code: bool = False, what: str = "reward model", placement=None):
    """A sequence-classification reward model for inference, loaded as `load_causal_lm` loads
    one (params `model`)."""
    path = check_model_dir(resolve_model_dir(path), what)
    placement = placement or current()
    kwargs = init_kwargs(trust_remote_code=trust_remote_code, placement=placement)
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, **kwargs)
    return model if "device_map" in kwargs else model.to(placement.device)


def missing_classifier_type(path, trust_remote_code: bool = False, head: str = "Token") -> str | None:
    """None when transformers (or the model's own code) has a `head` ("Token", or
    "Sequence") classification class for the model in `path`, else its model type: Gemma 3,
    OLMo, OPT and GPT-J have no token classifier; Granite and Cohere no sequence classifier."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, f"MODEL_FOR_{head.upper()}_CLASSIFICATION_MAPPING_NAMES")
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    custom = f"AutoModelFor{head}Classification" in (getattr(config, "auto_map", None) or {})
    return None if custom or config.model_type in names else config.model_type


class DivergedError(RuntimeError):
    """Training left weights that are not finite numbers: nothing is saved."""


def check_finite(weights: dict, what: str) -> None:
    """Raise `DivergedError` naming the tensors of `weights` (name -> tensor) that hold NaN
    or inf, so that a diverged run fails instead of saving a model that writes nothing."""
    import torch

    bad = [
        name for name, tensor in weights.items() if torch.is_floating_point(tensor) and not torch.isfinite(tensor).all()
    ]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise DivergedError(
            f"{what}: training diverged: {len(bad)} of {len(weights)} weight tensors hold NaN or inf ({shown}); "
            "nothing was saved. Lower the learning rate, or check the logged loss for the step it broke"
        )


def stored_dtype(path: str | Path) -> str | None:
    """The dtype a model folder's weights are stored in ('float32', 'bfloat16', ...), as its
    config.json states it (`dtype`, or the older `torch_dtype`); None when it states none or
    has no readable config. Read as JSON: no model code runs."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return None if not isinstance(dtype, str) else dtype.removeprefix("torch.")


def save_dtype(model, settings=None, placement=None) -> str | None:
    """The half-precision dtype to store `model`'s float32 weights in (params
    `model.save_dtype`), or None to store them as held; weights are never widened
    (`float32` keeps float32 weights whole and half-precision ones as they are). With
    `auto`: where the process computes in half precision (a GPU), the dtype of the
    checkpoint the model was loaded from (`config._name_or_path`) when that is bfloat16 or
    float16 and the model holds float32 weights (full fine-tuning's master weights); on a
    CPU computing in float32, as held: a float32 checkpoint loads without a copy
    (safetensors maps the file), where a bf16 one is converted into new memory at every
    stage that loads it (rl@ppo at the 0.5B shape: 6.44 GiB above its imports against 5.54;
    benchmarks/README.md)."""
    import rlhf.models.settings as model_settings

    half = model_settings.HALF
    chosen = (settings or model_settings.current()).save_dtype
    held = {p.dtype for p in model.parameters() if torch.is_floating_point(p)}
    if chosen == "float32" or held != {torch.float32}:
        return None
    if chosen != "auto":
        return chosen
    if (placement or current()).dtype not in half:
        return None
    source = getattr(model.config, "_name_or_path", "") or ""
    stored = stored_dtype(source) if source and Path(source).is_dir() else None
    return stored if stored in half else None


def cast_weights(weights: dict, dtype: str) -> dict:
    """`weights` (name -> tensor) with their float32 tensors in `dtype` (others as they are);
    a tensor under several names (tied weights, `tied_as_in`) is cast once and stays shared,
    so that safetensors stores it once."""
    target, cast, out = getattr(torch, dtype), {}, {}
    for name, tensor in weights.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
            if id(tensor) not in cast:  # the dict keeps every tensor alive: ids stay unique
                cast[id(tensor)] = tensor.detach().to(target)
            tensor = cast[id(tensor)]
        out[name] = tensor
    return out


def tied_as_in(model, weights: dict) -> dict:
    """`weights` (name -> tensor) with the names `model` ties to one parameter (tied input
    and output embeddings) pointing to one tensor, as in the model, so that transformers
    stores it once: a state dict gathered from shards (FSDP) holds a copy under each name."""
    out, first = dict(weights), {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        main = first.setdefault(id(parameter), name)
        if main != name and main in out and name in out:
            out[name] = out[main]
    return out


def save_model(
    model, tokenizer, path: str | Path, state_dict: dict | None = None, checked: bool = False, settings=None
) -> None:
    """`model` (its weights, or `state_dict` when given: gathered weights of a sharded
    model) as safetensors, and `tokenizer`, into `path`; weights that are not finite are
    refused (`check_finite`), unless the caller has `checked` what training changed (a
    LoRA run: its adapter, before merging). Float32 weights are stored in `save_dtype`'s
    dtype where it names one (a bf16 checkpoint stays bf16), the config saying so, and the
    model keeps the values it was saved with (`stored_as`); tied weights are stored once
    (`tied_as_in`)."""
    if not checked:
        check_finite(state_dict if state_dict is not None else model.state_dict(), str(path))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:
        state_dict = tied_as_in(model, state_dict)
    dtype = save_dtype(model, settings)
    if dtype is None:
        model.save_pretrained(str(path), safe_serialization=True, state_dict=state_dict)
    elif state_dict is not None:  # gathered weights: a copy in the stored dtype
        state_dict = cast_weights(state_dict, dtype)
        if dtype == "float16":  # float16 overflows where float32 and bfloat16 do not
            check_finite(state_dict, f"{path} in float16 (model.save_dtype)")
        held = model.config.dtype
        try:
            model.save_pretrained(str(path), safe_serialization=True, state_dict=state_dict)
            model.config.dtype = dtype  # save_pretrained wrote the dtype the model holds
            model.config.save_pretrained(str(path))
        finally:
            model.config.dtype = held
    else:  # cast in place, a tensor at a time, and back: one copy held, not one and a half
        with stored_as(model, getattr(torch, dtype)):
            if dtype == "float16":
                check_finite(model.state_dict(), f"{path} in float16 (model.save_dtype)")
            model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))


@contextlib.contextmanager
def stored_as(model, dtype):
    """`model`'s float32 parameters cast to `dtype` in place, one tensor at a time, and back
    to float32 on leaving: the model then holds the values it was saved with (rounded to
    `dtype`), in the dtype it computes in. Buffers are left as they are (rotary frequencies
    would not come back whole)."""
    cast, held = [p for p in model.parameters() if p.dtype == torch.float32], model.config.dtype
    try:
        for parameter in cast:
            parameter.data = parameter.data.to(dtype)
        yield model
    finally:
        for parameter in cast:
            parameter.data = parameter.data.to(torch.float32)
        model.config.dtype = held  # save_pretrained set it to the dtype it wrote


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
