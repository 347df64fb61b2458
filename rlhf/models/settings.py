"""How weights are loaded: params.yaml `model`, the same for every stage that loads a model,
overridable per stage (a `model:` block in that stage's section, or in a policy method's).

* `dtype`: the dtype the weights are loaded in. `auto` loads what each use needs: a model
  that runs inference, and the frozen base under LoRA or QLoRA adapters, in the compute
  dtype (`compute.dtype`: bfloat16 on a recent GPU, float32 on a CPU); a model trained in
  full in float32, the master weights that the trainer's bf16/fp16 mixed precision
  (`compute.dtype`) computes from. `bfloat16` (or `float16`) trains in full in that dtype
  too: pure half-precision training, half the memory, less precise updates.
* `attn_implementation`: `sdpa` (PyTorch's fused attention, everywhere), `eager`,
  `flash_attention_2` / `flash_attention_3` (the flash-attn package, a CUDA GPU), or a Hub
  kernel such as `kernels-community/flash-attn` (the `kernels` package). A package that is
  not installed fails at the stage's start with what to install.
* `quantization`: load the weights in 4 or 8 bits through bitsandbytes, as TRL builds its
  `BitsAndBytesConfig` (`trl.trainer.utils.get_quantization_config`): a training stage then
  trains LoRA adapters on the quantized base (QLoRA: 4 bits, NF4, double quantization, the
  compute dtype for the matmuls), and an inference stage runs the quantized model.
* `kernels`: the layer kernels training runs with. `auto` (the default) applies Liger's
  Triton kernels (RMSNorm, SwiGLU, RoPE: fused elementwise work, less activation memory) on
  a CUDA GPU where liger-kernel is installed (`pip install 'rlhf-pipeline[gpu]'`), and none
  elsewhere (Triton's kernels need a GPU); `liger` asks for them (refused before compute
  where they cannot run); `none` keeps the model's own modules. Liger's fused linear
  cross-entropy stays off: TRL 1.16 computes log-probs through its own chunked LM head, and
  Liger's would replace the model's forward (a reward model's head is a classifier). TRL
  1.16 marks its `use_liger_kernel` as deprecated in favour of Hub kernels
  (`use_kernels`), which are fetched from the Hub at first use; Liger is a pip package that
  works offline, so it is the one chosen here.
* `gradient_checkpointing`: recompute activations in the backward pass (transformers'
  activation checkpointing): a large model's activations no longer hold memory, at about
  a third more compute.
* `save_dtype`: the dtype of the weights a stage saves. `auto`, where the stages compute in
  half precision (a GPU), stores full fine-tuning's float32 master weights back in the
  checkpoint's dtype when that is bfloat16 or float16 (as Hub models are), so a fine-tuned
  model stays the size it was, as merge's output does. On a CPU (float32) it stores them
  as held: a float32 checkpoint loads without a copy (safetensors maps the file), a bf16
  one costs its float32 copy in memory at every later stage. `bfloat16` on a CPU halves the
  disk (a real-size DAG: benchmarks/README.md) for up to 0.9 GiB more a stage at 0.5B. A
  LoRA update smaller than half a bf16 step rounds away in a bf16 merged copy, as in any
  bf16 merge (the adapter folder keeps it exact); `float32` keeps every bit. Weights held in
  half precision are stored as held: nothing is widened.

Light on purpose: pydantic only, so that params validate in a second; the kwargs for
`from_pretrained` are built in rlhf.models.loading.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf.params import InputError, StageConfig

# transformers' own attention implementations (ALL_ATTENTION_FUNCTIONS and the eager path);
# a Hub kernel is named `owner/repo` (optionally `:function`).
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
_HUB_KERNEL = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")
# What each implementation needs installed: (import name, pip package).
ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (FlashAttention 3, Hopper GPUs)"),
}
HALF = ("bfloat16", "float16")


class QuantizationSettings(StageConfig):
    """bitsandbytes quantization of the loaded weights (`BitsAndBytesConfig`)."""

    bits: Literal[4, 8] = Field(4, description="4 (QLoRA: NF4 or FP4) or 8 (LLM.int8)")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (NF4: QLoRA's)")
    double_quant: bool = Field(True, description="4-bit: quantize the quantization constants too (QLoRA)")
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="4-bit: dtype of the dequantized matmuls (auto: compute.dtype)"
    )
    quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] | None = Field(
        None, description="4-bit: storage dtype (bfloat16 lets FSDP shard a QLoRA base; null: uint8)"
    )

    @model_validator(mode="after")
    def _four_bit_keys(self):
        if self.bits == 8:
            fields = type(self).model_fields
            changed = [
                key
                for key in ("quant_type", "double_quant", "compute_dtype", "quant_storage")
                if getattr(self, key) != fields[key].get_default()
            ]
            if changed:
                raise ValueError(f"{', '.join(changed)}: read for 4-bit quantization only; remove for bits 8")
        return self


def _check_attention(value: str) -> str:
    if value not in ATTENTION and not _HUB_KERNEL.match(value):
        raise ValueError(
            f"unknown attention implementation {value!r}; use one of {', '.join(ATTENTION)}, or a Hub kernel "
            "such as kernels-community/flash-attn"
        )
    return value


class ModelSettings(StageConfig):
    """params `model`: how every stage loads weights (a stage's own `model:` block overrides keys)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="weights' dtype at load (auto: compute.dtype for inference and LoRA/QLoRA bases, float32 "
        "master weights for full fine-tuning; bfloat16: pure bf16 training too)",
    )
    attn_implementation: str = Field(
        "sdpa", description="sdpa | eager | flash_attention_2 | flash_attention_3 | flex_attention | a Hub kernel"
    )
    quantization: QuantizationSettings | None = Field(
        None, description="4- or 8-bit weights through bitsandbytes (QLoRA when training: needs lora.enabled)"
    )
    kernels: Literal["auto", "liger", "none"] = Field(
        "auto", description="training's layer kernels: auto (Liger's on a CUDA GPU where installed) | liger | none"
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward: less memory")
    save_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="dtype of the weights a stage saves (auto: computing in half precision, float32 master "
        "weights of a bfloat16/float16 checkpoint go back to its dtype; on a CPU, as held)",
    )

    @field_validator("attn_implementation")
    @classmethod
    def _attention(cls, value: str) -> str:
        return _check_attention(value)

    def merged(self, override: ModelOverride | None) -> ModelSettings:
        """These settings with the keys `override` sets replaced."""
        if override is None:
            return self
        updates = {key: getattr(override, key) for key in override.model_fields_set}
        if "quantization" in updates and isinstance(updates["quantization"], bool):
            updates["quantization"] = None  # `quantization: false` switches a global setting off here
        return self.model_copy(update=updates)


class ModelOverride(StageConfig):
    """A stage's `model:` block: the keys of params `model` it sets differently."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(None, description="as model.dtype")
    attn_implementation: str | None = Field(None, description="as model.attn_implementation")
    quantization: QuantizationSettings | Literal[False] | None = Field(
        None, description="as model.quantization; false: not quantized here"
    )
    kernels: Literal["auto", "liger", "none"] | None = Field(None, description="as model.kernels")
    gradient_checkpointing: bool | None = Field(None, description="as model.gradient_checkpointing")
    save_dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(
        None, description="as model.save_dtype"
    )

    @field_validator("attn_implementation")
    @classmethod
    def _attention(cls, value):
        return value if value is None else _check_attention(value)


class MissingPackageError(InputError, ImportError):
    """params ask for what a package that is not installed provides."""


class KernelsError(InputError, ValueError):
    """params `model.kernels` asks for kernels this process's device cannot run."""


def liger_kernels(settings: ModelSettings, device: str, installed: bool | None = None, key: str = "model") -> bool:
    """Whether training on `device` (a torch device string, rlhf.models.compute) applies
    Liger's kernels, as `settings.kernels` says (see the module docstring). `installed`:
    whether liger-kernel is (found by import spec when None). `liger` on anything but a CUDA
    GPU fails naming `key`.kernels; a missing package is `package_problems`'."""
    if settings.kernels == "none":
        return False
    on_gpu = device.startswith("cuda")
    if settings.kernels == "liger":
        if not on_gpu:
            raise KernelsError(
                f"{key}.kernels: liger runs Triton kernels on a CUDA GPU, and this process computes on {device}; "
                f"set {key}.kernels: auto (Liger's on a GPU where installed) or none"
            )
        return True
    if installed is None:
        installed = importlib.util.find_spec("liger_kernel") is not None
    return on_gpu and installed


def kernels_key(override: ModelOverride | None, key: str | None) -> str:
    """The params key that set `kernels`: `<key>.model` where a block's own `model:` block
    (`override`) sets it, else the global `model`."""
    return f"{key}.model" if key and override is not None and "kernels" in override.model_fields_set else "model"


def package_problems(settings: ModelSettings, key: str = "model", kernels_at: str | None = None) -> list[str]:
    """What `settings` needs that is not installed, each naming `key` (the kernels
    `kernels_at` when given) and what to install (found by import spec, without importing:
    cheap enough for the params check)."""
    problems = []
    attention = settings.attn_implementation
    if attention in ATTENTION_PACKAGES:
        module, package = ATTENTION_PACKAGES[attention]
        if importlib.util.find_spec(module) is None:
            problems.append(
                f"{key}.attn_implementation: {attention} needs {package} (pip install {package.split()[0]}, on a "
                "CUDA GPU); or use sdpa"
            )
    elif attention not in ATTENTION and importlib.util.find_spec("kernels") is None:
        problems.append(
            f"{key}.attn_implementation: the Hub kernel {attention} needs `pip install kernels`; or use sdpa"
        )
    if settings.kernels == "liger" and importlib.util.find_spec("liger_kernel") is None:
        problems.append(
            f"{kernels_at or key}.kernels: liger needs liger-kernel (pip install 'rlhf-pipeline[gpu]', or pip install "
            "liger-kernel; a CUDA GPU); or set it to auto"
        )
    if settings.quantization is not None and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(
            f"{key}.quantization: {settings.quantization.bits}-bit loading needs bitsandbytes "
            "(pip install 'rlhf-pipeline[quant]', or pip install bitsandbytes); or set it to null"
        )
    return problems


_current: ModelSettings | None = None


def configure(
    settings: ModelSettings | None,
    override: ModelOverride | None = None,
    device: str | None = None,
    key: str | None = None,
) -> ModelSettings:
    """Set this process's model settings (a stage calls it once, from params: the global
    section with its own block's overrides, `key` that block's params key). Missing packages
    fail here, before compute, as do kernels `device` (this process's, when given) cannot
    run, named where they were set; settings that fail are not kept."""
    global _current
    chosen = (settings or ModelSettings()).merged(override)
    where = kernels_key(override, key)
    problems = package_problems(chosen, kernels_at=where)
    if chosen.quantization is not None and not problems:
        try:  # installed is not usable: a build without this machine's backend fails on import
            import bitsandbytes  # noqa: F401
        except Exception as error:
            problems.append(
                f"model.quantization: bitsandbytes is installed but does not load here ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); reinstall it for this machine, or set "
                "model.quantization: null"
            )
    if problems:
        raise MissingPackageError("; ".join(problems))
    if device is not None:
        liger_kernels(chosen, device, key=where)  # `kernels: liger` where it cannot run: refused
    _current = chosen
    return _current


def current() -> ModelSettings:
    """This process's model settings: the configured ones, else the defaults."""
    return _current if _current is not None else ModelSettings()


def weights_dtype(settings: ModelSettings, compute_dtype: str, training: bool, adapters: bool) -> str:
    """The dtype name to load weights in: `settings.dtype` when set; with `auto`, float32
    master weights for full fine-tuning, else (inference, a LoRA/QLoRA base) the compute
    dtype. See the module docstring."""
    if settings.dtype != "auto":
        return settings.dtype
    if training and not adapters and settings.quantization is None:
        return "float32"
    return compute_dtype
