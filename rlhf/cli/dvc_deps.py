"""`rlhf dvc-deps`: each dvc.yaml stage's code deps, computed from its imports.

    rlhf dvc-deps            # rewrite the rlhf/ deps of every stage in dvc.yaml
    rlhf dvc-deps --check    # exit 1, naming each stage whose deps differ, and change nothing

A stage reruns when its code changes only if dvc.yaml lists the code: its module, the stage
modules it reuses, the launcher when dvc.yaml starts it through one, and every rlhf/ module
it imports, transitively (lazy imports inside functions included), except the
infrastructure that cannot change an output (INFRASTRUCTURE: the environment, params
validation, MLflow tracking; docstring-only package files). This command computes that set
from the source (Python's `ast`, nothing imported) and rewrites the `- rlhf/...` lines of
each stage's `deps`, keeping a listed folder whose every module the stage imports, and
every other line (comments, data deps, params) as written; the deps in reading order:
what the stage reads (data, models, configs) first, its code after them. The test suite checks that the
committed dvc.yaml is what this command writes (tests/test_project_shape.py).

Why our own: DVC has no notion of a Python import graph (its deps are paths), and the
import-graph tools on the package index (pydeps, modulegraph) draw or bundle rather than
answer "which files can change this stage's output"; the 100 lines here do that.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from functools import cache
from pathlib import Path

INFRASTRUCTURE = {"rlhf/__init__.py", "rlhf/environment.py", "rlhf/params.py", "rlhf/tracking/runs.py"}
LAUNCHER = "rlhf/cli/launch.py"  # what dvc.yaml starts a stage through where it may use several processes
COMMAND = re.compile(r"python -m (rlhf\.cli\.launch )?(stages\.\w+)")


def parsed(path: Path) -> ast.Module:
    """`path`'s syntax tree, parsed once for as long as the file is unchanged (every
    stage's closure walks the same modules; the tree must not be modified)."""
    stat = path.stat()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@cache
def _parsed(path: Path, mtime_ns: int, size: int) -> ast.Module:
    return ast.parse(path.read_text())


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    stat = path.stat()
    return set(_imported(path, stat.st_mtime_ns, stat.st_size))


@cache
def _imported(path: Path, mtime_ns: int, size: int) -> frozenset[str]:
    names = set()
    for node in ast.walk(_parsed(path, mtime_ns, size)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return frozenset(names)


def module_file(root: Path, name: str) -> Path | None:
    base = root / name.replace(".", "/")
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    return None


def docstring_only(path: Path) -> bool:
    body = parsed(path).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def code_closure(root: Path, path: Path, packages: bool = False) -> set[str]:
    """rlhf/ and stages/ module files imported by `path`, transitively (the `stages`
    package itself, which validates params and names folders, excluded unless `packages`:
    what an import cycle is looked for in)."""
    seen: set[str] = set()
    todo = [path]
    prefixes = ("rlhf.", "stages.", *(("rlhf", "stages") if packages else ()))
    while todo:
        for name in imported_modules(todo.pop()):
            if name.startswith(prefixes) and (file := module_file(root, name)) is not None:
                rel = file.relative_to(root).as_posix()
                if rel not in seen:
                    seen.add(rel)
                    todo.append(file)
    return seen


def module_files(root: Path, dep: str) -> set[str]:
    """The module files a dep names: itself, or the modules of a listed folder."""
    path = root / dep
    if path.is_dir():
        return {
            p.relative_to(root).as_posix()
            for p in path.rglob("*.py")
            if p.relative_to(root).as_posix() not in INFRASTRUCTURE and not docstring_only(p)
        }
    return {dep}


def rlhf_closure(root: Path, path: Path) -> set[str]:
    return {
        f
        for f in code_closure(root, path)
        if f.startswith("rlhf/") and f not in INFRASTRUCTURE and not docstring_only(root / f)
    }


def stage_code(root: Path, cmd: str) -> tuple[bool, Path, set[str]]:
    """(launched, the stage module's file, the rlhf/ files its output can depend on) of a
    stage whose command is `cmd`."""
    match = COMMAND.match(cmd)
    if match is None:
        raise ValueError(f"{cmd!r} runs no stages.<name> module")
    launched, module = bool(match.group(1)), match.group(2)
    source = root / (module.replace(".", "/") + ".py")
    needed = rlhf_closure(root, source)
    if launched:
        needed |= rlhf_closure(root, root / LAUNCHER) | {LAUNCHER}
    return launched, source, needed


def rewritten(root: Path, text: str) -> tuple[str, dict[str, tuple[list[str], list[str]]]]:
    """dvc.yaml's `text` with each stage's rlhf/ deps made its imports (the module
    docstring) and its deps in reading order: what the stage reads (data, models, configs)
    first, then its code (its module, the launcher, the rlhf/ modules, sorted); and
    {stage: (added, dropped)} for those that changed (both empty: only reordered)."""
    import yaml

    stages = yaml.safe_load(text)["stages"]
    lines = text.split("\n")
    starts = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.match(r"^  ([a-z_]+):\s*$", line))]
    ends = [i for i, _ in starts[1:]] + [len(lines)]
    changes = {}
    for (start, name), end in sorted(zip(starts, ends), reverse=True):
        body = stages[name].get("do", stages[name])
        if not COMMAND.match(body["cmd"]) or "stages" in body.get("deps", []):
            continue  # check_params: it lists whole packages (it validates with every stage's Config)
        _, source, needed = stage_code(root, body["cmd"])
        block = lines[start:end]
        first, last, indent = deps_items(block)
        groups = dep_groups(block[first:last])
        listed = [(k, dep) for k, (dep, _) in enumerate(groups) if dep.startswith("rlhf/")]
        keep = {k for k, dep in listed if module_files(root, dep) <= needed}
        covered = set().union(*(module_files(root, dep) for k, dep in listed if k in keep))
        missing = sorted(needed - covered)
        dropped = [dep for k, dep in listed if k not in keep]
        kept = [group for k, group in enumerate(groups) if k not in {k for k, _ in listed} - keep]
        kept += [(dep, [f"{indent}- {dep}"]) for dep in missing]
        reads = [lines for dep, lines in kept if not is_code(dep)]
        own = source.relative_to(root).as_posix()
        code = sorted((group for group in kept if is_code(group[0])), key=lambda group: code_order(group, own))
        new_block = block[:first] + [line for group in reads for line in group]
        new_block += [line for _, group in code for line in group] + block[last:]
        if new_block != block:
            changes[name] = (missing, dropped)
            lines[start:end] = new_block
    return "\n".join(lines), changes


def deps_items(block: list[str]) -> tuple[int, int, str]:
    """(first, end) line of the items of a stage block's `deps:` list, and their indent."""
    key = next(j for j, line in enumerate(block) if line.strip() == "deps:")
    outer = len(block[key]) - len(block[key].lstrip())
    end = key + 1
    while end < len(block) and (not block[end].strip() or len(block[end]) - len(block[end].lstrip()) > outer):
        end += 1
    while not block[end - 1].strip():  # the blank lines after the list belong to the stage
        end -= 1
    item = next(line for line in block[key + 1 : end] if line.lstrip().startswith("- "))
    return key + 1, end, item[: len(item) - len(item.lstrip())]


def dep_groups(items: list[str]) -> list[tuple[str, list[str]]]:
    """The deps of a `deps:` list, each with its lines: the comment lines just above it too."""
    groups, comments = [], []
    for line in items:
        if line.lstrip().startswith("#") or not line.strip():
            comments.append(line)
            continue
        groups.append((line.strip()[2:].split("#")[0].strip(), [*comments, line]))
        comments = []
    if comments:  # a comment under the last dep stays with it
        dep, lines = groups[-1]
        groups[-1] = (dep, lines + comments)
    return groups


def is_code(dep: str) -> bool:
    return dep.startswith(("stages/", "rlhf/"))


def code_order(group: tuple[str, list[str]], own: str) -> tuple[int, str]:
    """The stage's own module (`own`) first, the stage modules it reuses, then the launcher,
    then the rlhf/ modules by path."""
    dep = group[0]
    return (0 if dep == own else 1 if dep.startswith("stages/") else 2 if dep == LAUNCHER else 3, dep)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf dvc-deps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a stage's deps differ")
    parser.add_argument("--file", type=Path, default=Path("dvc.yaml"))
    args = parser.parse_args(argv)
    if not args.file.is_file():
        raise SystemExit(f"rlhf dvc-deps: no {args.file} here; run it in the project's root")
    root = args.file.resolve().parent
    text, changes = rewritten(root, args.file.read_text())
    for name, (added, dropped) in sorted(changes.items()):
        said = [f"add {added}" if added else "", f"drop {dropped}" if dropped else ""]
        print(f"{name}: " + ("; ".join(p for p in said if p) or "deps put in reading order"))
    if args.check:
        if changes:
            raise SystemExit(
                f"rlhf dvc-deps: {len(changes)} stage(s) list other code than they import: run `rlhf dvc-deps`"
            )
        print(f"rlhf dvc-deps: every stage of {args.file} lists the code it imports")
        return
    if changes:
        from rlhf.atomic import atomic_file

        with atomic_file(args.file) as tmp:
            tmp.write_text(text)
    print(f"rlhf dvc-deps: {len(changes)} stage(s) rewritten in {args.file}")


if __name__ == "__main__":
    sys.exit(main())
