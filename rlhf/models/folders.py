"""Model folders before anything is loaded: the built-in sizes, the pointer a stage writes
instead of copying a user's model, and the check that a folder holds a loadable model.

Light on purpose (no torch or transformers): params validation checks `base.model` with it
in a second.
"""

from __future__ import annotations

import json
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
POINTER_FILE = "pointer.json"
BUILTIN_SIZES = {
    # name: (hidden, layers, heads, intermediate)
    "tiny": (128, 4, 4, 384),
    "small": (256, 6, 8, 768),
    "micro": (32, 2, 2, 64),  # for tests: seconds per step
}

_CONFIG_FILE = "config.json"
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model_dir(path: str | Path, what: str = "model") -> Path:
    """Fail early, and say how to fix it, when `path` is not a loadable model directory."""
    path = Path(path)
    how = (
        "Point it at a local Hugging Face model directory (one written by "
        "`model.save_pretrained(dir, safe_serialization=True)` and `tokenizer.save_pretrained(dir)`), "
        "or use `builtin:tiny`."
    )
    if not path.exists():
        raise FileNotFoundError(f"{what} directory {path} does not exist. {how}")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} path {path} is a file, not a model directory. {how}")
    present = sorted(p.name for p in path.iterdir())
    problems = []
    if not (path / _CONFIG_FILE).is_file():
        problems.append(f"no {_CONFIG_FILE}")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            problems.append(
                "weights are pickled (.bin/.pt); only safetensors are loaded. Convert with "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)` "
                "in a trusted environment"
            )
        else:
            problems.append("no *.safetensors weights")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        problems.append("no tokenizer files (tokenizer.json or tokenizer.model)")
    if problems:
        raise ValueError(f"{what} directory {path} is not usable: {'; '.join(problems)}. Found: {present}. {how}")
    return path


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory written by a stage, or the user's directory that its
    `pointer.json` names (stage `base` writes a pointer instead of copying a user model)."""
    path = Path(path)
    pointer = path / POINTER_FILE
    if pointer.is_file():
        return Path(json.loads(pointer.read_text())["path"])
    return path
