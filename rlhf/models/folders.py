"""Model folders before anything is loaded: the built-in sizes, the pointer a stage writes
instead of copying a user's model, and the check that a folder holds a loadable model.

Light on purpose (no torch or transformers): params validation checks `base.model` with it
in a second.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

from rlhf.params import InputError

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
# A vocabulary (tokenizer_config.json alone holds none): fast, SentencePiece, BPE, WordPiece, tiktoken.
_TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer.model", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def check_nope_layers(size: str, nope_layers) -> None:
    """A ValueError unless every layer number in `nope_layers` is one of builtin:<size>'s."""
    layers = BUILTIN_SIZES[size][1]
    outside = sorted(set(nope_layers) - set(range(layers)))
    if outside:
        raise ValueError(f"nope_layers {outside}: builtin:{size} has layers 0 to {layers - 1}")


class ModelNotFoundError(InputError, FileNotFoundError):
    """No model directory at the path, and no Hub model of that id to be had."""


class ModelNotADirectoryError(InputError, NotADirectoryError):
    """The model path is a file."""


class UnusableModelError(InputError, ValueError):
    """The model directory lacks a config, safetensors weights or tokenizer files."""


def check_model_dir(path: str | Path, what: str = "model") -> Path:
    """Fail early, and say how to fix it, when `path` is not a loadable model directory."""
    path = Path(path)
    how = (
        "Point it at a local Hugging Face model directory (one written by "
        "`model.save_pretrained(dir, safe_serialization=True)` and `tokenizer.save_pretrained(dir)`), "
        "or use `builtin:tiny`."
    )
    if not path.exists():
        raise ModelNotFoundError(f"{what} directory {path} does not exist. {how}")
    if not path.is_dir():
        raise ModelNotADirectoryError(f"{what} path {path} is a file, not a model directory. {how}")
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
    problems += missing_shards(path)
    damaged = damaged_weights(path)
    if not any(p.is_file() for pattern in _TOKENIZER_PATTERNS for p in path.glob(pattern)):
        problems.append("no tokenizer vocabulary (tokenizer.json, tokenizer.model, vocab.json or *.tiktoken)")
    if problems:
        found = f"Found: {present}"
        raise UnusableModelError(f"{what} directory {path} is not usable: {'; '.join(problems)}. {found}. {how}")
    if damaged:
        raise UnusableModelError(
            f"{what} directory {path}: {'; '.join(damaged)}. A pipeline output is restored from DVC's cache with "
            f"`dvc checkout {path.as_posix()}` (or rebuilt with `dvc repro --force <stage>`); a model of your own, "
            "saved again with `save_pretrained`"
        )
    return path


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is not whole (its header unreadable, or the file shorter or
    longer than the header describes); None when it is. Reads the header only."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                return f"{path.name}: header of {length} bytes in a {size}-byte file (truncated)"
            header = json.loads(handle.read(length))
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        return f"{path.name}: unreadable header ({error})"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end != size:
        return f"{path.name}: {size} bytes, its header describes {8 + length + end} (truncated or damaged)"
    return None


def damaged_weights(path: Path) -> list[str]:
    """The safetensors files of a model folder that are shorter than their header says (cut
    short by a kill mid-write, a full disk or a partial copy): named before transformers
    fails on them with a bare SafetensorError. Reads the headers only."""
    return [problem for file in sorted(path.glob("*.safetensors")) if (problem := safetensors_problem(file))]


# `owner/name` (or a bare legacy name such as `gpt2`): letters, digits, `-`, `_`, `.`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# What a model folder needs from the Hub: no pickled weights, custom code only when trusted.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def looks_like_hub_id(value: str) -> bool:
    """Whether `value` names a Hugging Face Hub repository rather than a local folder
    (a path that exists locally is always a folder)."""
    return not Path(value).exists() and bool(_HUB_ID.match(value)) and not value.endswith((".", "/"))


def fetch_from_hub(repo_id: str, revision: str | None, what: str, trust_remote_code: bool = False) -> Path:
    """A local snapshot of the Hub model `repo_id` (downloaded into the Hugging Face cache,
    or found there when offline): config, safetensors weights, tokenizer files, and the
    model's own code only with `trust_remote_code`. Fails with one message that names the id
    and says what to do."""
    from huggingface_hub import snapshot_download

    patterns = HUB_FILES + (["*.py"] if trust_remote_code else [])
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as error:  # offline, no network, unknown or gated repo: one message
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise ModelNotFoundError(
            f"{what} {repo_id!r} is not a local model directory, and the Hugging Face Hub could not "
            f"provide it ({reason}). If you are offline (HF_HUB_OFFLINE=1) or have no network: "
            f"download it once while online (`hf download {repo_id}` fills the cache "
            "this stage reads), or save it with `save_pretrained` and give that folder. "
            "If the id is a typo of a local path, fix the path."
        ) from error


# A model stage whose inputs are absent writes this file instead of a model: the stage drops
# out of the run (DVC still sees its declared output) and the file says what would supply it.
ABSENT_FILE = "absent.json"


def write_absent(path: str | Path, reason: str) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / ABSENT_FILE).write_text(json.dumps({"absent": reason}, indent=2) + "\n")


MEMBER_PREFIX = "member_"  # an RM ensemble's members: folders member_0, member_1, ... (stage rm)
PRM_FILE = "prm.json"  # beside a PRM's weights (stage prm): its kind, step separator and settings


def scorer_problem(kind: str, path: str | Path, separator: str | None = None) -> str | None:
    """Why the folder `path` cannot be read as a `kind` scorer ("reward_model": an ensemble
    of member_<i> folders; "prm": a PRM with its prm.json, and with `separator`, the task's
    step separator, the one it splits steps on), or None when it can, or when it is not
    there yet (a stage may write it) or names a Hub model."""
    path = Path(path)
    if not path.is_dir():
        return None
    folder = resolve_model_dir(path)
    if kind == "reward_model" and not any(p.is_dir() for p in folder.glob(f"{MEMBER_PREFIX}[0-9]*")):
        members = f"{MEMBER_PREFIX}0, {MEMBER_PREFIX}1, ..."
        return f"{path} holds no reward model ensemble (folders {members}: what stage rm writes)"
    if kind == "prm":
        if not (folder / PRM_FILE).is_file():
            return f"{path} has no {PRM_FILE}: it is not a process reward model written by stage prm"
        theirs = prm_separator(folder)
        if separator is not None and theirs != separator:
            return (
                f"{path}: the PRM splits steps on {theirs!r} but the task on {separator!r} (task.step_separator): "
                "it would score other steps than the model writes; give the PRM trained for this task"
            )
    return None


def prm_separator(path: str | Path) -> str | None:
    """The step separator the PRM in `path` was trained with (its prm.json), None if unreadable."""
    try:
        return json.loads((Path(path) / PRM_FILE).read_text()).get("step_separator")
    except (OSError, ValueError, AttributeError):
        return None


def absent_reason(path: str | Path) -> str | None:
    """Why the stage that owns `path` wrote no model, or None when it wrote one."""
    marker = Path(path) / ABSENT_FILE
    return json.loads(marker.read_text())["absent"] if marker.is_file() else None


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory written by a stage, or the user's directory that its
    `pointer.json` names (stage `base` writes a pointer instead of copying a user model)."""
    path = Path(path)
    pointer = path / POINTER_FILE
    if pointer.is_file():
        return Path(json.loads(pointer.read_text())["path"])
    return path


def missing_shards(path: Path) -> list[str]:
    """The weight shards an index (`*.safetensors.index.json`) names that the folder lacks."""
    problems = []
    for index in path.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            problems.append(f"{index.name} is not a readable weight index")
            continue
        absent = sorted(name for name in shards if not (path / name).is_file())
        if absent:
            problems.append(f"{index.name} names shards the folder lacks: {absent}")
    return problems


def stored_slices(folder: Path) -> Iterator[tuple[str, object]]:
    """(name, safetensors slice) of every weight stored in `folder`'s safetensors files,
    files and names in sorted order: nothing is read but the headers until a slice is
    indexed (`part[...]` is the whole tensor). A slice is valid until the next is drawn."""
    from safetensors import safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(handle.keys()):  # noqa: SIM118 (safe_open is not iterable)
                yield name, handle.get_slice(name)


def checkpoint_fingerprint(folder: Path) -> str:
    """Names the weights stored in `folder` cheaply at any size: every tensor's name, dtype,
    shape and first 64 values (of its first row), read from the files, so that loading it in
    another dtype or quantized does not change it."""
    import hashlib

    digest = hashlib.sha256()
    for name, part in stored_slices(folder):
        shape = part.get_shape()
        first = part[tuple(slice(0, 1) for _ in shape[:-1]) + (slice(0, 64),)] if shape else part[...]
        digest.update(f"{name}:{part.get_dtype()}:{tuple(shape)}:".encode())
        digest.update(first.reshape(-1).float().numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint(model, way: str | None = None) -> tuple[str, str]:
    """(what names the model's weights, which of two ways it was taken), cheap at any size.

    "checkpoint": the model was loaded from a local folder of safetensors (its
    `name_or_path`), and the fingerprint is of the weights as stored there: every tensor's
    name, dtype, shape and first 64 values, read from the files. The same checkpoint loaded
    in another dtype or quantized (an evaluate block's own `model:` keys) gives the same
    fingerprint; a fine-tune, LoRA merged or not, another.

    "weights": a model built in memory, from its parameters: each one's name, shape and 64
    values evenly strided through it. Compressors saved before the checkpoint way existed
    recorded this one, and are checked this way. `way` asks for one of the two."""
    folder = checkpoint_folder(model) if way != "weights" else None
    if folder is None:
        return weights_fingerprint(model), "weights"
    return checkpoint_fingerprint(folder), "checkpoint"


def checkpoint_folder(model) -> Path | None:
    """The local folder of safetensors `model` was loaded from (its `name_or_path`), or None."""
    name = getattr(model, "name_or_path", None) or ""
    folder = Path(name) if name else None
    return folder if folder is not None and folder.is_dir() and any(folder.glob("*.safetensors")) else None


def weights_fingerprint(model) -> str:
    """A hash of every parameter's name, shape and 64 values evenly strided through it."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        name = name.replace("base_model.model.", "").replace(".base_layer", "")
        if "lora_" in name:
            continue
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
        digest.update(f"{name}:{tuple(param.shape)}:".encode())
        digest.update(sample.numpy().round(6).tobytes())
    return digest.hexdigest()[:16]
