"""The documentation site: it builds with `mkdocs build --strict` (no broken link, no page
left out of the nav), and its params reference is generated from the Configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

REPO = Path(__file__).resolve().parents[1]


def test_a_key_added_to_a_config_appears_in_the_params_reference():
    import stages
    from rlhf.params_docs import params_reference
    from stages.sft import Config

    class WithNewKey(Config):
        warmup_ratio_new: float = Field(0.03, description="share of steps spent warming up <the new key>")

    configs = {**stages.all_configs(), "sft": WithNewKey}
    page = params_reference(configs)
    row = next(line for line in page.splitlines() if "`sft.warmup_ratio_new`" in line)
    assert "| float | `0.03` | share of steps spent warming up &lt;the new key> |" in row
    assert "`sft.lora.r`" in page and "`gate.tests`" in page, "nested and every section's keys"
    assert "warmup_ratio_new" not in params_reference(stages.all_configs())


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    params = (tmp_path / "site/reference/params/index.html").read_text()
    assert "sft.max_steps" in params and "policy.dpo.beta" in params
    assert "rlhf rollback" in (tmp_path / "site/reference/cli/index.html").read_text()
    assert not (tmp_path / "site/hooks.py").exists()
