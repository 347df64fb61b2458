#!/usr/bin/env bash
# Set up the environment and run the whole test suite (slow end-to-end tests included).
# Extra arguments go to pytest (e.g. -m "not slow" for the quick ones, -n 0 for one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# Two pytest workers (pytest-xdist; RLHF_TEST_WORKERS=N for more), each torch process on one
# thread: the tests' tiny models gain nothing from a second thread, and two processes that
# each spin two threads on two cores slow each other several times over. Whole modules go to
# the workers in the order tests/conftest.py collects them, longest first
# (--no-loadscope-reorder: xdist would otherwise put the modules with most tests first,
# and the few-test modules that take minutes last, where one worker runs them alone).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
# No test compiles a model, but bitsandbytes (imported by peft, which TRL imports) wraps its
# kernels in torch.compile when it is imported, which loads dynamo and inductor: importing
# TRL's SFTTrainer and MLflow took 9.5 s with dynamo off against 11.4 s (measured here), and
# every stage process of the DAG tests pays it. With dynamo off, torch.compile returns the
# function as it is. The pipeline itself (scripts/pipeline.sh) leaves it on.
export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"
exec .venv/bin/python -m pytest -n "${RLHF_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
