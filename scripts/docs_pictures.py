"""Refresh the pictures of README.md and the documentation site.

    python scripts/docs_pictures.py              # the DAG picture only (from dvc.yaml)
    python scripts/docs_pictures.py --screens    # and the screenshots, from a run of this project

The DAG: `dvc dag --mermaid`, without check_params (every stage depends on it), written
between the `<!-- dag -->` and `<!-- /dag -->` markers of docs/concepts/dag.md; the
site and GitHub draw it (README links to it).

The screenshots (`--screens`, after `bash scripts/pipeline.sh`): `python -m tests.ui_check`
runs the flow against a Prefect and an MLflow server on 127.0.0.1 and photographs the flow
run's graph (headless Chromium); the MLflow UI's runs of the project's experiment are
photographed too (mlflow-runs.png). DVC's plots page is not: it draws with Vega from a CDN,
which a machine without internet cannot load. They are written to docs/images/.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "docs/concepts/dag.md",)
IMAGES = ROOT / "docs/images"


def dag_mermaid() -> str:
    """`dvc dag --mermaid` without check_params and its edges."""
    text = subprocess.run(
        [sys.executable, "-m", "dvc", "dag", "--mermaid"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    lines = text.strip().splitlines()
    node = next((re.match(r"\s*(node\d+)\[", line).group(1) for line in lines if '"check_params"' in line), None)
    kept = [line for line in lines if node is None or not re.search(rf"\b{node}\b", line)]
    return "```mermaid\n" + "\n".join(line.replace("\t", "    ") for line in kept) + "\n```"


def write_dag() -> None:
    block = dag_mermaid()
    for page in PAGES:
        text = page.read_text()
        new, count = re.subn(r"<!-- dag -->.*?<!-- /dag -->", f"<!-- dag -->\n{block}\n<!-- /dag -->", text,
                             flags=re.S)  # fmt: skip
        if not count:
            raise SystemExit(f"{page}: no <!-- dag --> ... <!-- /dag --> markers")
        page.write_text(new)
        print(f"{page.relative_to(ROOT)}: DAG picture written")


def screenshot(url: str, out: Path, wait: float = 8.0) -> None:
    """A headless Chromium's picture of `url`, after `wait` seconds for its scripts."""
    import time

    from tests.browser import headless_chromium

    with tempfile.TemporaryDirectory() as profile:
        browser = headless_chromium(profile, 1600, 900)
        try:
            browser.get(url)
            time.sleep(wait)
            browser.save_screenshot(str(out))
        finally:
            browser.quit()


def mlflow_runs(out: Path) -> None:
    """The project's experiment in the MLflow UI, on its runs: `mlflow server` on the
    project's store (mlflow.db), the experiment page in the UI's model-training view
    (`?workflowType=machine_learning`: MLflow 3.17 opens the GenAI view otherwise)."""
    import mlflow

    from tests.servers import mlflow_server

    server, uri = mlflow_server(ROOT / "mlflow.db")
    try:
        mlflow.set_tracking_uri(uri)
        experiment = mlflow.get_experiment_by_name("rlhf-pipeline")
        url = f"{uri}/#/experiments/{experiment.experiment_id}?workflowType=machine_learning"
        screenshot(url, out)
    finally:
        server.terminate()
        server.wait(timeout=30)


def write_screens() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ui"
        subprocess.run([sys.executable, "-m", "tests.ui_check", "--out", str(out)], cwd=ROOT, check=True)
        shutil.copy2(out / "prefect-flow-run.png", IMAGES / "prefect-flow-run.png")
    mlflow_runs(IMAGES / "mlflow-runs.png")
    print(f"screenshots: {', '.join(p.name for p in sorted(IMAGES.glob('*.png')))} in {IMAGES.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screens", action="store_true", help="also the screenshots (runs tests.ui_check)")
    args = parser.parse_args()
    write_dag()
    if args.screens:
        write_screens()


if __name__ == "__main__":
    main()
