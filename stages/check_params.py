"""Stage `check_params`: validate the whole of params.yaml before any other stage runs.

In:  params.yaml, the stage Configs (stages/).
Out: reports/params.ok — a stamp whose content never changes; an MLflow run holding the
     whole resolved params.yaml (defaults filled in).

Every other stage depends on the stamp, so `dvc repro` runs this check first whenever
params.yaml or a Config changed, and a typo, a wrong type or an out-of-range value stops the
run in seconds with one message naming every bad key — before DVC removes any stage's
outputs to rerun it. Because the stamp's content is constant, passing the check never
invalidates the stages after it: only their own params do.

    python -m stages.check_params
"""

from __future__ import annotations

from pathlib import Path

from rlhf.artifacts import atomic_file
from rlhf.tracking import stage_run
from stages import load_all

STAMP = Path("reports/params.ok")


def main() -> None:
    configs = load_all()
    # The run records the whole resolved params.yaml, defaults filled in, once per change.
    resolved = {name: config.model_dump(mode="json") for name, config in configs.items()}
    with stage_run("check_params", resolved), atomic_file(STAMP) as tmp:
        tmp.write_text("params.yaml is valid\n")
    print("check_params: params.yaml is valid")


if __name__ == "__main__":
    main()
