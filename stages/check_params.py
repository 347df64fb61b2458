"""Stage `check_params`: validate the whole of params.yaml before any other stage runs.

In:  params.yaml, the stage Configs (stages/) and the task's (rlhf/tasks/).
Out: reports/params.ok — a stamp whose content never changes.

Every other stage depends on the stamp, so `dvc repro` runs this check first whenever
params.yaml or a Config changed, and a typo, a wrong type or an out-of-range value stops the
run in about a second with one message naming every bad key — before DVC removes any
stage's outputs to rerun it. Because the stamp's content is constant, passing the check
never invalidates the stages after it: only their own params do. It imports no torch and
logs nothing to MLflow (each stage logs its own resolved section), which keeps it fast.

    python -m stages.check_params
"""

from __future__ import annotations

from rlhf.artifacts import atomic_file
from stages import REPORTS_DIR, load_all

STAMP = REPORTS_DIR / "params.ok"


def main() -> None:
    load_all()
    with atomic_file(STAMP) as tmp:
        tmp.write_text("params.yaml is valid\n")
    print("check_params: params.yaml is valid")


if __name__ == "__main__":
    main()
