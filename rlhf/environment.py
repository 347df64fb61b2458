"""Process environment for every entry point: offline hubs, no telemetry, quiet threads.

Nothing here may be downloaded at run time and nothing may phone home: with no internet a
telemetry call would only add timeouts. Values already set by the user win (`setdefault`),
so `HF_HUB_OFFLINE=0` still works for someone who wants the hub.
"""

from __future__ import annotations

import os

OFFLINE_ENV = {
    # Hugging Face: no hub look-ups, no telemetry.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    # Telemetry of Prefect, MLflow and DVC.
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    # Prefect's ephemeral server can take 15-20 s to start on a fresh database.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # Tokenizers fork warnings under DVC/Prefect subprocesses.
    "TOKENIZERS_PARALLELISM": "false",
    # MLflow's git-based run source detection is slow and noisy outside a clean repo.
    "GIT_PYTHON_REFRESH": "quiet",
}


def configure_offline_environment() -> None:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
