"""MkDocs hooks: the pages generated when the site builds, so they cannot drift.

* reference/params.md: every params key, from the Configs (rlhf.params_docs);
* reference/cli.md: `rlhf --help` and each subcommand's help;
* architecture.md, results/benchmarks.md, results/curriculum.md: the repository's own
  ARCHITECTURE.md, benchmarks/README.md and studies/curriculum/SETTINGS.md (kept where the
  code they describe lives), with their links to repository files pointed at the pages;
* results/seed-spread.md, results/ewc-shift.md, results/prm-repair.md, results/sabotage.md:
  a page per study, its README (the question and the command) followed by the table.md its
  run.py wrote (studies/<study>/), links pointed at the pages likewise.
"""

from __future__ import annotations

import posixpath
import re
import subprocess
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
INCLUDED = {
    "architecture.md": "ARCHITECTURE.md",
    "results/benchmarks.md": "benchmarks/README.md",
    "results/curriculum.md": "studies/curriculum/SETTINGS.md",
}
# A study's page: its folder's README.md, then its table.md.
STUDIES = {
    "results/seed-spread.md": "studies/seed_spread",
    "results/ewc-shift.md": "studies/ewc_shift",
    "results/prm-repair.md": "studies/prm_repair",
    "results/sabotage.md": "studies/sabotage",
}
# Links in the included files to files that are pages of the site (and docs/<page>: <page>).
PAGE_LINKS = {
    "README.md": "index.md",
    **{source: page for page, source in INCLUDED.items()},
    **{f"{folder}/{name}": page for page, folder in STUDIES.items() for name in ("README.md", "table.md")},
}


def cli_reference() -> str:
    from rlhf.cli import COMMANDS

    def help_of(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "rlhf.cli", *args], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not done.stdout.startswith("usage:"):
            raise RuntimeError(f"`rlhf {' '.join(args)}` did not print its usage (exit {done.returncode}): "
                               f"{(done.stderr or done.stdout)[-2000:]}")  # fmt: skip
        return done.stdout.rstrip()

    out = ["# The rlhf command", "", "`rlhf <command> [options]`: generated from the command's own help.", ""]
    out += ["```text", help_of("--help"), "```"]
    for name in COMMANDS:
        out += ["", f"## rlhf {name}", "", "```text", help_of(name, "--help"), "```"]
    return "\n".join(out) + "\n"


def included(source: str, page: str) -> str:
    """A repository file as a page: links to other repository files become links to their
    pages (docs/<page> is <page>), or plain code (a file that is not a page)."""
    text = (ROOT / source).read_text()
    base = posixpath.dirname(source)

    def link(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+://|^#|^mailto:", target):
            return match.group(0)
        file, _, anchor = target.partition("#")
        path = posixpath.normpath(posixpath.join(base, file))
        to = PAGE_LINKS.get(path) or (path.removeprefix("docs/") if path.startswith("docs/") else None)
        if to:
            suffix = f"#{anchor}" if anchor else ""
            return f"[{label}]({posixpath.relpath(to, posixpath.dirname(page))}{suffix})"
        return f"{label} (`{path}`)"

    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", link, text)


def study(folder: str, page: str) -> str:
    """A study's page: its README (the question and the command), then its table.md as the
    study's run.py wrote it."""
    readme, results = included(f"{folder}/README.md", page), included(f"{folder}/table.md", page)
    return f"{readme.rstrip()}\n\n## Results\n\n`{folder}/table.md`, as run.py wrote it:\n\n{results}"


def on_files(files, config):
    if str(ROOT) not in sys.path:  # the checkout's own code, installed or not
        sys.path.insert(0, str(ROOT))
    import stages
    from rlhf.params_docs import params_reference

    generated = {
        "reference/params.md": params_reference(stages.all_configs()),
        "reference/cli.md": cli_reference(),
        **{page: included(source, page) for page, source in INCLUDED.items()},
        **{page: study(folder, page) for page, folder in STUDIES.items()},
    }
    for path, content in generated.items():
        files.append(File.generated(config, path, content=content))
    return files
