"""Recipes for real models: params overlays in configs/recipes/, merged into params.yaml.

A recipe is a params.yaml fragment: the sections and keys a real model, its data and its
hardware need (the model, the data files, LoRA or QLoRA, batch sizes, lengths, TRL options),
with comments that say what it is for and the GPU memory it needs. Applying one merges it
into params.yaml key by key (a mapping into the mapping it meets, anything else replacing
what was there), keeping the file's other keys and comments, so that DVC sees the recipe as
what it is, a change of params:

    python -m rlhf.recipes list
    python -m rlhf.recipes apply qwen2.5-0.5b-gsm8k      # or a path to a recipe file
    dvc exp run -n qwen-gsm8k                          # or dvc repro; each stage reruns as its params changed

The merged file is validated (every section, and what the params need of each other)
before it replaces params.yaml; a recipe that does not validate leaves params.yaml as it
was and says why. What this machine lacks (a GPU, bitsandbytes, vLLM) is stage
check_params's to say, where the stages run.

Our own because no library applies a params overlay to a DVC params file: DVC's `-S`
sets one key at a time, and Hydra composes configs that DVC then does not see as params.
"""

from __future__ import annotations

import argparse
import difflib
import io
import subprocess
import sys
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent.parent / "configs" / "recipes"
PARAMS = Path("params.yaml")


def recipe_path(name: str) -> Path:
    """The recipe file `name` names: a path, or a name in configs/recipes/ (with or without .yaml)."""
    given = Path(name)
    if given.is_file():
        return given
    found = RECIPES_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if found.is_file():
        return found
    known = ", ".join(recipe_names())
    raise SystemExit(f"recipes: no recipe {name!r} (a file, or one of {known})")


def recipe_names() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def merge(base, overlay):
    """`overlay` merged into `base` (in place, and returned): mappings key by key, anything
    else replacing what was there."""
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


def merged_text(params_text: str, recipe_text: str) -> str:
    """params.yaml's text with the recipe merged in, its comments and key order kept
    (ruamel.yaml's round trip)."""
    import yaml
    from ruamel.yaml import YAML

    round_trip = YAML()
    round_trip.preserve_quotes = True
    round_trip.width = 120
    # null stays `null` (ruamel writes an empty value by default)
    round_trip.representer.add_representer(
        type(None), lambda dumper, _: dumper.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    params = round_trip.load(params_text) or {}
    merge(params, yaml.safe_load(recipe_text) or {})
    out = io.StringIO()
    round_trip.dump(params, out)
    return out.getvalue()


def describe(path: Path) -> str:
    """A recipe's first comment paragraph (what it is for)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    return " ".join(line for line in lines if line).split(". ")[0]


def validation_problem(params_file: Path) -> str | None:
    """Why `params_file` does not validate (the stages' whole-file check, run in a process of
    its own: the stages are not this library's to import), or None."""
    code = (
        "import sys, stages\n"
        "try:\n    stages.load_all(sys.argv[1])\n"
        "except stages.ParamsError as error:\n    print(error)\n    sys.exit(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(params_file)], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return done.stdout.strip() or done.stderr.strip()


def apply(name: str, params_file: Path = PARAMS, dry_run: bool = False) -> str:
    """Merge the recipe `name` into `params_file` (validated first); returns the diff."""
    path = recipe_path(name)
    before = params_file.read_text()
    after = merged_text(before, path.read_text())
    diff = "".join(
        difflib.unified_diff(
            before.splitlines(True), after.splitlines(True), str(params_file), f"{params_file} + {path.name}"
        )
    )
    if dry_run:
        return diff
    staged = params_file.with_name(f".{params_file.name}.recipe")
    staged.write_text(after)
    try:
        if problem := validation_problem(staged):
            problem = problem.replace(str(staged), str(params_file), 1)
            raise SystemExit(
                f"recipes: {path.name} merged into {params_file} does not validate; nothing changed.\n{problem}"
            )
        staged.replace(params_file)
    finally:
        staged.unlink(missing_ok=True)
    return diff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf recipes", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the recipes in configs/recipes/")
    show = commands.add_parser("apply", help="merge a recipe into params.yaml")
    show.add_argument("recipe", help="a recipe name (configs/recipes/<name>.yaml) or file")
    show.add_argument("--params", type=Path, default=PARAMS, help="the params file (default: params.yaml)")
    show.add_argument("--dry-run", action="store_true", help="print the change, write nothing")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in recipe_names():
            print(f"{name:40s} {describe(recipe_path(name))}")
        return
    diff = apply(args.recipe, args.params, args.dry_run)
    print(diff or "recipes: params.yaml already holds this recipe")
    if not args.dry_run and diff:
        print(
            f"recipes: {args.params} updated; run `dvc repro` or `dvc exp run` (stage check_params checks this machine)"
        )


if __name__ == "__main__":
    main()
