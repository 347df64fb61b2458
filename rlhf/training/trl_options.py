"""The `trl:` mapping of a training block: any option of the method's TRL config, passed to
it unchanged, checked before any compute.

A key must be a field of the block's config class (`DPOConfig`, `GRPOConfig`, ...: its
`TRL_CONFIG`); a key the block sets from its own params (`beta`, `learning_rate`...) is
refused with the block's key to set instead, and so is one the pipeline owns (where
checkpoints go, tracking, seeds, precision, how the model loads: `OWNED`).

The params check must stay fast (about a second), and importing TRL takes seconds. So the
fields of every config class are kept in `trl_fields.json`, written by

    python -m rlhf.training.trl_options

from the installed TRL and transformers, whose versions it records. When the installed
versions are the recorded ones (read from the package metadata, without an import), the
check reads the file; otherwise it imports the config class and reads its fields. A test
keeps the file equal to the installed TRL's fields.

The option's value is checked when the stage builds the config, before the model loads
(`build_config`): TRL's own checks then fail naming the block's key.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from importlib import metadata
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("trl_fields.json")
# Where each config class lives (the import that the fallback and the snapshot use).
CONFIG_MODULES = {
    "TrainingArguments": "transformers",
    "SFTConfig": "trl",
    "DPOConfig": "trl",
    "KTOConfig": "trl",
    "GRPOConfig": "trl",
    "RLOOConfig": "trl",
    "RewardConfig": "trl",
    "CPOConfig": "trl.experimental.cpo",
    "ORPOConfig": "trl.experimental.orpo",
}
# Options the pipeline sets itself, with where a user sets what they decide.
OWNED = {
    "output_dir": "checkpoints go to checkpoints/<stage>/<fingerprint>/, where a killed stage resumes",
    "overwrite_output_dir": "checkpoints go to checkpoints/<stage>/<fingerprint>/, where a killed stage resumes",
    "resume_from_checkpoint": "a stage resumes from its newest whole checkpoint by itself",
    "logging_dir": "curves go to MLflow and plots/ (rlhf.training.trainer_setup.MLflowMetrics)",
    "report_to": "curves go to MLflow and plots/ (rlhf.training.trainer_setup.MLflowMetrics)",
    "run_name": "each stage names its own MLflow run",
    "use_cpu": "set compute.device",
    "bf16": "set compute.dtype (mixed precision) or model.dtype (the weights)",
    "fp16": "set compute.dtype (mixed precision) or model.dtype (the weights)",
    "model_init_kwargs": "set the params section `model` (dtype, attn_implementation, quantization)",
    "gradient_checkpointing": "set model.gradient_checkpointing",
    "activation_checkpointing": "set model.gradient_checkpointing",
    "trust_remote_code": "set the stage's trust_remote_code",
    "push_to_hub": "models are published by DVC and the MLflow registry",
    "hub_model_id": "models are published by DVC and the MLflow registry",
    "hub_token": "models are published by DVC and the MLflow registry",
}


def installed_versions() -> dict[str, str | None]:
    """The installed TRL's and transformers' versions, from their metadata (no import)."""
    versions = {}
    for package in ("trl", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


@cache
def snapshot() -> dict:
    try:
        return json.loads(SNAPSHOT.read_text())
    except (OSError, ValueError):
        return {}


def imported_fields(name: str) -> list[str]:
    """The fields of config class `name`, imported."""
    import dataclasses
    import importlib

    return sorted(
        field.name for field in dataclasses.fields(getattr(importlib.import_module(CONFIG_MODULES[name]), name))
    )


@cache
def config_fields(name: str) -> frozenset[str]:
    """The fields of TRL config class `name`: from trl_fields.json when it was written from
    the installed versions, else imported."""
    recorded = snapshot()
    if recorded.get("versions") == installed_versions() and name in recorded.get("configs", {}):
        return frozenset(recorded["configs"][name])
    return frozenset(imported_fields(name))


@cache
def owned_by_block(block: type) -> dict:
    """The TRL options a params block sets from its own keys, with their default values (a
    block's `trl_args` gives every key whatever the values)."""
    return block().trl_args()


def trl_problems(block: type, options: dict) -> list[str]:
    """What is wrong with the `trl:` mapping `options` of a params block of class `block`
    (a TrainingParams subclass), one message per key; empty when nothing is."""
    if not options:
        return []
    config = block.TRL_CONFIG
    if config is None:
        return [f"{', '.join(map(str, options))}: this trainer is the pipeline's own, with no TRL config; remove trl"]
    own = owned_by_block(block)
    fields = config_fields(config)
    problems = []
    for key in options:
        if key in OWNED:
            problems.append(f"{key}: the pipeline sets it ({OWNED[key]}); remove it from trl")
        elif key in own and block.TRL_NAMES.get(key, key) is None:
            problems.append(f"{key}: the method fixes it ({own[key]!r}); remove it from trl")
        elif key in own:
            ours = block.TRL_NAMES.get(key, key)
            problems.append(f"{key}: set by this section's own key {ours!r}; set that instead of trl.{key}")
        elif key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            problems.append(f"{key}: not an option of TRL's {config}{hint}")
    return problems


def write_snapshot(path: Path = SNAPSHOT) -> dict:
    """trl_fields.json from the installed TRL and transformers."""
    recorded = {
        "versions": installed_versions(),
        "configs": {name: imported_fields(name) for name in CONFIG_MODULES},
    }
    path.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return recorded


if __name__ == "__main__":
    written = write_snapshot()
    print(f"{SNAPSHOT}: the fields of {len(written['configs'])} config classes, {written['versions']}")
