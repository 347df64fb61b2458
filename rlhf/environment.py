"""Process environment for every entry point: no telemetry, quiet threads.

Nothing may phone home: with no internet a telemetry call would only add timeouts. The
Hugging Face Hub is not switched off: a user who names a Hub model or dataset id gets it
downloaded (and cached) when online, and the default pipeline never asks the Hub for
anything. Offline mode is the user's choice (`HF_HUB_OFFLINE=1`); when it is set, a Hub id
that is not in the local cache fails with a message that names it and says what to do.
Values already set by the user win (`setdefault`).

Some libraries read their settings when they are imported (Prefect builds its settings
context then), and an import sorter may put `import prefect` above `import rlhf`: a
setting made here after Prefect was imported is handed to Prefect by refreshing its global
settings context, so the environment takes effect whatever the import order.
"""

from __future__ import annotations

import logging
import os

QUIET_ENV = {
    # Hugging Face: no telemetry, no update checks.
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
    # A tracking server that has gone away: MLflow's defaults (7 retries with exponential
    # backoff, 120 s per request) hold a write up for minutes; the training stages write
    # synchronously and stop writing after one failure (rlhf.tracking.runs).
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


# Loggers of other packages that repeat a warning in every stage's log without news for
# the user: bitsandbytes, imported by peft and transformers whenever it is installed, warns
# at import on a CPU that an optional 4-bit matmul kernel (the `kernels` package) is
# missing; its own CPU path serves without it (tests/test_model_loading.py trains QLoRA).
QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def configure_environment() -> None:
    added = [key for key in QUIET_ENV if key not in os.environ]
    for key in added:
        os.environ[key] = QUIET_ENV[key]
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if any(key.startswith("PREFECT_") for key in added):
        refresh_prefect_settings()


def refresh_prefect_settings() -> None:
    """Make an already imported Prefect read the environment again: it built its global
    settings context at import, before these settings were made (a flow would then wait
    the default 20 s for its ephemeral server, not 120). Nothing when Prefect is not
    imported yet: it reads the environment when it is."""
    import sys

    context = sys.modules.get("prefect.context")
    if context is None or not hasattr(context, "GLOBAL_SETTINGS_CONTEXT"):
        return
    refresh = getattr(context, "refresh_global_settings_context", None)
    if refresh is not None:
        refresh()
    else:  # Prefect before 3.5 has no refresh function; the same, by hand
        context.GLOBAL_SETTINGS_CONTEXT = context.root_settings_context()


def hub_offline() -> bool:
    """Whether the user switched the Hugging Face Hub off."""
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    )
