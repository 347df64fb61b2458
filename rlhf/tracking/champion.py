"""The champion: the model the gate last promoted, on disk and in the MLflow registry.

Promotion writes the champion folder atomically (a copy of the candidate plus
champion.json, the record the next gate compares against) and then moves the registry
alias ``champion`` to a new model version. The version is an MLflow transformers model
(`mlflow.transformers.log_model`, text-generation), so from any directory

    mlflow.transformers.load_model("models:/rlhf-policy@champion")

gives a pipeline with the champion's weights and tokenizer; the record is logged beside it
in the gate's run (`champion.json`). The caller names the folder; the alias moves as the
last step before the folder is put in place, and moves back if that fails
(`moving_champion`): the registry and the folder name the same version, or both the old one.

Rollback (`restore_version`) is promotion backwards: an earlier version's weights,
tokenizer and record become models/champion (atomically) and the alias moves to it. It
pins the champion in the registry too (tag `rlhf.pinned` of the registered model), so that
every clone's gate holds back while it is pinned, not only the clone that rolled back.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from pydantic import Field, field_validator

from rlhf.atomic import write_json
from rlhf.params import InputError, StageConfig

CHAMPION_RECORD = "champion.json"
CHAMPION_ALIAS = "champion"
PIN_TAG = "rlhf.pinned"  # on the registered model: why the champion may not move
# Where mlflow.transformers keeps the parts of a logged model.
MODEL_BINARY = "model"
TOKENIZER_PART = "components/tokenizer"


def read_champion(champion_dir: Path) -> dict | None:
    record = champion_dir / CHAMPION_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def install_champion(model_dir: Path, record: dict, staging: Path) -> None:
    """Fill `staging` (an atomic_dir for models/champion) with the model and its record."""
    shutil.copytree(model_dir, staging, dirs_exist_ok=True)
    (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def log_registered_model(
    model_dir: Path, registered_model: str, artifact_path: str, tags: dict, trust_remote_code: bool = False
) -> str:
    """Log the causal LM in `model_dir` to the active run as an MLflow transformers model
    (text-generation) and register it as a new version of `registered_model`; returns the
    version.

    The weights load in the dtype they were stored in (`dtype="auto"`): a float32 file is
    mapped, not copied, and a bfloat16 one is registered as bfloat16, not widened to twice
    its size. A model with its own modelling code (config.json `auto_map`) runs that code
    wherever it is loaded from the registry, so it is registered only with
    `trust_remote_code` (gate.trust_remote_code)."""
    import mlflow
    import torch
    import transformers
    from mlflow.tracking import MlflowClient

    from rlhf.models.folders import resolve_model_dir

    path = resolve_model_dir(model_dir)
    if not trust_remote_code and own_code(path):
        raise ValueError(
            f"{path} holds its own modelling code (config.json auto_map), which runs wherever the champion is "
            "loaded from the registry: set gate.trust_remote_code: true in params.yaml to register it"
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype="auto", use_safetensors=True, trust_remote_code=trust_remote_code
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    info = mlflow.transformers.log_model(
        transformers_model={"model": model, "tokenizer": tokenizer},
        name=artifact_path,
        task="text-generation",
        registered_model_name=registered_model,
        # Given, not inferred: inference imports and times every package of the process.
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"],
    )
    version = str(info.registered_model_version)
    client = MlflowClient()
    for key, value in tags.items():
        client.set_model_version_tag(registered_model, version, key, str(value))
    return version


def own_code(model_dir: Path) -> bool:
    """Whether the model in `model_dir` names its own modelling code (config.json `auto_map`)."""
    config = model_dir / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("auto_map"))


def set_champion_alias(client, registered_model: str, version: str) -> None:
    client.set_registered_model_alias(registered_model, CHAMPION_ALIAS, version)


class RegistryParams(StageConfig):
    """The registry keys of params `gate` (stage gate's Config extends it): what `rlhf
    rollback` reads of the section."""

    registered_model: str = Field("rlhf-policy", description="MLflow registered model that holds the champion")

    @field_validator("registered_model")
    @classmethod
    def _a_name_mlflow_takes(cls, value: str) -> str:
        # MLflow's rule for registered model names (mlflow.utils.validation), written out
        # here so that params validate without importing mlflow: it failed at promotion.
        if not value.strip() or any(c in value for c in "/:'\""):
            raise ValueError(
                f"{value!r}: a registered model name is not empty and holds no '/' or ':' (MLflow's rule) nor "
                "quotes (the rollback command searches the registry by name)"
            )
        return value


class RegistryChampion(NamedTuple):
    """The registry's champion: the version its alias names, the registry's pin, and the
    run that logged that version (the gate run whose record models/champion holds when the
    folder is that champion: version numbers alone repeat across tracking stores). None
    where there is none (nothing registered or promoted yet, not pinned)."""

    version: str | None
    pin: str | None
    run_id: str | None = None


class ChampionMovedError(InputError, RuntimeError):
    """The registry's champion moved (another clone promoted, rolled back or pinned) while
    this process was about to move it."""


def registry_champion(client, registered_model: str) -> RegistryChampion:
    """The registry's champion of `registered_model` (`RegistryChampion`)."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(registered_model)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return RegistryChampion(None, None)
        raise
    version = (model.aliases or {}).get(CHAMPION_ALIAS)
    pin = (model.tags or {}).get(PIN_TAG)
    if version is None:
        return RegistryChampion(None, pin)
    return RegistryChampion(str(version), pin, client.get_model_version(registered_model, str(version)).run_id)


def set_pin(client, registered_model: str, pin: str | None) -> None:
    """Pin the registry's champion with the reason `pin`, or clear the pin (None)."""
    if pin is None:
        client.delete_registered_model_tag(registered_model, PIN_TAG)
    else:
        client.set_registered_model_tag(registered_model, PIN_TAG, pin)


class Recovered(NamedTuple):
    """What `recover_move` did with a move that a killed process left: `finished` (the
    folder and the alias are `version`) or not (undone: both stay at `version`, the one
    before), and a sentence that says so."""

    finished: bool
    version: str | None
    message: str


def move_dir(champion_dir: Path) -> Path:
    """Where a move of `champion_dir` works: its staging folder (the new champion, filled
    before anything moves), its intent record, the previous folder while it is replaced."""
    return champion_dir.with_name(f".{champion_dir.name}-move")


INTENT = "intent.json"
KEEP_PIN = object()  # `moving_champion(pin=)`: the registry's pin stays as it is


@contextmanager
def moving_champion(
    client,
    registered_model: str,
    version: str,
    champion_dir: Path,
    expected: RegistryChampion | None = None,
    pin=KEEP_PIN,
) -> Iterator[Path]:
    """A staging folder to fill with the new champion; after the block, `champion_dir` and
    the registry alias move to `version` together, or neither does.

    The two stores cannot move in one step, so the move is journaled: once the staging
    folder is full, an intent record (from which version to which, the pin before and
    after) is written beside it, and only then do the registry's pin (`pin`, a rollback's;
    set before the alias), the alias and the folder move, in that order. An exception
    undoes what moved; a process killed midway leaves the record, and the next gate,
    rollback or `--sync` (`recover_move`) finishes the move or undoes it and says which.

    With `expected` (the registry's champion the caller decided against), a registry whose
    champion or pin has changed since (another clone promoted or rolled back meanwhile:
    logging a model takes seconds) raises `ChampionMovedError` before anything moves."""
    recovered = recover_move(client, registered_model, champion_dir)
    if recovered is not None:
        print(f"champion: {recovered.message}")
    work = move_dir(champion_dir)
    staging = work / "staging"
    staging.mkdir(parents=True)
    try:
        yield staging
        now = registry_champion(client, registered_model)
        if expected is not None and (now.version, now.pin) != (expected.version, expected.pin):
            raise ChampionMovedError(
                f"the registry's champion of {registered_model!r} moved while this ran (version "
                f"{expected.version} -> {now.version}{f', pinned: {now.pin}' if now.pin else ''}): version "
                f"{version} was registered but neither the alias nor {champion_dir} moved; `rlhf rollback --sync` "
                f"brings {champion_dir} to the registry's champion"
            )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    intent = {
        "registered_model": registered_model,
        "from_version": now.version,
        "to_version": str(version),
        "from_pin": now.pin,
        "to_pin": now.pin if pin is KEEP_PIN else pin,
    }
    write_json(work / INTENT, intent)
    try:
        _move_forward(client, intent, champion_dir)
    except BaseException:
        _undo_move(client, intent, champion_dir)
        raise


def _move_forward(client, intent: dict, champion_dir: Path) -> None:
    """The journaled move's steps, each one safe to repeat after a kill at any point."""
    work, name = move_dir(champion_dir), intent["registered_model"]
    if intent["to_pin"] != intent["from_pin"]:
        set_pin(client, name, intent["to_pin"])  # before the alias: no clone promotes over a rollback
    set_champion_alias(client, name, intent["to_version"])
    staging, previous = work / "staging", work / "previous"
    if staging.is_dir():
        if champion_dir.exists():
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(champion_dir, previous)
        os.replace(staging, champion_dir)
    shutil.rmtree(work, ignore_errors=True)


def _undo_move(client, intent: dict, champion_dir: Path) -> None:
    """Put back what a move changed: the previous folder, the alias and the pin (each only
    while it is still the move's: another clone's later move stands)."""
    work, name = move_dir(champion_dir), intent["registered_model"]
    previous = work / "previous"
    if previous.is_dir():
        if champion_dir.exists():
            os.replace(champion_dir, work / "undone")
        os.replace(previous, champion_dir)
    now = registry_champion(client, name)
    if now.version == intent["to_version"]:
        if intent["from_version"] is not None:
            set_champion_alias(client, name, intent["from_version"])
        else:
            client.delete_registered_model_alias(name, CHAMPION_ALIAS)
    if intent["to_pin"] != intent["from_pin"] and now.pin == intent["to_pin"]:
        set_pin(client, name, intent["from_pin"])
    shutil.rmtree(work, ignore_errors=True)


def recover_move(client, registered_model: str, champion_dir: Path) -> Recovered | None:
    """Finish or undo a move of the champion that a killed process left (`moving_champion`);
    None when there is none. A staging folder without an intent record is removed (nothing
    had moved). With a record, the move is finished (pin, alias, folder) unless the
    registry's champion is by now a third version (another clone moved it since): then it
    is undone, and the folder and the alias stay where that left them."""
    work = move_dir(champion_dir)
    if not work.exists():
        return None
    record = work / INTENT
    if not record.is_file():
        shutil.rmtree(work, ignore_errors=True)
        return Recovered(False, None, f"removed the staging folder of a move that had not started ({work})")
    intent = json.loads(record.read_text())
    before, after = intent["from_version"], intent["to_version"]
    now = registry_champion(client, intent["registered_model"]).version
    if now in (before, after):
        _move_forward(client, intent, champion_dir)
        return Recovered(
            True,
            after,
            f"finished an interrupted move of the champion from version {before} to version {after}: "
            f"{champion_dir} and the registry alias are version {after}",
        )
    _undo_move(client, intent, champion_dir)
    return Recovered(
        False,
        before,
        f"undid an interrupted move of the champion from version {before} to version {after} (the registry's "
        f"champion is version {now} by now: another clone moved it); `rlhf rollback --sync` brings {champion_dir} "
        "to it",
    )


def restore_version(client, registered_model: str, version: str, staging: Path) -> dict:
    """Fill `staging` (an atomic_dir for models/champion) with registry version `version`:
    its weights and tokenizer as a plain model folder, and the champion record its gate
    run logged. Returns the record."""
    import tempfile

    from mlflow.artifacts import download_artifacts

    entry = client.get_model_version(registered_model, version)
    with tempfile.TemporaryDirectory() as scratch:
        logged = Path(download_artifacts(artifact_uri=f"models:/{registered_model}/{version}", dst_path=scratch))
        record_file = download_artifacts(run_id=entry.run_id, artifact_path=CHAMPION_RECORD, dst_path=scratch)
        record = json.loads(Path(record_file).read_text())
        for part in (MODEL_BINARY, TOKENIZER_PART):
            for file in (logged / part).iterdir():
                shutil.copy2(file, staging / file.name)
    (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record
