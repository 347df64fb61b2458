"""Where models run and in what precision: params.yaml `compute`.

One setting for every stage that runs a model, so that a user moves the whole pipeline to
a GPU, or to bfloat16, in one place:

* `device`: `auto` (a CUDA GPU when torch sees one, else Apple's MPS, else the CPU), or
  `cpu`, `cuda`, `cuda:<i>`, `mps`.
* `dtype`: `auto`, `bfloat16`, `float16` or `float32`. `auto` is float32 on the CPU (half
  precision is slow or unsupported there) and on a GPU bfloat16 where the GPU supports it,
  else float16. `bfloat16` on a CPU trains in bf16 autocast (worth it on CPUs with bf16
  instructions: AVX512-BF16, AMX).
* `launcher`, `processes`, `accelerate_config`: how the training stages start
  (rlhf.cli.launch): one process, or `processes` data-parallel ones under `torchrun` or
  `accelerate launch`. Rank 0 publishes (`is_main`): outputs, metrics, the MLflow run.

Inference (evaluate, infer, the reward models and PRM, the greedy soup) loads weights in
that dtype on that device. Training trains in mixed precision in that dtype (TRL's `bf16` /
`fp16` flags), over float32 master weights when it trains a model in full (params `model`,
rlhf.models.settings, says in which dtype each kind of weights loads).

The stage process sets the default once (`configure`) from its validated params; library
functions read it (`current`) unless a caller passes its own. Light on purpose: torch is
imported only when a setting is resolved.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf.params import InputError, StageConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


LAUNCHERS = ("python", "torchrun", "accelerate")


class ComputeConfig(StageConfig):
    device: str = Field("auto", description="auto | cpu | cuda | cuda:<i> | mps (auto: a GPU when present)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="inference weights, training mixed precision (auto: float32 on CPU, bf16/fp16 on GPU)"
    )
    launcher: Literal["python", "torchrun", "accelerate"] = Field(
        "python", description="how training stages start (rlhf.cli.launch): one process, or `processes` of them"
    )
    processes: int = Field(1, ge=1, description="training processes on this machine (torchrun / accelerate launch)")
    accelerate_config: str | None = Field(
        None,
        description="accelerate config file for launcher accelerate (configs/accelerate/: DeepSpeed, FSDP; GPU); "
        "null: configs/accelerate/ddp.yaml",
    )

    @model_validator(mode="after")
    def _check_launcher(self):
        if self.launcher == "python" and self.processes > 1:
            raise ValueError("processes > 1 needs launcher torchrun or accelerate (python starts one process)")
        if self.accelerate_config is not None:
            if self.launcher != "accelerate":
                raise ValueError("accelerate_config: read only with launcher accelerate; remove it")
            if not Path(self.accelerate_config).is_file():
                raise ValueError(f"accelerate_config: {self.accelerate_config} does not exist")
        return self

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"unknown device {value!r}; use auto, cpu, cuda, cuda:<i> or mps")
        return value


@dataclass(frozen=True)
class Placement:
    """A resolved setting: a torch device string and dtype name."""

    device: str
    dtype: str

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def training_precision(self) -> dict[str, bool]:
        """TRL/transformers flags for mixed-precision training in this dtype."""
        return {"bf16": self.dtype == "bfloat16", "fp16": self.dtype == "float16"}


class DeviceError(InputError, RuntimeError):
    """compute.device names a device this machine does not have."""


def placement_problem(config: ComputeConfig) -> str | None:
    """Why `config`'s device, or its processes on the GPUs, cannot be used on this machine,
    or None (torch imported: stage check_params asks only when a device is named or
    several processes are)."""
    import torch

    if problem := device_problem(config.device):
        return problem
    on_gpus = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if config.processes > 1 and on_gpus and config.processes > torch.cuda.device_count():
        return (
            f"compute.processes is {config.processes} but torch sees {torch.cuda.device_count()} CUDA GPU(s): one "
            "process per GPU (lower compute.processes)"
        )
    return None


def device_problem(device: str) -> str | None:
    """Why `device` (compute.device) cannot be used here, or None."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"compute.device is {device!r} but torch sees no CUDA GPU; use compute.device: auto or cpu"
    if device.startswith("cuda:") and int(device.split(":")[1]) >= torch.cuda.device_count():
        return f"compute.device is {device!r} but torch sees {torch.cuda.device_count()} CUDA GPU(s), from cuda:0"
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        return "compute.device is 'mps' but torch sees no MPS device; use compute.device: auto or cpu"
    return None


def resolve(config: ComputeConfig | None = None) -> Placement:
    """The device and dtype `config` means on this machine; a device that is named but not
    present is an error that says so."""
    import torch

    config = config or ComputeConfig()
    device = config.device
    if device == "auto":
        if torch.cuda.is_available():
            device = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            device = "mps"
        else:
            device = "cpu"
    elif problem := device_problem(device):
        raise DeviceError(problem)
    dtype = config.dtype
    if dtype == "auto":
        if device == "cpu":
            dtype = "float32"
        elif device.startswith("cuda") and torch.cuda.is_bf16_supported():
            dtype = "bfloat16"
        else:
            dtype = "float16"
    return Placement(device, dtype)


_current: Placement | None = None


def configure(config: ComputeConfig | None) -> Placement:
    """Set this process's placement (a stage calls it once, from params). In a
    multi-process launch on GPUs, "cuda" then means this process's own GPU (LOCAL_RANK), so
    what a stage puts on "cuda" itself (reward models, PPO's models) lands beside what the
    trainer places there."""
    global _current
    _current = resolve(config)
    if _current.device == "cuda" and world_size() > 1:
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return _current


def current() -> Placement:
    """This process's placement: the configured one, else `auto` resolved."""
    global _current
    if _current is None:
        _current = resolve(None)
    return _current


def rank() -> int:
    """This process's rank among the training processes (torchrun / accelerate launch set
    RANK); 0 when there is one process."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """How many training processes this launch has (WORLD_SIZE); 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def sharded_launch() -> bool:
    """Whether `accelerate launch` started this process under a strategy that shards the
    weights (FSDP, DeepSpeed ZeRO-3): a model it trains is loaded on the CPU and left
    there, for accelerate to shard (its launcher says so in the environment)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return True
    return (
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    )


def is_main() -> bool:
    """The process that publishes: writes outputs, metrics and the MLflow run."""
    return rank() == 0


def freeze_startup_objects() -> None:
    """Move every object alive now out of the cyclic garbage collector's sight
    (`gc.freeze`), for a process that has imported its libraries and loaded no model yet.

    A full collection walks every tracked object: with torch, transformers and MLflow
    imported that is about 700,000 objects and 0.5 s a collection, and `release_memory`,
    the Trainer and accelerate each collect after a model (the reward-model and evaluate
    stages of the tiny project spent 5 s of their 20 in it). Imported modules live as long
    as the process, so the collector gains nothing by walking them. Models need no
    collector: reference counting frees them (tests/test_models.py). A stage's own process
    calls this (stages.load_model_stage); a library user's process is theirs to tune.
    """
    import gc

    gc.freeze()


def release_memory() -> None:
    """Give memory that Python and torch freed back to the system: between the parts of a
    stage that each load a model (the reward ensemble's members, then its evaluation), the
    process's resident memory would otherwise keep the high-water mark of the part before
    (glibc keeps freed heap pages; the CUDA allocator keeps its cache)."""
    import ctypes
    import gc
    import sys

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass
