"""The studies' queued experiments (studies/sweep.py) run in a scratch DVC project made from
this checkout: a study's own stage runs its driver there, so the driver must import from
what the project holds, and the project's params must be the study's and valid."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from studies import sweep

pytestmark = pytest.mark.slow  # a git and DVC project a test (seconds each)

STUDIES_WITH_A_STAGE = ("studies/seed_spread/run.py", "studies/curriculum/run.py")


@pytest.mark.parametrize("driver", STUDIES_WITH_A_STAGE)
def test_a_studys_own_stage_imports_in_its_scratch_project(tmp_path, driver):
    """`python <driver> --help` in the project, with nothing of this checkout on the path."""
    root = sweep.project(tmp_path, "study", lambda params: None, files=[driver])
    env = {k: v for k, v in sweep.environment(1).items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, driver, "--help"], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True)
    assert status.stdout == "", "the project is committed: `dvc exp run --queue` takes what git holds"


def test_the_curriculums_project_holds_its_rounds_and_passes_the_params_check(tmp_path):
    from studies.curriculum import run as curriculum

    root = curriculum.scratch_project(tmp_path)
    params = yaml.safe_load((root / "params.yaml").read_text())
    rounds = params["improve"]["rounds"]
    assert list(rounds) == ["r1", "r2", "r3"]
    assert [r["after"] for r in rounds.values()] == ["sft", "rounds/r1", "rounds/r2"]
    assert rounds["r3"]["progress_difficulty"] == [8]
    assert params["improve"]["defaults"]["prompts"] == 4096
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert stages["score"]["deps"][0] == curriculum.HERE and "models/rounds/r3" in stages["score"]["deps"]
    env = sweep.environment(1)
    check = subprocess.run([sys.executable, "-m", "stages.check_params"], cwd=root, env=env, capture_output=True,
                           text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


@pytest.mark.parametrize("overlay", ["configs/recipes/tiny-long-context.yaml", "studies/compression/smollm2.yaml"])
def test_the_compression_studys_settings_merge_into_params_and_pass_the_params_check(tmp_path, overlay):
    """The study's project params: params.yaml with `--recipe` merged in as `rlhf recipes
    apply` merges (the built-in model's recipe, or the real model's study settings)."""
    import stages
    from studies.compression import run as compression

    params = yaml.safe_load((sweep.ROOT / "params.yaml").read_text())
    compression.recipe(sweep.ROOT / overlay)(params)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    loaded = stages.load_all(str(tmp_path / "params.yaml"))
    settings = yaml.safe_load((sweep.ROOT / overlay).read_text())
    assert loaded["base"].model == settings["base"]["model"]
    assert loaded["prepare"].word_problems.context_chars == settings["prepare"]["word_problems"]["context_chars"]
    assert loaded["compress"].select == settings["compress"].get("select", 0)
    assert loaded["compress"].enabled and loaded["evaluate"].window == settings["evaluate"].get("window")
