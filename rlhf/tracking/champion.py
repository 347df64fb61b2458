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
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from rlhf.artifacts import atomic_dir
from rlhf.params import InputError

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
    version. The weights are loaded in float32, as they were saved; `trust_remote_code`
    allows a model with its own modelling code (as evaluate loaded it)."""
    import mlflow
    import torch
    import transformers
    from mlflow.tracking import MlflowClient

    from rlhf.models.folders import resolve_model_dir

    path = str(resolve_model_dir(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, use_safetensors=True, trust_remote_code=trust_remote_code
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
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


def set_champion_alias(client, registered_model: str, version: str) -> None:
    client.set_registered_model_alias(registered_model, CHAMPION_ALIAS, version)


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


@contextmanager
def moving_champion(
    client, registered_model: str, version: str, champion_dir: Path, expected: RegistryChampion | None = None
) -> Iterator[Path]:
    """An atomic_dir for `champion_dir` that also moves the registry alias to `version`:
    the alias moves after the caller has filled the staging folder (a failure before leaves
    both as they were), and moves back if putting the folder in place then fails. With
    `expected` (the registry's champion the caller decided against), a registry whose
    champion or pin has changed since (another clone promoted or rolled back meanwhile:
    logging a model takes seconds) raises `ChampionMovedError` before the alias moves,
    leaving both as they were."""
    previous = registry_champion(client, registered_model).version if expected is None else expected.version
    moved = False
    try:
        with atomic_dir(champion_dir) as staging:
            yield staging
            now = registry_champion(client, registered_model)
            if expected is not None and (now.version, now.pin) != (expected.version, expected.pin):
                raise ChampionMovedError(
                    f"the registry's champion of {registered_model!r} moved while this ran (version "
                    f"{expected.version} -> {now.version}{f', pinned: {now.pin}' if now.pin else ''}): version "
                    f"{version} was registered but neither the alias nor {champion_dir} moved; `python -m "
                    f"stages.rollback --sync` brings {champion_dir} to the registry's champion"
                )
            set_champion_alias(client, registered_model, version)
            moved = True
    except BaseException:
        # Moved back only while the alias still names `version` (another clone may have
        # moved it since: its move stands).
        if moved and registry_champion(client, registered_model).version == str(version):
            if previous is not None:
                set_champion_alias(client, registered_model, previous)
            else:
                client.delete_registered_model_alias(registered_model, CHAMPION_ALIAS)
        raise


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
