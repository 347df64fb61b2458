"""The `rlhf` command: one entry point for what users run by hand.

    rlhf run [--jobs 2] [--serve | --deploy] ...   the pipeline (Prefect flow over dvc repro)
    rlhf check                                     validate params.yaml (and the data it names)
    rlhf status                                    what is stale, the champion, the last verdict
    rlhf rollback --list | --version N | --unpin | --sync
    rlhf label [--port 8765] ...                   the labelling page (human feedback pairs)
    rlhf generate --model models/champion "2+3"    sample from a saved model
    rlhf recipes list | apply <name>               params overlays for real models
    rlhf launch stages.sft                         a stage in the processes params `compute` asks
    rlhf dvc-deps [--check]                        dvc.yaml's code deps from the stages' imports

Each subcommand is the module it names below with its own options (`rlhf <command>
--help`); dvc.yaml runs the stages as `python -m stages.<name>`, through
`python -m rlhf.cli.launch` where a stage may train in several processes.

The commands read the project's folders from rlhf/layout.py and the params keys they need
with the library's own Configs (`rlhf.params.load_section`); `run` and `check` start the
flow and the params check as programs of their own. Like the rest of `rlhf`, this package
never imports `stages` or `flows`, and nothing in `rlhf` imports `rlhf.cli`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

# name -> (module with a main(argv), one line of help)
COMMANDS = {
    "run": ("flows.pipeline", "run the pipeline: the Prefect flow over `dvc repro` (serve or deploy it on a schedule)"),
    "check": ("stages.check_params", "validate params.yaml and the data files it names, before any compute"),
    "status": ("rlhf.cli", "what `dvc repro` would redo, the champion and its registry version, the last verdict"),
    "rollback": ("rlhf.cli.rollback", "list registry versions, move the champion back, unpin, or sync models/champion"),
    "label": ("rlhf.cli.label", "serve the labelling page: a person picks the better of two completions"),
    "generate": ("rlhf.inference.generate", "sample completions from a saved model"),
    "recipes": ("rlhf.recipes", "list or apply the params overlays for real models (configs/recipes)"),
    "launch": ("rlhf.cli.launch", "run a stage in as many processes as params `compute` says (what dvc.yaml runs)"),
    "dvc-deps": (
        "rlhf.cli.dvc_deps",
        "rewrite each dvc.yaml stage's code deps from its imports (--check: only compare)",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return (
        "usage: rlhf <command> [options]\n\ncommands:\n"
        + "\n".join(lines)
        + ("\n\n`rlhf <command> --help` shows a command's options.")
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rlhf: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    if name == "status":
        status(rest)
        return
    target = COMMANDS[name][0]
    if not target.startswith("rlhf."):
        # The flow and the params check are the project's own programs (flows/, stages/),
        # which the library never imports: they run as such, in place of this process.
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", target, *rest])
    module = importlib.import_module(target)
    sys.argv = [f"rlhf {name}", *rest]
    module.main(rest) if _takes_argv(module.main) else module.main()


def _takes_argv(function) -> bool:
    import inspect

    return bool(inspect.signature(function).parameters)


def status(argv: list[str]) -> None:
    """What is stale (`dvc status`), the champion and its registry version, the last
    gate's verdict, and any verdict MLflow still lacks: read from the project's files,
    nothing run."""
    import argparse

    parser = argparse.ArgumentParser(prog="rlhf status", description=status.__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    stale = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], capture_output=True, text=True)
    if stale.returncode != 0:
        print(f"stale: `dvc status` failed: {(stale.stderr or stale.stdout).strip().splitlines()[-1:]}")
    else:
        changed = sorted(json.loads(stale.stdout or "{}"))
        print("stale: nothing (dvc repro would run nothing)" if not changed else f"stale: {', '.join(changed)}")
    from rlhf.layout import CHAMPION_DIR, REPORTS_DIR, TRACKING_OWED_DIR
    from rlhf.tracking.champion import CHAMPION_RECORD

    record = CHAMPION_DIR / CHAMPION_RECORD
    if record.is_file():
        champion = json.loads(record.read_text())
        pinned = ", pinned" if champion.get("pinned") else ""
        version = champion.get("model_version")
        print(f"champion: {champion.get('candidate')} (registry version {version}{pinned})")
    else:
        print("champion: none yet (no gate has promoted a candidate)")
    verdict = REPORTS_DIR / "gate.json"
    if verdict.is_file():
        gate = json.loads(verdict.read_text())
        passed = [n for n, c in gate.get("candidates", {}).items() if c.get("passed")]
        outcome = f"promoted {gate['promote']}" if gate.get("promoted") else "promoted nothing"
        print(f"last verdict: {outcome}; passed: {', '.join(passed) or 'none'} (reports/gate.json)")
    else:
        print("last verdict: none (the gate has not run)")
    owed = sorted(TRACKING_OWED_DIR.glob("*.json"))
    if owed:
        runs = ", ".join(path.stem for path in owed)
        print(
            f"MLflow: the verdict of gate run(s) {runs} is not logged yet (its store did not answer); "
            "the next gate logs it"
        )
