"""MkDocs hooks: the pages generated when the site builds, so they cannot drift.

* reference/params.md: every params key, from the Configs (rlhf.reference);
* reference/cli.md: `rlhf --help` and each subcommand's help;
* architecture.md, results/benchmarks.md, results/curriculum.md: the repository's own
  ARCHITECTURE.md, benchmarks/README.md and studies/curriculum/SETTINGS.md (kept where the
  code they describe lives), with their links to repository files pointed at the pages.
"""

from __future__ import annotations

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
# Links in the included files to files that are pages of the site.
PAGE_LINKS = {"ARCHITECTURE.md": "architecture.md", "README.md": "index.md"}


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
    pages, or plain code (a file that is not a page)."""
    text = (ROOT / source).read_text()
    base = Path(source).parent

    def link(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+://|^#|^mailto:", target):
            return match.group(0)
        path = (base / target.split("#")[0]).as_posix()
        path = str(Path(path)).replace("\\", "/")
        if path in PAGE_LINKS:
            depth = page.count("/")
            return f"[{label}]({'../' * depth}{PAGE_LINKS[path]})"
        return f"{label} (`{path}`)"

    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", link, text)


def on_files(files, config):
    if str(ROOT) not in sys.path:  # the checkout's own code, installed or not
        sys.path.insert(0, str(ROOT))
    import stages
    from rlhf.reference import params_reference

    generated = {
        "reference/params.md": params_reference(stages.all_configs()),
        "reference/cli.md": cli_reference(),
        **{page: included(source, page) for page, source in INCLUDED.items()},
    }
    for path, content in generated.items():
        files.append(File.generated(config, path, content=content))
    return files
