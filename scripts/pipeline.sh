#!/usr/bin/env bash
# Set up the environment and run the default pipeline end to end: the Prefect flow runs
# every dvc.yaml stage through `dvc repro` and logs to MLflow (sqlite:///mlflow.db).
# Extra arguments go to `python -m flows.pipeline` (e.g. --force sft).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m flows.pipeline "$@"
