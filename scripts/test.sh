#!/usr/bin/env bash
# Set up the environment and run the whole test suite (slow end-to-end tests included).
# Extra arguments go to pytest (e.g. -m "not slow" for the quick ones).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
