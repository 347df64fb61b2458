"""The champion: the model the gate last promoted, on disk and in the MLflow registry.

Promotion writes the champion folder atomically (a copy of the candidate plus
champion.json, the record the next gate compares against) and then moves the registry
alias ``champion`` to a new model version holding the candidate's weights. The caller names
the folder; the alias moves last, so until the folder is in place the registry still
points at the old champion.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHAMPION_RECORD = "champion.json"
CHAMPION_ALIAS = "champion"


def read_champion(champion_dir: Path) -> dict | None:
    record = champion_dir / CHAMPION_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def install_champion(model_dir: Path, record: dict, staging: Path) -> None:
    """Fill `staging` (an atomic_dir for models/champion) with the model and its record."""
    shutil.copytree(model_dir, staging, dirs_exist_ok=True)
    (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def create_version(client, registered_model: str, run_id: str, artifact_path: str, tags: dict) -> str:
    """A new registry version from the model logged under `artifact_path` of the run."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(registered_model)
    except MlflowException:
        client.create_registered_model(registered_model, description="Models promoted by the capability gate")
    run = client.get_run(run_id)
    version = client.create_model_version(
        registered_model, source=f"{run.info.artifact_uri}/{artifact_path}", run_id=run_id, tags=tags
    )
    return str(version.version)


def set_champion_alias(client, registered_model: str, version: str) -> None:
    client.set_registered_model_alias(registered_model, CHAMPION_ALIAS, version)
