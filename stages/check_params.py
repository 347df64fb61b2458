"""Stage `check_params`: validate the whole of params.yaml before any other stage runs.

In:  params.yaml, the stage Configs (stages/) and the task's (rlhf/tasks/); the eval
     suites' files that prepare.files names (their `difficulty` column).
Out: reports/params.ok — a stamp whose content never changes.

Every other stage depends on the stamp, so `dvc repro` runs this check first whenever
params.yaml or a Config changed, and a typo, a wrong type or an out-of-range value stops the
run in under a second with one message naming every bad key — before DVC removes any
stage's outputs to rerun it. Because the stamp's content is constant, passing the check
never invalidates the stages after it: only their own params do. It imports no torch
(unless compute.device names a device or compute.processes is above 1: torch then says
whether this machine has the device, and a GPU for each process) and
logs nothing to MLflow (each stage logs its own resolved section), which keeps it fast.

A section left out of params.yaml takes its Config's defaults in Python, but DVC refuses to
run a stage whose params are missing from the file (after the stages before it ran): every
key dvc.yaml's stages list must be in the file, and a missing one is named here with what
to write (`verifier: {}` takes the defaults).

It also reads the `difficulty` column of the eval suites that come from local files
(prepare.files.eval_<suite>), so that a gate or round test at a difficulty the suite lacks
stops here too. It reruns when a file under data/raw changes; a suite file kept elsewhere
is checked again by the round that reads it (before sampling), and by the gate. With
lm-evaluation-harness tasks named (evaluate.harness), it looks them up in lm-eval's task
index (about 10 s, lm-eval imported: only then), so that a misspelt task stops here and not
in stage evaluate after every policy has trained; a suite run as a harness task must hold
text prompts (read from its file, as above). Under an accelerate config that shards the
weights (FSDP, ZeRO-3), a stage that would train a LoRA adapter or the likelihood reward
model (which the sharded save cannot gather) is named here, not after its training.

    python -m stages.check_params
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rlhf.atomic import atomic_file
from rlhf.params import PARAMS_FILE, ParamsError, read_params
from stages import REPORTS_DIR, generated_difficulties, load_all, run_facts

STAMP = REPORTS_DIR / "params.ok"


def main() -> None:
    params = load_all()
    # Suites from the user's files: the difficulties a gate or round test names, read from
    # the file (load_all checks the built-in suites without reading any file).
    run = run_facts(params, lambda suite: suite_difficulties(params, suite))
    problems = list(dict.fromkeys(params["gate"].difficulty_problems(run) + params["improve"].difficulty_problems(run)))
    problems += harness_problems(params)
    problems += listed_params_problems(read_params(PARAMS_FILE), params)
    problems += package_problems(params)  # this machine's packages (attention, bitsandbytes, vLLM, lm-eval)
    problems += sharding_problems(params)
    problems += template_problems(params)
    compute = params["compute"]
    if compute.device not in ("auto", "cpu") or compute.processes > 1:  # torch imported only then
        from rlhf.models.compute import placement_problem

        problems += [problem] if (problem := placement_problem(compute)) else []
    if problems:
        raise ParamsError(PARAMS_FILE, problems)
    with atomic_file(STAMP) as tmp:
        tmp.write_text("params.yaml is valid\n")
    print("check_params: params.yaml is valid")


def suite_file(params: dict, suite: str):
    """The problems of a suite that come from a local file (prepare.files.eval_<suite>), read
    from that file; None for a suite with no such file, a Hub dataset, or a file that does
    not read (prepare names its problems)."""
    from rlhf.data.contracts import DataValidationError, load_contract

    spec = params["prepare"].files.get(f"eval_{suite}")
    if spec is None or not Path(spec.path).exists():
        return None
    try:
        return load_contract(spec.path, "prompts", spec.columns, split=spec.split, config=spec.config)
    except (DataValidationError, OSError, ValueError):
        return None


def suite_difficulties(params: dict, suite: str) -> set[str] | None:
    """The difficulties of a suite whose problems come from a local file (`suite_file`, with
    the built-in task's when source is builtin); None where no such file reads."""
    from rlhf.evaluation.suites import table_difficulties

    frame = suite_file(params, suite)
    if frame is None:
        return None
    return table_difficulties(frame) | (generated_difficulties(params["prepare"], suite) or set())


def package_problems(params: dict) -> list[str]:
    """What the params need installed on this machine that is not (found without importing
    it): the attention implementation's and quantization's packages (params `model` and the
    stages' own blocks), vLLM for an online method that generates with it, lm-eval for
    evaluate.harness. This stage asks (this machine's), not the params validation."""
    from rlhf.models.settings import package_problems as loading_problems
    from rlhf.rules import model_blocks

    base = params["model"]
    problems = loading_problems(base)
    for key, block in model_blocks(params):
        own = getattr(block, "model", None)
        if own is not None:
            problems += [p for p in loading_problems(base.merged(own), f"{key}.model") if p not in problems]
        if getattr(block, "trl", {}).get("use_vllm") and importlib.util.find_spec("vllm") is None:
            problems.append(
                f"{key}.trl.use_vllm: TRL generates with vLLM, which is not installed: pip install vllm (a CUDA "
                "machine; TRL's supported versions), or remove use_vllm"
            )
    if params["evaluate"].harness and importlib.util.find_spec("lm_eval") is None:
        problems.append(
            "evaluate.harness: needs lm-evaluation-harness, which is not installed: pip install "
            "'rlhf-pipeline[harness]' (or lm-eval), or set evaluate.harness: null"
        )
    return problems


def listed_params(dvc: dict, data: dict) -> dict[str, list[str]]:
    """Per stage of dvc.yaml (a foreach stage once per item of its list or mapping in
    `data`, the raw params), the params keys it lists, `${item}`/`${key}` filled in."""
    listed: dict[str, list[str]] = {}
    for name, stage in (dvc.get("stages") or {}).items():
        keys = [key for key in stage.get("do", stage).get("params", []) if isinstance(key, str)]
        if "foreach" not in stage:
            listed[name] = keys
            continue
        group = lookup(data, str(stage["foreach"]).removeprefix("${").removesuffix("}"))
        items = group.items() if isinstance(group, dict) else enumerate(group) if isinstance(group, list) else []
        for key, item in items:
            filled = [k.replace("${key}", str(key)).replace("${item}", str(item)) for k in keys]
            listed[f"{name}@{item if isinstance(group, list) else key}"] = [k for k in filled if "${" not in k]
    return listed


_MISSING = object()


def lookup(data, dotted: str):
    """The value at a dotted key of nested mappings, or `_MISSING`."""
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


def listed_params_problems(data: dict, params: dict, dvc_file: str = "dvc.yaml") -> list[str]:
    """Keys dvc.yaml's stages read from params.yaml that the file lacks. A section left out
    takes its defaults here, but DVC refuses to run a stage whose params are missing
    (`Parameters 'verifier' are missing from 'params.yaml'`, after the stages before it have
    run): named here, with the default value to write."""
    import yaml

    path = Path(dvc_file)
    if not path.is_file():
        return []
    dvc = yaml.safe_load(path.read_text()) or {}
    missing: dict[str, list[str]] = {}
    for stage, keys in listed_params(dvc, data).items():
        for key in keys:
            if lookup(data, key) is _MISSING:
                missing.setdefault(key, []).append(stage)
    problems = []
    for key, stages in missing.items():
        section, _, rest = key.partition(".")
        default = lookup(params[section].model_dump(mode="json"), rest) if rest and section in params else _MISSING
        name = key.rsplit(".", 1)[-1]
        if default is _MISSING or isinstance(default, dict):
            write = f"`{name}: {{}}` to take the defaults"
        else:
            write = f"`{name}: {json.dumps(default)}` (its default)"
        problems.append(
            f"{key}: missing, and {dvc_file}'s stage {', '.join(stages)} reads it: DVC refuses to run a stage whose "
            f"params are missing from {PARAMS_FILE}; write {write}"
        )
    return problems


def sharded_config(path: str | None) -> str | None:
    """The strategy an accelerate config names when it shards the weights (FSDP, DeepSpeed
    ZeRO-3), else None."""
    import yaml

    if path is None:  # launcher accelerate without a config: configs/accelerate/ddp.yaml
        return None
    config = yaml.safe_load(Path(path).read_text()) or {}
    if config.get("distributed_type") == "FSDP":
        return "FSDP"
    deepspeed = config.get("deepspeed_config") or {}
    if config.get("distributed_type") == "DEEPSPEED" and str(deepspeed.get("zero_stage")) == "3":
        return "DeepSpeed ZeRO-3"
    return None


def sharding_problems(params: dict) -> list[str]:
    """Under FSDP or ZeRO-3 the pipeline gathers and saves plain Hugging Face models only:
    a LoRA adapter, or the likelihood reward model (an LM with a head of ours), would fail
    at the end of its stage's training, after the model had loaded and trained. Each stage
    that would is named here, with its key. (PPO, our own loop, replicates its models on
    every process whatever the config says.) On a CPU neither strategy shards: accelerate's
    `AcceleratorState` turns a launch into FSDP or DeepSpeed only in its branch for
    accelerators (MULTI_GPU, NPU, XPU...), never for MULTI_CPU, so it is refused too."""
    compute = params["compute"]
    strategy = compute.launcher == "accelerate" and sharded_config(compute.accelerate_config)
    if not strategy:
        return []
    from rlhf.models.compute import resolve

    problems = []
    if resolve(compute).device == "cpu":
        problems.append(f"compute.accelerate_config: {strategy} ({compute.accelerate_config}) shards the weights on GPUs "
                        "only: accelerate (1.15) chooses FSDP or DeepSpeed only when it launches on accelerators, and "
                        "a CPU launch runs as plain data parallelism, each process holding the whole model; use "
                        "configs/accelerate/ddp.yaml here")  # fmt: skip
    trained = {"sft": params["sft"], "verifier": params["verifier"], "rm": params["rm"], "prm": params["prm"]}
    policy = params["policy"]
    trained |= {f"policy.{m}": getattr(policy, m) for m in [*policy.offline, *policy.online] if m != "ppo"}
    for key, config in trained.items():
        if key == "prm" and config.kind == "likelihood":
            continue  # fitted by rank 0 alone, nothing sharded
        if getattr(getattr(config, "lora", None), "enabled", False):
            problems.append(f"{key}.lora.enabled: {strategy} (compute.accelerate_config {compute.accelerate_config}) "
                            "saves plain models only, not a LoRA adapter; train it in full, or use "
                            "configs/accelerate/ddp.yaml or deepspeed_zero2.yaml")  # fmt: skip
        if key == "rm" and config.kind == "likelihood":
            problems.append(f"rm.kind: likelihood under {strategy} (compute.accelerate_config "
                            f"{compute.accelerate_config}): the likelihood reward model is not a plain model the "
                            "sharded save can gather; set rm.kind: classifier, or use configs/accelerate/ddp.yaml "
                            "or deepspeed_zero2.yaml")  # fmt: skip
    return problems


def template_problems(params: dict) -> list[str]:
    """`sft.loss_on: completion` on conversations trains the assistant's turns through the
    chat template's {% generation %} markers, which the template must have or TRL must be
    able to add (Llama 3.1's and Mistral's it cannot). Checked here where both are known
    without a download: the base model is a local folder with its own template (none put on
    by `base.chat_template`) and the SFT rows come from a local file whose first row is a
    conversation; stage sft checks the rest before its model loads."""
    base, spec = params["base"], params["prepare"].files.get("sft")
    if params["sft"].loss_on != "completion" or base.chat_template is not None or spec is None:
        return []
    if not (Path(str(base.model)) / "tokenizer_config.json").is_file() or not Path(spec.path).exists():
        return []
    from rlhf.data.contracts import mapped_columns
    from rlhf.data.readers import read_batches

    try:
        first = next(read_batches(spec.path, split=spec.split, config=spec.config, batch_rows=1))
    except (OSError, ValueError, StopIteration):
        return []  # prepare names what is wrong with the file
    first = mapped_columns(first, spec.columns or {})
    conversation = "messages" in first or any(
        isinstance(first[c].iloc[0], list) for c in ("prompt", "completion") if c in first
    )
    if not conversation:
        return []
    from rlhf.models.loading import load_tokenizer  # transformers, torch: only for a local template to read
    from rlhf.training.methods.sft import SFTDataError, check_assistant_masking

    try:
        check_assistant_masking(load_tokenizer(base.model, base.trust_remote_code), "sft", Path(str(base.model)))
    except SFTDataError as error:
        return [f"{error} (or set base.chat_template to one with the markers, e.g. llama3 for Llama 3.x)"]
    return []


def harness_problems(params: dict) -> list[str]:
    """Harness tasks lm-eval does not know (its registry, evaluate.harness.include_path),
    and harness suites whose file holds conversations (a suite task feeds text prompts)."""
    harness = params["evaluate"].harness
    if harness is None:
        return []
    problems = []
    if harness.tasks and importlib.util.find_spec("lm_eval") is not None:  # else package_problems says so
        from rlhf.evaluation.harness import check_tasks

        try:
            check_tasks(harness.tasks, harness.include_path)
        except (ValueError, FileNotFoundError) as error:
            problems.append(f"evaluate.harness.tasks: {error}")
    for suite in harness.suites:
        frame = suite_file(params, suite)
        if frame is not None and len(frame) and not isinstance(frame["prompt"].iloc[0], str):
            problems.append(
                f"evaluate.harness.suites: suite {suite!r} holds conversations; a suite task feeds text prompts "
                "only (evaluate scores this suite itself): leave it out of harness.suites"
            )
    return problems


if __name__ == "__main__":
    import argparse

    # No options: `rlhf check --help` (or a stray argument) must answer, not run the check.
    argparse.ArgumentParser(
        prog="rlhf check", description=__doc__.split("\n\n")[0], epilog="Run in the project (where params.yaml is)."
    ).parse_args()
    main()
