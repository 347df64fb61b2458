"""Stage `check_params`: validate the whole of params.yaml before any other stage runs.

In:  params.yaml, the stage Configs (stages/) and the task's (rlhf/tasks/); the eval
     suites' files that prepare.files names (their `difficulty` column).
Out: reports/params.ok — a stamp whose content never changes.

Every other stage depends on the stamp, so `dvc repro` runs this check first whenever
params.yaml or a Config changed, and a typo, a wrong type or an out-of-range value stops the
run in about a second with one message naming every bad key — before DVC removes any
stage's outputs to rerun it. Because the stamp's content is constant, passing the check
never invalidates the stages after it: only their own params do. It imports no torch and
logs nothing to MLflow (each stage logs its own resolved section), which keeps it fast.

It also reads the `difficulty` column of the eval suites that come from local files
(prepare.files.eval_<suite>), so that a gate or round test at a difficulty the suite lacks
stops here too. It reruns when a file under data/raw changes; a suite file kept elsewhere
is checked again by the round that reads it (before sampling), and by the gate. With
lm-evaluation-harness tasks named (evaluate.harness), it looks them up in lm-eval's task
index (about 10 s, lm-eval imported: only then), so that a misspelt task stops here and not
in stage evaluate after every policy has trained; a suite run as a harness task must hold
text prompts (read from its file, as above).

    python -m stages.check_params
"""

from __future__ import annotations

from rlhf.artifacts import atomic_file
from rlhf.params import PARAMS_FILE, ParamsError
from stages import REPORTS_DIR, difficulty_problems, load_all, suite_difficulties, suite_file

STAMP = REPORTS_DIR / "params.ok"


def main() -> None:
    params = load_all()
    # Suites from the user's files: the difficulties a gate or round test names, read from
    # the file (load_all checks the built-in suites without reading any file).
    problems = difficulty_problems(params, lambda suite: suite_difficulties(params, suite))
    problems += harness_problems(params)
    if problems:
        raise ParamsError(PARAMS_FILE, problems)
    with atomic_file(STAMP) as tmp:
        tmp.write_text("params.yaml is valid\n")
    print("check_params: params.yaml is valid")


def harness_problems(params: dict) -> list[str]:
    """Harness tasks lm-eval does not know (its registry, evaluate.harness.include_path),
    and harness suites whose file holds conversations (a suite task feeds text prompts)."""
    harness = params["evaluate"].harness
    if harness is None:
        return []
    problems = []
    if harness.tasks:
        from rlhf.evaluation.harness import check_tasks

        try:
            check_tasks(harness.tasks, harness.include_path)
        except (ValueError, FileNotFoundError) as error:
            problems.append(f"evaluate.harness.tasks: {error}")
    for suite in harness.suites:
        frame = suite_file(params, suite)
        if frame is not None and len(frame) and not isinstance(frame["prompt"].iloc[0], str):
            problems.append(
                f"evaluate.harness.suites: suite {suite!r} holds conversations; a suite task feeds text prompts "
                "only (evaluate scores this suite itself): leave it out of harness.suites"
            )
    return problems


if __name__ == "__main__":
    main()
