"""Merging (rlhf/models/merging.py, stages/merge.py) on micro models built here.

A base model and two "fine-tuned" variants (the base's weights plus small deterministic
noise), each saved as a plain model directory. mergekit's outputs are compared with merges
worked out in plain torch from the papers' equations; greedy soup runs with a hand-built
score, so no generation is needed except in the one smoke test of its real score.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlhf.models.loading import build_tiny_model, build_tokenizer, load_causal_lm, load_tokenizer, save_model
from rlhf.models.merging import (
    IncompatibleModelsError,
    check_compatible,
    greedy_soup,
    merge_configuration,
    run_mergekit,
)
from rlhf.params import ParamsError, validate_params
from rlhf.tasks import get_task
from stages.merge import Config, member_names, run
from tests.conftest import run_stages_in, tiny_params, write_params

ATOL = 1e-5
TASK = get_task()
LAYER_0, LAYER_1 = "model.layers.0.", "model.layers.1."  # the micro model has 2 layers


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def assert_close(actual: dict, expected: dict, keys=None) -> None:
    keys = list(expected) if keys is None else keys
    assert keys and set(keys) <= set(actual), f"missing {set(keys) - set(actual)}"
    for key in keys:
        torch.testing.assert_close(actual[key], expected[key], atol=ATOL, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


def perturbed(base_model, seed: int, scale: float = 0.05):
    """A copy of `base_model` whose every weight moved by seeded Gaussian noise."""
    generator = torch.Generator().manual_seed(seed)
    model = type(base_model)(base_model.config)
    state = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in base_model.state_dict().items()}
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """base/, a/ and b/ (base + noise), saved like the pipeline's stages save models."""
    root = tmp_path_factory.mktemp("zoo")
    tokenizer = build_tokenizer()
    base = build_tiny_model("micro", tokenizer, seed=0)
    save_model(base, tokenizer, root / "base")
    save_model(perturbed(base, 1), tokenizer, root / "a")
    save_model(perturbed(base, 2), tokenizer, root / "b")
    return root


def merge(zoo: Path, out: str, method: str, mix=None, seed: int = 0, **options) -> dict:
    """Merge a and b (base: base) with mergekit into zoo/out with weights `mix`; returns
    the merged weights."""
    base = zoo / "base"
    run_mergekit(merge_configuration(method, [zoo / "a", zoo / "b"], mix, base, **options), zoo / out, base, seed)
    return weights(zoo / out)


# ----------------------------------------------------------------------------- every method


@pytest.mark.slow
@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "slerp"])
def test_each_method_writes_a_loadable_model_with_the_base_tokenizer(zoo, method):
    out = zoo / f"loadable-{method}"
    config = merge_configuration(method, [zoo / "a", zoo / "b"], None, zoo / "base", density=0.5)
    run_mergekit(config, out, zoo / "base")
    merged = weights(out)
    assert "lm_head.weight" not in merged, "tied embeddings: mergekit skips the optional lm_head"
    a, b = weights(zoo / "a"), weights(zoo / "b")
    assert set(merged) == set(a)
    assert not torch.equal(merged[f"{LAYER_0}mlp.up_proj.weight"], a[f"{LAYER_0}mlp.up_proj.weight"])
    assert not torch.equal(merged[f"{LAYER_0}mlp.up_proj.weight"], b[f"{LAYER_0}mlp.up_proj.weight"])

    model = load_causal_lm(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = load_tokenizer(out)
    assert tokenizer.get_vocab() == load_tokenizer(zoo / "base").get_vocab()
    assert json.loads((out / "config.json").read_text()) == json.loads((zoo / "base/config.json").read_text())
    ids = tokenizer("12+3\n", return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert torch.isfinite(model(ids).logits).all()


# ----------------------------------------------------------------------------- against hand-computed merges


@pytest.mark.slow
def test_linear_is_the_weighted_average_normalized_or_not(zoo):
    """normalize (default): (1 a + 3 b) / 4. Not normalized: 0.5 a + 2 b."""
    a, b = weights(zoo / "a"), weights(zoo / "b")
    assert_close(merge(zoo, "lin-norm", "linear", [1.0, 3.0]), {k: (a[k] + 3 * b[k]) / 4 for k in a})
    assert_close(merge(zoo, "lin-raw", "linear", [0.5, 2.0], normalize=False), {k: 0.5 * a[k] + 2 * b[k] for k in a})
    assert_close(merge(zoo, "lin-uniform", "linear"), {k: (a[k] + b[k]) / 2 for k in a})


@pytest.mark.slow
def test_task_arithmetic_adds_weighted_task_vectors_to_the_base(zoo):
    """theta = base + 0.5 (a - base) + 0.8 (b - base)  (Ilharco et al. 2023), not normalized."""
    base, a, b = weights(zoo / "base"), weights(zoo / "a"), weights(zoo / "b")
    expected = {k: base[k] + 0.5 * (a[k] - base[k]) + 0.8 * (b[k] - base[k]) for k in base}
    assert_close(merge(zoo, "ta", "task_arithmetic", [0.5, 0.8]), expected)


def ties_by_hand(base: dict, tuned: list[dict], density: float) -> dict:
    """TIES (Yadav et al. 2023), weights 1, lambda 1, per tensor:

    1. trim:  tau_t = theta_t - base, keep its k = int(density * numel) largest |entries|;
    2. elect: gamma = sign(sum_t tau_t)  (a zero sum counts as +);
    3. disjoint mean: tau_m = sum_{t: sign(tau_t) = gamma} tau_t / |{t: sign(tau_t) = gamma}|
       (0 where no task vector agrees); theta = base + tau_m.
    """
    out = {}
    for key, origin in base.items():
        trimmed = []
        for state in tuned:
            delta = (state[key] - origin).flatten()
            keep = torch.zeros_like(delta)
            keep[delta.abs().topk(max(1, int(density * delta.numel()))).indices] = 1
            trimmed.append(delta * keep)
        tau = torch.stack(trimmed)
        gamma = torch.where(tau.sum(0) >= 0, 1.0, -1.0)
        agree = (tau.sign() == gamma).float()
        count = agree.sum(0)
        mean = (tau * agree).sum(0) / torch.where(count > 0, count, 1.0)
        out[key] = origin + mean.reshape(origin.shape)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("density", [1.0, 0.3])
def test_ties_trims_elects_signs_and_takes_the_disjoint_mean(zoo, density):
    base, a, b = weights(zoo / "base"), weights(zoo / "a"), weights(zoo / "b")
    expected = ties_by_hand(base, [a, b], density)
    merged = merge(zoo, f"ties-{density}", "ties", density=density)
    assert_close(merged, expected)
    if density < 1:  # the trimming mattered: plain task arithmetic's mean is something else
        mean = {k: base[k] + ((a[k] - base[k]) + (b[k] - base[k])) / 2 for k in base}
        key = f"{LAYER_0}mlp.up_proj.weight"
        assert (merged[key] - mean[key]).abs().max() > 1e-3


SEEDS = (("s0", 0), ("s0-again", 0), ("s1", 1))


@pytest.mark.slow
def test_dare_keeps_everything_at_density_one_and_is_seeded_below(zoo):
    """dare_linear with density 1 drops nothing: it is task arithmetic. Below 1 the drops are
    random: the same seed gives the same merge, another seed another one."""
    ta = merge(zoo, "dare-ta", "task_arithmetic", [0.5, 0.5])
    assert_close(merge(zoo, "dare-1", "dare_linear", [0.5, 0.5], density=1.0), ta)
    runs = {name: merge(zoo, f"dare-{name}", "dare_linear", density=0.5, seed=seed) for name, seed in SEEDS}
    key = f"{LAYER_1}self_attn.q_proj.weight"
    assert torch.equal(runs["s0"][key], runs["s0-again"][key])
    assert not torch.equal(runs["s0"][key], runs["s1"][key])


@pytest.mark.slow
def test_slerp_endpoints_are_the_two_models(zoo):
    a, b = weights(zoo / "a"), weights(zoo / "b")
    assert_close(merge(zoo, "slerp-0", "slerp", t=0.0), a)
    assert_close(merge(zoo, "slerp-1", "slerp", t=1.0), b)
    middle = merge(zoo, "slerp-half", "slerp", t=0.5)
    key = f"{LAYER_0}mlp.down_proj.weight"
    assert not torch.allclose(middle[key], a[key]) and not torch.allclose(middle[key], b[key])


@pytest.mark.slow
def test_per_layer_weights_fade_from_the_first_model_to_the_second(zoo):
    """Weights [1, 0] for a and [0, 1] for b (linear), or t = [0, 1] (slerp): layer 0 is a,
    the last layer is b; weights outside the layers (embeddings, final norm) take the
    lists' first values, so they are a's."""
    a, b = weights(zoo / "a"), weights(zoo / "b")
    outside = ["model.embed_tokens.weight", "model.norm.weight"]
    for merged in (
        merge(zoo, "layers-linear", "linear", [[1.0, 0.0], [0.0, 1.0]]),
        merge(zoo, "layers-slerp", "slerp", t=[0.0, 1.0]),
    ):
        assert_close(merged, a, [k for k in a if k.startswith(LAYER_0)] + outside)
        assert_close(merged, b, [k for k in b if k.startswith(LAYER_1)])


# ----------------------------------------------------------------------------- greedy soup


def norm_model(zoo: Path, name: str, x: float, y: float) -> Path:
    """The base with model.norm = x and layer 0's input norm = y everywhere."""
    model = load_causal_lm(zoo / "base")
    with torch.no_grad():
        model.model.norm.weight.fill_(x)
        model.model.layers[0].input_layernorm.weight.fill_(y)
    save_model(model, load_tokenizer(zoo / "base"), zoo / name)
    return zoo / name


def distance_score(model) -> float:
    """Higher is better: -(|x - 1| + |y - 1|) for the two norms that norm_model sets."""
    x = model.model.norm.weight.mean().item()
    y = model.model.layers[0].input_layernorm.weight.mean().item()
    return -(abs(x - 1) + abs(y - 1))


@pytest.mark.slow
def test_greedy_soup_keeps_only_candidates_that_do_not_lower_the_score(zoo):
    """Scores (x, y -> -(|x-1| + |y-1|)): A (1, 0.4) -0.6, B (0.6, 0.6) -0.8, C (1, 2) -1.0,
    D (4, 4) -6.0, so the order is A, B, C, D. Soup A: -0.6. +B: mean (0.8, 0.5) -0.7 < -0.6,
    rejected. +C: mean (1, 1.2) -0.2, accepted. +D: mean (2, 2.13) -2.13, rejected."""
    candidates = {
        "D": norm_model(zoo, "soup-D", 4.0, 4.0),
        "B": norm_model(zoo, "soup-B", 0.6, 0.6),
        "A": norm_model(zoo, "soup-A", 1.0, 0.4),
        "C": norm_model(zoo, "soup-C", 1.0, 2.0),
    }
    soup = greedy_soup(candidates, distance_score)
    assert soup.members == ["A", "C"]
    assert soup.score == pytest.approx(-0.2, abs=1e-5)
    assert soup.individual == pytest.approx({"A": -0.6, "B": -0.8, "C": -1.0, "D": -6.0}, abs=1e-5)
    assert [(r["candidate"], r["accepted"]) for r in soup.trace] == [
        ("A", True), ("B", False), ("C", True), ("D", False),
    ]  # fmt: skip
    assert [r["soup"] for r in soup.trace] == pytest.approx([-0.6, -0.7, -0.2, -(1 + 3.4 / 3)], abs=1e-5)


@pytest.mark.slow
def test_greedy_soup_scores_its_soups_as_it_scores_the_candidates(zoo, monkeypatch):
    """Computing in bfloat16 (a GPU's compute.dtype, set here on the CPU), every model the
    soup scores, candidates and soups alike, is served in bfloat16: a soup scored in float32
    master weights against candidates scored in bfloat16 compared two precisions. The soup
    is the mean of the members' stored weights."""
    import rlhf.models.compute as compute

    candidates = {"A": norm_model(zoo, "bf-A", 1.0, 0.4), "C": norm_model(zoo, "bf-C", 1.0, 2.0)}
    monkeypatch.setattr(compute, "_current", compute.Placement("cpu", "bfloat16"))
    seen = []

    def score(model) -> float:
        seen.append(next(model.parameters()).dtype)
        return distance_score(model)

    soup = greedy_soup(candidates, score)
    assert seen == [torch.bfloat16] * 3, "A, C, then the soup A + C"
    assert soup.members == ["A", "C"] and soup.score == pytest.approx(-0.2, abs=1e-2)


@pytest.mark.slow
def test_greedy_soup_averages_the_weights_transformers_converts_at_load(tmp_path):
    """A mixture of experts (Mixtral): transformers fuses its per-expert tensors into one as
    it loads, so the stored names are not the model's; the soup averages the experts all the
    same (the mean of 1 and 3 is scored as 2)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from rlhf.models.loading import build_tokenizer

    config = MixtralConfig(
        vocab_size=len(build_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
    )  # fmt: skip
    candidates = {}
    for name, value in (("A", 1.0), ("B", 3.0)):
        torch.manual_seed(0)
        model = MixtralForCausalLM(config)
        with torch.no_grad():
            model.model.layers[0].mlp.experts.gate_up_proj.fill_(value)
        model.save_pretrained(tmp_path / name)
        build_tokenizer().save_pretrained(tmp_path / name)
        candidates[name] = tmp_path / name
    seen = []

    def score(model) -> float:
        seen.append(model.model.layers[0].mlp.experts.gate_up_proj.mean().item())
        return -abs(seen[-1] - 2.0)

    soup = greedy_soup(candidates, score)
    assert seen == pytest.approx([1.0, 3.0, 2.0]) and soup.members == ["A", "B"]


@pytest.mark.slow
def test_greedy_soup_accepts_an_ingredient_that_leaves_the_score_level(zoo):
    """The paper's rule is >=: a copy of the best candidate leaves the soup's score exactly
    where it was (all values are exact in binary), and joins."""
    candidates = {"A": norm_model(zoo, "tie-A", 1.0, 0.5), "A2": norm_model(zoo, "tie-A2", 1.0, 0.5)}
    soup = greedy_soup(candidates, distance_score)
    assert soup.members == ["A", "A2"] and soup.score == -0.5


@pytest.mark.slow
def test_greedy_soup_stage_writes_the_uniform_average_of_its_members(zoo):
    candidates = {
        "A": norm_model(zoo, "stage-A", 1.0, 0.4),
        "B": norm_model(zoo, "stage-B", 0.6, 0.6),
        "C": norm_model(zoo, "stage-C", 1.0, 2.0),
    }
    out = zoo / "stage-soup"
    metrics = run(
        Config(method="greedy_soup"), TASK, candidates, zoo / "base", Path("unused"), out, score=distance_score
    )
    assert metrics["members"] == ["A", "C"] and metrics["weights"] == [1.0, 1.0]
    assert [r["accepted"] for r in metrics["greedy_soup"]["trace"]] == [True, False, True]
    a, c = weights(candidates["A"]), weights(candidates["C"])
    assert_close(weights(out), {k: (a[k] + c[k]) / 2 for k in a})
    assert distance_score(load_causal_lm(out)) == pytest.approx(metrics["greedy_soup"]["score"], abs=1e-6)


@pytest.mark.slow
def test_greedy_soup_scores_by_greedy_decoding_accuracy_on_prompts(zoo):
    """The real score: task accuracy (the task's answer check) on the first prompts of the
    suite. The untrained micro models solve
    nothing, so every soup scores 0 and (>=) every candidate joins."""
    prompts = zoo / "prompts.parquet"
    pd.DataFrame({"prompt": ["1+2-3\n", "4+5-6\n", "7-1+2\n"], "answer": [0, 3, 8]}).to_parquet(prompts)
    config = Config(method="greedy_soup", greedy_soup_prompts=2, max_new_tokens=4, batch_size=2)
    metrics = run(config, TASK, {"a": zoo / "a", "b": zoo / "b"}, zoo / "base", prompts, zoo / "soup-real")
    assert metrics["greedy_soup"]["individual"] == {"a": 0.0, "b": 0.0}
    assert metrics["members"] == ["a", "b"] and metrics["greedy_soup"]["prompts"] == 2
    assert load_causal_lm(zoo / "soup-real").config.vocab_size == len(build_tokenizer())


# ----------------------------------------------------------------------------- compatibility


@pytest.mark.slow
def test_a_different_vocabulary_fails_naming_both_models_before_any_compute(zoo):
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, zoo / "odd")
    out = zoo / "never-written"
    with pytest.raises(IncompatibleModelsError) as error:
        run(Config(method="linear"), TASK, {"a": zoo / "a", "odd": zoo / "odd"}, zoo / "base", Path("unused"), out)
    message = str(error.value)
    assert "odd (" in message and "vs sft (" in message
    assert not any(line.strip().startswith("a (") for line in message.splitlines()), "a is compatible"
    assert "tokenizer vocabulary size 104 vs 103" in message and "tokens only in odd: '<extra>'" in message
    assert "config vocab_size: 104 vs 103" in message and "model.embed_tokens.weight has shape [104, 32]" in message
    assert not out.exists()


@pytest.mark.slow
def test_swapped_token_ids_of_the_same_size_are_incompatible(zoo):
    shutil.copytree(zoo / "a", zoo / "swapped")
    path = zoo / "swapped/tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    path.write_text(json.dumps(data))
    with pytest.raises(IncompatibleModelsError, match=r"swapped .* vs base .*2 token\(s\) with different ids"):
        check_compatible({"base": zoo / "base", "a": zoo / "a", "swapped": zoo / "swapped"})
    check_compatible({"base": zoo / "base", "a": zoo / "a", "b": zoo / "b"})


# ----------------------------------------------------------------------------- params


def problems(section: dict) -> str:
    with pytest.raises(ParamsError) as error:
        validate_params({"merge": section}, {"merge": Config})
    return str(error.value)


def test_config_errors_name_the_key():
    assert "merge.models: slerp interpolates exactly 2 models" in problems(
        {"method": "slerp", "models": ["dpo", "kto", "orpo"]}
    )
    assert "merge.weights: 3 weights for 2 models" in problems({"models": ["dpo", "kto"], "weights": [1, 2, 3]})
    assert "merge.weights: not used by slerp" in problems({"method": "slerp", "weights": [1, 2]})
    assert "merge.method" in problems({"method": "soup"})
    assert "merge.density" in problems({"density": 0})
    assert "merge.t" in problems({"method": "slerp", "t": [0.0, 1.5]})
    assert "merge.merge_method: unknown key" in problems({"merge_method": "ties"})
    # A key the chosen method does not read is an error, not a silent no-op.
    assert "merge: density, t: not read by merge method linear" in problems({"density": 0.3, "t": 0.2})
    assert "merge: greedy_soup_prompts: not read by merge method ties" in problems(
        {"method": "ties", "density": 0.3, "greedy_soup_prompts": 50}
    )
    assert Config(method="dare_ties", density=0.3, seed=1, int8_mask=True).seed == 1
    # normalize: greedy_soup always normalises and slerp never reads it; null (the default) passes
    assert "normalize: not read by merge method greedy_soup" in problems({"method": "greedy_soup", "normalize": False})
    assert "normalize: not read by merge method slerp" in problems({"method": "slerp", "normalize": True})
    assert Config(method="slerp", normalize=None).normalize is None


def test_check_params_names_merge_members_the_policy_section_cannot_give(tmp_path):
    """merge.models and merge.weights against the trained methods failed in stage merge,
    after SFT and every policy had trained; check_params names them first."""
    from tests.conftest import params_problems, tiny_params

    data = tiny_params()
    data["policy"]["offline"], data["policy"]["online"] = ["dpo"], []
    data["merge"] = {"method": "linear", "models": ["dpo", "grpo"]}
    assert "merge.models: ['grpo'] not in policy.offline + policy.online ['dpo']" in " ".join(
        params_problems(tmp_path, data)
    )
    data["merge"] = {"method": "linear", "weights": [1.0, 2.0]}
    assert "merge.weights: 2 weights for 1 models from every policy method" in " ".join(params_problems(tmp_path, data))


def test_members_are_checked_against_policy_methods():
    assert member_names(Config(), ["dpo", "kto"]) == ["dpo", "kto"]
    assert member_names(Config(models=["kto"]), ["dpo", "kto"]) == ["kto"]
    with pytest.raises(ParamsError, match=r"merge.models: \['ppo'\] not in policy.offline \+ policy.online \['dpo'\]"):
        member_names(Config(models=["dpo", "ppo"]), ["dpo"])
    with pytest.raises(ParamsError, match=r"merge.weights: 2 weights for 1 models from every policy method"):
        member_names(Config(weights=[1.0, 2.0]), ["dpo"])
    with pytest.raises(ParamsError, match=r"merge.models: slerp interpolates exactly 2 models, got 3"):
        member_names(Config(method="slerp"), ["dpo", "kto", "orpo"])


# ----------------------------------------------------------------------------- the stage's CLI


@pytest.mark.slow
def test_main_merges_the_configured_policies_into_models_merged(zoo, tmp_path, monkeypatch, mlflow_store):
    import stages.merge

    run_stages_in(monkeypatch, tmp_path)
    params = tiny_params()
    params["policy"]["offline"] = ["dpo", "kto"]
    params["merge"] = {"method": "ties", "density": 0.5, "weights": [1.0, 0.5]}
    write_params(tmp_path, params)
    shutil.copytree(zoo / "base", tmp_path / "models/sft")
    shutil.copytree(zoo / "a", tmp_path / "models/policy/dpo")
    shutil.copytree(zoo / "b", tmp_path / "models/policy/kto")

    stages.merge.main()

    metrics = json.loads((tmp_path / "metrics/merge.json").read_text())
    assert metrics["method"] == "ties" and metrics["members"] == ["dpo", "kto"] and metrics["density"] == 0.5
    assert metrics["weights"] == [1.0, 0.5]
    assert load_causal_lm(tmp_path / "models/merged").config.tie_word_embeddings
    recorded = yaml.safe_load((tmp_path / "models/merged/mergekit_config.yml").read_text())
    assert recorded["merge_method"] == "ties" and recorded["base_model"] == "models/sft"
    assert [m["model"] for m in recorded["models"]] == ["models/policy/dpo", "models/policy/kto"], "no absolute paths"
