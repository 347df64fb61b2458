"""Try one setting on dev before it goes into the recipe (docs/results/real-model.md, "Levers
tried on dev"): a copy of a finished seed's project, params.yaml edited, one stage rerun as
the flow runs it, and the model that stage writes scored on dev (greedy, as stage evaluate
scores) against the project's own models on the same problems. Nothing reads test.

    .venv/bin/python studies/real_model/dev_probe.py --project /tmp/rlhf-real-model/seed0/project \\
        --out /tmp/grpo40 --stage rl grpo --set policy.grpo.max_steps=40 --model models/policy/grpo

--project: a project studies/real_model/run.py has finished (its reports/outcomes.json holds
the dev outcomes of sft, dpo, grpo, merged and the instruct model). The stage runs with the
project's copy of the code, the scoring with this checkout's. The copy leaves out
MLflow's artifacts, checkpoints and caches; a copy whose stage has run already (--out holds
stage.done) is scored again, not retrained. Writes --out/result.json: the probe's dev
accuracy and its paired difference with each of the project's models.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from studies import scratch  # noqa: E402

LEFT_OUT = ("mlartifacts", "checkpoints", "cache", "dvc_plots")


def edit_params(work: Path, settings: list[str]) -> None:
    """The project's params.yaml with each `key.path=value` set (the key must exist: a typo
    fails here)."""
    import yaml

    def update(params: dict) -> None:
        for setting in settings:
            key, _, value = setting.partition("=")
            *parents, last = key.split(".")
            node = params
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict) or last not in node:
                raise SystemExit(f"dev_probe: --set {setting}: {key} is not a key of {work / 'params.yaml'}")
            scratch.set_key(params, key, yaml.safe_load(value))

    scratch.edit_params(work, update)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", nargs="+", required=True, help="the stage module and its argument: rl grpo")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model", type=Path, required=True, help="the folder the stage writes, in the project")
    parser.add_argument("--suite", default="dev")
    args = parser.parse_args(argv)
    if args.suite.startswith("test"):
        raise SystemExit("dev_probe: a probe chooses a setting; it reads dev, never a test suite")
    work = (args.out / "project").resolve()
    done = args.out / "stage.done"
    if not done.is_file():
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(args.project, work, ignore=shutil.ignore_patterns(*LEFT_OUT))
        edit_params(work, args.set)
        env = scratch.enter(work)
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", f"stages.{args.stage[0]}", *args.stage[1:]], cwd=work, env=env, check=True
        )
        done.write_text(json.dumps({"seconds": round(time.monotonic() - started, 1), "set": args.set}))
    else:
        os.chdir(work)
    from rlhf.evaluation.statistics import paired_difference
    from rlhf.tasks import get_task
    from rlhf.training.round_gate import evaluate_models
    from stages import load_all
    from stages.improve import EVALUATED_AGAINST

    params = load_all()
    scored = evaluate_models(
        params["evaluate"], get_task(params["task"]), {"probe": args.model}, [args.suite], **EVALUATED_AGAINST
    )["probe"][args.suite]
    accuracy = scored["outcomes"]["accuracy"]
    recorded = json.loads(Path("reports/outcomes.json").read_text())["suites"][args.suite]["models"]
    result = {
        "set": args.set,
        "stage": args.stage,
        "training_seconds": json.loads(done.read_text())["seconds"],
        f"{args.suite}_accuracy": sum(accuracy) / len(accuracy),
        "recorded": {name: sum(m["accuracy"]) / len(m["accuracy"]) for name, m in recorded.items()},
        "probe_minus": {name: paired_difference(accuracy, m["accuracy"]) for name, m in recorded.items()},
        "by_family": scored["metrics"].get("accuracy_by_difficulty"),
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
