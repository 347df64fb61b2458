"""Model merging: mergekit's merges, a compatibility check before them, and greedy soup.

Every weight-space merge is mergekit's (`mergekit.merge.run_merge`, configured through its
Python API, never its CLI). What is ours:

* `check_compatible` — before any compute, every model (the base and the candidates) must
  have the same architecture, the same weight names and shapes, and the same tokenizer
  vocabulary and special tokens. A merge of models whose token ids mean different things
  runs without error and produces garbage, so this fails loudly instead, naming the two
  models and what differs.
* `greedy_soup` — Wortsman et al. 2022 ("Model soups", Algorithm 1): sort the candidates by
  their held-out score, start the soup from the best, and add each next candidate to the
  uniform average only if the soup's held-out score does not drop
  (``score(average(soup + [c])) >= score(average(soup))``, the paper's rule: an ingredient
  that leaves the score level still joins). The soups tried along the way are averaged in
  memory (a running sum of state dicts: three models in memory at most); the chosen soup is
  then written by mergekit's `linear` merge with equal weights, which computes the same mean.

The methods (`MERGE_METHODS`), all mergekit's:

* linear — sum_i w_i theta_i / sum_i w_i (normalize) or sum_i w_i theta_i: a uniform soup
  when the weights are equal (Wortsman et al. 2022).
* task_arithmetic — theta_base + sum_i w_i (theta_i - theta_base) (Ilharco et al. 2023).
* ties — trim each task vector to its top-`density` entries by magnitude, elect each entry's
  sign by the summed (weighted) task vectors, and average the entries that agree with it
  (the disjoint mean) (Yadav et al. 2023).
* dare_ties, dare_linear — drop task-vector entries at random with probability 1 - density
  and rescale the rest to keep the L1 norm, then TIES' sign election or a plain weighted sum
  (Yu et al. 2024). Seeded.
* slerp — spherical interpolation between exactly two models, per output row of each
  tensor: t = 0 gives the first model, t = 1 the second.

Per-layer weights: a weight (or slerp's `t`) may be a list instead of a number; mergekit
interpolates it linearly across the layers, the first value at layer 0 and the last at the
last layer (``[1, 0]`` for model A with ``[0, 1]`` for model B fades from A to B). Weights
outside the layers (the embeddings, the final norm) take the list's first value.

Tied embeddings (the built-in tiny Llama has ``tie_word_embeddings``, so its safetensors
hold no ``lm_head.weight``): mergekit's Llama definition marks ``lm_head.weight`` optional
and tied to ``model.embed_tokens.weight``, so it is skipped when no input has it, and the
merged model ties it again on load. Nothing of ours is needed there.

The merged model's config, generation config and tokenizer are the base's (the model the
candidates were trained from), not whichever input mergekit picks as its donor: for methods
without a base model mergekit takes the first of an unordered set of inputs, and the
inputs' configs can differ in fields a trainer sets (``use_cache``). The compatibility check
has made sure the base's are right for every input.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from rlhf.models.folders import check_model_dir, resolve_model_dir, stored_slices
from rlhf.models.loading import load_causal_lm
from rlhf.params import InputError

MERGE_METHODS = ("linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "slerp")
TASK_VECTOR_METHODS = ("task_arithmetic", "ties", "dare_ties", "dare_linear")
SPARSIFYING_METHODS = ("ties", "dare_ties", "dare_linear")
# Files the merged model takes from the base (the tokenizer is written by the tokenizer itself).
BASE_FILES = ("config.json", "generation_config.json")
MERGEKIT_CONFIG = "mergekit_config.yml"  # the merge's mergekit configuration, kept beside its weights
_CONFIG_KEYS = ("model_type", "architectures", "vocab_size", "tie_word_embeddings")
_EXAMPLES = 3

Weight = float | list[float]


class IncompatibleModelsError(InputError, ValueError):
    """The models cannot be merged: the message names each pair and what differs."""


# ----------------------------------------------------------------------------- compatibility


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes from the safetensors headers (no tensor is read)."""
    return {name: tuple(part.get_shape()) for name, part in stored_slices(path)}


def stored_tensors(path: str | Path, names) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each weight in `names` as stored in the model folder `path`, read
    one at a time from its safetensors files (on the CPU, in the stored dtype). A name the
    files lack is a weight tied to another (the LM head of tied embeddings), which the
    model shares, so it is left out."""
    for name, part in stored_slices(resolve_model_dir(path)):
        if name in names:
            yield name, part[...]


def member_weights(path: str | Path, names, trust_remote_code: bool, settings) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each weight in `names` of the model in `path` loaded as transformers
    loads it (its names and layouts), on the CPU in float32."""
    from rlhf.models.compute import Placement

    host = load_causal_lm(path, trust_remote_code, placement=Placement("cpu", "float32"), settings=settings,
                          dtype="float32")  # fmt: skip
    state = host.state_dict()
    del host
    for name in names:
        if name in state:
            yield name, state[name]


def _examples(items) -> str:
    items = sorted(items, key=str)
    shown = ", ".join(repr(i) for i in items[:_EXAMPLES])
    return shown + (f" and {len(items) - _EXAMPLES} more" if len(items) > _EXAMPLES else "")


@dataclass
class _Signature:
    """What must be equal between two models for their weights to be merged."""

    config: dict
    shapes: dict[str, tuple[int, ...]]
    vocab: dict[str, int]
    special: dict


def _signature(path: Path, trust_remote_code: bool) -> _Signature:
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    special = {
        **{f"{name}_id": getattr(tokenizer, f"{name}_id", None) for name in ("bos_token", "eos_token", "unk_token")},
        "special tokens": sorted(tokenizer.all_special_tokens),
    }
    return _Signature(
        config={key: getattr(config, key, None) for key in _CONFIG_KEYS},
        shapes=_tensor_shapes(path),
        vocab=dict(tokenizer.get_vocab()),
        special=special,
    )


def _differences(name: str, sig: _Signature, ref_name: str, ref: _Signature) -> list[str]:
    problems = []
    for key, value in sig.config.items():
        if value != ref.config[key]:
            problems.append(f"config {key}: {value!r} vs {ref.config[key]!r}")
    if len(sig.vocab) != len(ref.vocab):
        problems.append(f"tokenizer vocabulary size {len(sig.vocab)} vs {len(ref.vocab)}")
    only_here, only_ref = sig.vocab.keys() - ref.vocab.keys(), ref.vocab.keys() - sig.vocab.keys()
    if only_here:
        problems.append(f"tokens only in {name}: {_examples(only_here)}")
    if only_ref:
        problems.append(f"tokens only in {ref_name}: {_examples(only_ref)}")
    moved = [t for t in sig.vocab.keys() & ref.vocab.keys() if sig.vocab[t] != ref.vocab[t]]
    if moved:
        problems.append(f"{len(moved)} token(s) with different ids, e.g. {_examples(moved)}")
    for key, value in sig.special.items():
        if value != ref.special[key]:
            problems.append(f"tokenizer {key}: {value!r} vs {ref.special[key]!r}")
    missing, extra = ref.shapes.keys() - sig.shapes.keys(), sig.shapes.keys() - ref.shapes.keys()
    if missing:
        problems.append(f"weights only in {ref_name}: {_examples(missing)}")
    if extra:
        problems.append(f"weights only in {name}: {_examples(extra)}")
    reshaped = [k for k in sig.shapes.keys() & ref.shapes.keys() if sig.shapes[k] != ref.shapes[k]]
    for key in sorted(reshaped)[:_EXAMPLES]:
        problems.append(f"weight {key} has shape {list(sig.shapes[key])} vs {list(ref.shapes[key])}")
    if len(reshaped) > _EXAMPLES:
        problems.append(f"... and {len(reshaped) - _EXAMPLES} more weights of different shapes")
    return problems


def check_compatible(models: Mapping[str, str | Path], trust_remote_code: bool = False) -> None:
    """Raise IncompatibleModelsError unless every model matches the first one (the
    reference: pass the base first) in architecture, weight shapes and tokenizer. Reads only
    configs, tokenizers and safetensors headers."""
    names = list(models)
    for name in names:
        check_model_dir(models[name], what=f"model {name!r}")
    signatures = {name: _signature(Path(models[name]), trust_remote_code) for name in names}
    ref_name = names[0]
    lines = []
    for name in names[1:]:
        problems = _differences(name, signatures[name], ref_name, signatures[ref_name])
        if problems:
            lines.append(f"{name} ({models[name]}) vs {ref_name} ({models[ref_name]}): " + "; ".join(problems))
    if lines:
        raise IncompatibleModelsError(
            f"cannot merge: {len(lines)} model(s) differ from {ref_name!r} in architecture or tokenizer "
            "(merging weights whose shapes or token ids differ is meaningless):\n"
            + "\n".join(f"  {line}" for line in lines)
            + "\nMerge only models fine-tuned from the same base with the same tokenizer."
        )


# ----------------------------------------------------------------------------- mergekit


def _reference(path: str | Path) -> dict:
    # The dict form, not a string: mergekit parses '+' in a string as "model+lora" and '@'
    # as a revision. Not resolved: a stage passes paths relative to the project root, and
    # mergekit_config.yml in the output records them, so the output does not depend on
    # where the project is checked out.
    return {"model": {"path": str(path)}}


def merge_configuration(
    method: str,
    models: Sequence[str | Path],
    weights: Sequence[Weight] | None = None,
    base: str | Path | None = None,
    *,
    density: float = 1.0,
    t: Weight = 0.5,
    normalize: bool | None = None,
    int8_mask: bool = False,
    dtype: str = "float32",
    out_dtype: str | None = None,
):
    """mergekit's MergeConfiguration for `method` over `models`.

    `weights`: one per model, a number or a per-layer list (default 1.0 each; not used by
    slerp). `base`: the model task vectors are taken from (task-vector methods only).
    `density`: fraction of each task vector kept (ties, dare_*). `t`: slerp's position
    from models[0] (0) to models[1] (1), a number or a per-layer list. `normalize`: divide by
    the sum of the weights; None keeps the method's own default (linear, ties: on).
    `dtype`: the arithmetic's precision; `out_dtype`: the saved weights' (None: `dtype`)."""
    # mergekit is imported where it is used: every stage imports every stage's Config
    # (params validation), and none but `merge` should pay for importing mergekit.
    from mergekit.config import MergeConfiguration

    if method not in MERGE_METHODS:
        raise ValueError(f"unknown merge method {method!r}; use one of {list(MERGE_METHODS)}")
    if not models:
        raise ValueError("nothing to merge: no models given")
    if method == "slerp":
        if len(models) != 2:
            raise ValueError(f"slerp interpolates exactly 2 models, got {len(models)}")
        return MergeConfiguration.model_validate(
            {
                "merge_method": "slerp",
                "base_model": _reference(models[0]),
                "models": [{"model": _reference(m)} for m in models],
                "parameters": {"t": t},
                "dtype": dtype,
                "out_dtype": out_dtype,
            }
        )
    weights = list(weights) if weights is not None else [1.0] * len(models)
    if len(weights) != len(models):
        raise ValueError(f"{len(weights)} weights for {len(models)} models")
    if method in TASK_VECTOR_METHODS and base is None:
        raise ValueError(f"{method} needs a base model: task vectors are differences from it")
    per_model = [{"weight": w, **({"density": density} if method in SPARSIFYING_METHODS else {})} for w in weights]
    shared: dict = {} if normalize is None else {"normalize": normalize}
    if method in TASK_VECTOR_METHODS:
        shared["int8_mask"] = int8_mask
    return MergeConfiguration.model_validate(
        {
            "merge_method": method,
            "base_model": _reference(base) if method in TASK_VECTOR_METHODS else None,
            "models": [{"model": _reference(m), "parameters": p} for m, p in zip(models, per_model)],
            "parameters": shared or None,
            "dtype": dtype,
            "out_dtype": out_dtype,
        }
    )


def run_mergekit(
    configuration, out_dir: str | Path, files_from: str | Path, seed: int = 0, trust_remote_code: bool = False
) -> None:
    """Run mergekit on the CPU into `out_dir` (safetensors), then give it the config,
    generation config and tokenizer of `files_from` (the base), and record the mergekit
    configuration in `out_dir`/mergekit_config.yml. `seed` seeds DARE's drops."""
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import MergeOptions, run_merge

    out_dir, files_from = Path(out_dir), Path(files_from)
    options = MergeOptions(
        device="cpu",
        cuda=False,
        lazy_unpickle=False,  # safetensors only: nothing is unpickled
        safe_serialization=True,
        copy_tokenizer=False,  # the base's tokenizer is written below, deterministically
        trust_remote_code=trust_remote_code,
        random_seed=seed,
        allow_crimes=False,
        # mergekit's model card asks the hub whether a path like models/sft is a repo id:
        # a network call in an offline pipeline. The configuration is recorded below instead.
        write_model_card=False,
        quiet=True,
    )
    recorded = configuration.to_yaml()  # before run_merge, which rewrites it into slices
    # mergekit keeps one tensor loader per model path for the whole process (a class-level
    # dict): a model rewritten at the same path since an earlier merge in this process would
    # be read stale (found by running the merge tests and the stage tests in one process).
    LoaderCache().loaders.clear()
    run_merge(configuration, str(out_dir), options)
    (out_dir / MERGEKIT_CONFIG).write_text(recorded + "\n")
    for name in BASE_FILES:
        if (files_from / name).is_file():
            shutil.copyfile(files_from / name, out_dir / name)
    AutoTokenizer.from_pretrained(str(files_from), trust_remote_code=trust_remote_code).save_pretrained(str(out_dir))


# ----------------------------------------------------------------------------- greedy soup


@dataclass
class GreedySoup:
    members: list[str]  # in the order they joined, the best candidate first
    score: float  # the held-out score of the final soup
    individual: dict[str, float]  # each candidate's own score
    trace: list[dict] = field(default_factory=list)  # one row per candidate, in the order tried


def greedy_soup(
    candidates: Mapping[str, str | Path],
    score: Callable[[torch.nn.Module], float],
    trust_remote_code: bool = False,
) -> GreedySoup:
    """Wortsman et al. 2022, Algorithm 1 (greedy soup): with the candidates sorted by
    `score` (best first; ties keep the given order),

        soup = [c_1]
        for c in c_2..c_n:
            if score(mean(soup + [c])) >= score(mean(soup)): soup.append(c)

    where mean is the uniform average of the weights and `score(model)` is a held-out
    score, higher is better. Returns the members, the final score and the trace."""
    import rlhf.models.settings as model_settings

    names = list(candidates)
    if not names:
        raise ValueError("greedy soup needs at least one candidate")
    # Every model is scored as it is served (the compute dtype), the soups too: a soup scored
    # in float32 against candidates scored in bfloat16 would compare two precisions. Never
    # quantized: the soup's weights are written into the model.
    settings = model_settings.current().model_copy(update={"quantization": None})
    individual = {}
    for name in names:
        model = load_causal_lm(candidates[name], trust_remote_code, what=f"candidate {name}", settings=settings)
        individual[name] = float(score(model))
        del model
    order = sorted(names, key=lambda n: -individual[n])
    # The working model holds the soup being scored. `total` is the running sum of the
    # members' stored weights in float32 on the CPU (averaging in half precision would round
    # the soup), and a trial reads the candidate's weights one tensor at a time from its
    # files: beside the served model, a soup of a 70B model holds its float32 sum in host
    # memory and no second copy on the GPU.
    model = load_causal_lm(candidates[order[0]], trust_remote_code, settings=settings)
    weights = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    stored = set(_tensor_shapes(resolve_model_dir(candidates[order[0]])))  # the headers only
    shared = {weights[k].data_ptr() for k in stored if k in weights}  # a tied weight is averaged through its twin
    converted = any(k not in stored and weights[k].data_ptr() not in shared for k in weights)
    if converted:
        # transformers converts some checkpoints as it loads them (a mixture of experts'
        # per-expert tensors fused into one): the stored names are not the model's. Each
        # member's weights are then its state dict, loaded on the host in float32, one
        # member at a time (host memory: one member in float32 beside the sum).
        print("greedy soup: the checkpoints' weights are converted at load; members are read whole on the host")
        total = {k: t.clone() for k, t in member_weights(candidates[order[0]], weights, trust_remote_code, settings)}
    else:
        total = {k: t.float() for k, t in stored_tensors(candidates[order[0]], weights)}

    def read(name: str):
        """A callable giving the member's (name, tensor) pairs, for the trial and again for
        the sum: streamed from its files each time, or its converted state dict, loaded once."""
        if converted:
            member = dict(member_weights(candidates[name], total, trust_remote_code, settings))
            return member.items
        return lambda: stored_tensors(candidates[name], total)

    members, best = [order[0]], individual[order[0]]
    trace = [{"candidate": order[0], "individual": best, "soup": best, "accepted": True, "members": list(members)}]
    for name in order[1:]:
        n, tensors = len(members) + 1, read(name)
        with torch.no_grad():
            for key, tensor in tensors():
                weights[key].copy_((total[key] + tensor.float()) / n)
        trial = float(score(model))
        accepted = trial >= best
        if accepted:
            for key, tensor in tensors():
                total[key] += tensor.float()
            members.append(name)
            best = trial
        row = {"candidate": name, "individual": individual[name], "soup": trial, "accepted": accepted}
        trace.append({**row, "members": list(members)})
    return GreedySoup(members=members, score=best, individual=individual, trace=trace)
