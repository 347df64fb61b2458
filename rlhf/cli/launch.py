"""Start a training stage in one process or in several: `python -m rlhf.cli.launch MODULE [ARGS]`.

dvc.yaml runs the training stages through this, so that params.yaml `compute` decides
how they start without a change to dvc.yaml:

* `launcher: python` (the default): `python -m MODULE ARGS`, one process;
* `launcher: torchrun, processes: N`: `torchrun --standalone --nproc_per_node N -m MODULE
  ARGS`, N data-parallel processes on this machine (gloo on CPUs, NCCL on GPUs);
* `launcher: accelerate, processes: N`: `accelerate launch --config_file
  compute.accelerate_config --num_processes N -m MODULE ARGS`, e.g. with one of the
  DeepSpeed ZeRO or FSDP configs in configs/accelerate/ (GPU only); without one,
  configs/accelerate/ddp.yaml (plain data parallelism), never the user's own default
  accelerate config, which the run would not show.

Data-parallel training keeps the global batch at `per_device_train_batch_size x processes
x gradient_accumulation_steps`: halve the per-device batch when you double the processes
to train on the same batches. The stages are rank-aware (rlhf.models.compute.is_main):
every process trains; rank 0 alone writes the outputs, metrics and curves and holds the
MLflow run. PPO, our own loop, shares its batch across the processes the same way
(rlhf/training/ppo.py). A stage not in MULTI_PROCESS starts as one process, with a line
that says so.

The launch replaces this process (exec), so DVC sees the launcher's exit status.
"""

from __future__ import annotations

import os
import sys

DEFAULT_ACCELERATE_CONFIG = "configs/accelerate/ddp.yaml"  # plain data parallelism (gloo without a GPU)
MULTI_PROCESS = {"stages.sft", "stages.verifier", "stages.policy", "stages.rl", "stages.rm", "stages.prm"}


def command(module: str, args: list[str], config) -> list[str]:
    """The command that starts `module` with `args` as `config` (a ComputeConfig) says."""
    single = [sys.executable, "-m", module, *args]
    if config.launcher == "python" or config.processes == 1:
        return single
    if module not in MULTI_PROCESS:
        print(
            f"rlhf.cli.launch: {module} trains in one process (compute.processes={config.processes} is not used by it)"
        )
        return single
    if config.launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.processes}",
            "-m", module, *args,
        ]  # fmt: skip
    # Always a config file: without one accelerate reads the user's own default config
    # (~/.cache/huggingface/accelerate), or, with none there, starts one process on a
    # machine without a GPU whatever --num_processes says.
    config_file = config.accelerate_config or DEFAULT_ACCELERATE_CONFIG
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
        "--num_processes", str(config.processes), "-m", module, *args,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from rlhf.models.compute import ComputeConfig
    from rlhf.params import input_errors_exit, load_section

    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: rlhf launch MODULE [ARGS] (python -m rlhf.cli.launch MODULE [ARGS]), e.g. rlhf launch stages.sft"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return
    if not argv or argv[0].startswith("-"):
        raise SystemExit(usage)
    with input_errors_exit("launch: "):  # the rest of the file: the stage validates it, first thing
        config = load_section("compute", ComputeConfig)
    cmd = command(argv[0], argv[1:], config)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
