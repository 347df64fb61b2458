"""Which checkpoint a killed run resumes from: the newest one that is whole.

A run killed while it writes a checkpoint (transformers' Trainer writes into
`checkpoint-N/` in place), a full disk, or a file damaged later leaves a folder that
`get_last_checkpoint` would still pick, and the resume would die on it, or worse, load half
a state. `usable_checkpoint` checks every candidate, newest first, before anything loads
it: the state file parses, each safetensors file is as long as its header says, and each
torch file (optimizer, scheduler, RNG state: zip archives) passes its CRC check. A damaged
checkpoint is removed with a line that names it and what is wrong, and the next older one
is tried; with none left the run starts afresh.

Own code: transformers and accelerate pick the newest folder by name and do not check it.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

from rlhf.models.folders import safetensors_problem

STATE_FILES = ("trainer_state.json", "state.json")  # Trainer's, and our PPO loop's
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def torch_file_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f"{path.name}: not a whole torch archive ({error})"
    return f"{path.name}: member {bad} fails its CRC check" if bad else None


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed from; None when it can."""
    states = [path / name for name in STATE_FILES if (path / name).is_file()]
    if not states:
        return f"no {' or '.join(STATE_FILES)} (the write of the checkpoint did not finish)"
    try:
        json.loads(states[0].read_text())
    except (ValueError, UnicodeDecodeError) as error:
        return f"{states[0].name} is not valid JSON ({error})"
    for file in sorted(path.rglob("*")):
        if not file.is_file():
            continue
        if file.suffix == ".safetensors":
            problem = safetensors_problem(file)
        elif file.suffix in TORCH_SUFFIXES:
            problem = torch_file_problem(file)
        else:
            continue
        if problem:
            return problem
    return None


def usable_checkpoint(directory: Path, prefix: str, label: str) -> Path | None:
    """The newest whole `<prefix>-<step>` folder in `directory`; damaged newer ones are
    removed, each with a line naming it and the damage. None when there is none."""
    pattern = re.compile(re.escape(prefix) + r"-(\d+)")
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = sorted(
        ((int(m[1]), p) for p in directory.iterdir() if (m := pattern.fullmatch(p.name)) and p.is_dir()), reverse=True
    )
    for _, path in found:
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"{label}: discarding damaged checkpoint {path}: {problem}")
        shutil.rmtree(path, ignore_errors=True)
    return None
