"""A user's model: a local folder or a Hub id, checked before anything loads; where it runs
and in what precision (`compute`); LoRA on other architectures than the built-in one.

This machine has no network, so the Hub path is tested with the Hugging Face cache (a
snapshot laid out as `huggingface_hub` writes it) and with the offline error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rlhf.models.compute import ComputeConfig, Placement, resolve
from rlhf.models.folders import check_model_dir, fetch_from_hub, looks_like_hub_id, resolve_model_dir
from rlhf.models.loading import build_tiny_model, build_tokenizer, load_causal_lm, save_model

# ----------------------------------------------------------------------------- folders


@pytest.fixture
def model_dir(tmp_path) -> Path:
    tokenizer = build_tokenizer()
    path = tmp_path / "model"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, path)
    return path


def test_a_folder_with_pickled_weights_is_refused_with_how_to_convert(model_dir):
    for weights in model_dir.glob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(ValueError, match=r"weights are pickled \(.bin/.pt\); only safetensors are loaded. Convert"):
        check_model_dir(model_dir, "base.model")


def test_a_folder_without_weights_or_tokenizer_lists_what_is_missing(model_dir):
    for file in model_dir.glob("*.safetensors"):
        file.unlink()
    (model_dir / "tokenizer.json").unlink()  # tokenizer_config.json stays: it holds no vocabulary
    with pytest.raises(ValueError) as error:
        check_model_dir(model_dir, "base.model")
    message = str(error.value)
    assert "base.model directory" in message and "no *.safetensors weights" in message
    assert "no tokenizer vocabulary (tokenizer.json" in message and "save_pretrained" in message


def test_a_sharded_model_missing_a_shard_names_it(model_dir):
    """An index naming two shards, one absent: named before anything loads (it was a raw
    FileNotFoundError from the loader)."""
    import json

    weights = next(model_dir.glob("*.safetensors"))
    weights.rename(model_dir / "model-00001-of-00002.safetensors")
    weight_map = {"lm_head.weight": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"names shards the folder lacks: \['model-00002-of-00002.safetensors'\]"):
        check_model_dir(model_dir, "base.model")


def test_a_missing_folder_names_it_without_a_raw_errno(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        check_model_dir(tmp_path / "nowhere", "base.model")
    assert "base.model directory" in str(error.value) and "Errno" not in str(error.value)


@pytest.mark.parametrize(
    "value, hub",
    [("Qwen/Qwen2.5-0.5B", True), ("gpt2", True), ("./models/x", False), ("/abs/path", False), ("a/b/c", False)],
)
def test_hub_ids_are_told_from_paths(value, hub):
    assert looks_like_hub_id(value) is hub


def test_an_existing_local_folder_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not looks_like_hub_id("org/model")


def test_a_hub_id_offline_and_not_cached_names_the_id_and_what_to_do(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError) as error:
        fetch_from_hub("someone/not-cached-model", None, "base.model")
    message = str(error.value)
    assert "base.model 'someone/not-cached-model'" in message
    assert "HF_HUB_OFFLINE" in message and "hf download someone/not-cached-model" in message


def cached_snapshot(cache: Path, repo_id: str, model_dir: Path, commit: str = "0" * 40) -> Path:
    """A model in the Hugging Face cache, laid out as huggingface_hub writes it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_stage_base_takes_a_cached_hub_model_offline_and_points_at_its_snapshot(tmp_path, monkeypatch, model_dir):
    import huggingface_hub.constants as hub

    import stages.base as stage

    cache = tmp_path / "hf-cache"
    snapshot = cached_snapshot(cache, "someone/tiny-model", model_dir)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    config = stage.Config(model="someone/tiny-model")  # validates without the network
    facts = stage.run(config, tmp_path / "out")
    pointer = json.loads((tmp_path / "out/pointer.json").read_text())
    assert Path(pointer["path"]) == snapshot and pointer["hub_id"] == "someone/tiny-model"
    assert pointer["commit"] == "0" * 40 and facts["source"] == "someone/tiny-model"
    assert resolve_model_dir(tmp_path / "out") == snapshot
    assert load_causal_lm(tmp_path / "out").config.model_type == "llama"


def test_base_pointer_to_a_user_folder_changes_when_the_folder_is_edited_in_place(tmp_path, model_dir):
    import stages.base as stage

    config = stage.Config(model=str(model_dir))
    stage.run(config, tmp_path / "first")
    stage.run(config, tmp_path / "again")
    first = (tmp_path / "first/pointer.json").read_text()
    assert first == (tmp_path / "again/pointer.json").read_text()  # unchanged folder: nothing downstream reruns
    assert set(json.loads(first)["files"]) >= {"config.json", "model.safetensors", "tokenizer_config.json"}
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight, same size
    weights.write_bytes(bytes(data))
    stage.run(config, tmp_path / "edited")
    edited = json.loads((tmp_path / "edited/pointer.json").read_text())
    changed = {k for k, v in edited["files"].items() if json.loads(first)["files"][k] != v}
    assert changed == {"model.safetensors"} and resolve_model_dir(tmp_path / "edited") == model_dir.resolve()


def test_base_params_refuse_a_local_path_that_is_not_a_model(tmp_path):
    import stages.base as stage

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match="is not usable"):
        stage.Config(model=str(tmp_path / "empty"))


def test_stage_base_builds_nope_layers_that_load_back_without_custom_code(tmp_path):
    import stages.base as stage

    config = stage.Config(model="builtin:micro", nope_layers=[1])
    facts = stage.run(config, tmp_path / "out")
    model = load_causal_lm(tmp_path / "out")
    assert model.config.model_type == "smollm3" and model.config.no_rope_layers == [1, 0]  # layer 1: no RoPE
    assert facts["nope_layers"] == [1]
    # Layer 1 has no rotary embedding: its attention reads the same queries and keys at any
    # position, which layer 0 (RoPE) does not.
    assert model.model.layers[1].self_attn.use_rope == 0 and model.model.layers[0].self_attn.use_rope == 1
    tokenizer = build_tokenizer()
    ids = tokenizer("12+7-3\n", return_tensors="pt", add_special_tokens=False)
    assert model(**ids).logits.shape[-1] == len(tokenizer)


def test_a_rope_window_makes_the_rope_layers_local_and_leaves_nope_layers_global(tmp_path):
    import torch

    import stages.base as stage

    stage.run(stage.Config(model="builtin:micro", nope_layers=[1], rope_window=4), tmp_path / "out")
    model = load_causal_lm(tmp_path / "out")
    assert model.config.layer_types == ["sliding_attention", "full_attention"] and model.config.sliding_window == 4
    # Change the first of 20 tokens: the last token's output changes through the global NoPE
    # layer; with both layers windowed (4 tokens each) it cannot reach that far back.
    stage.run(stage.Config(model="builtin:micro", rope_window=4), tmp_path / "local")
    local = load_causal_lm(tmp_path / "local")
    assert local.config.layer_types == ["sliding_attention", "sliding_attention"]
    ids = torch.arange(10, 30).unsqueeze(0)
    changed = ids.clone()
    changed[0, 0] = 50
    with torch.no_grad():
        assert torch.allclose(local(ids).logits[0, -1], local(changed).logits[0, -1])
        assert not torch.allclose(model(ids).logits[0, -1], model(changed).logits[0, -1])


def test_nope_layers_outside_the_model_or_on_a_user_model_are_refused(tmp_path, model_dir):
    import stages.base as stage

    with pytest.raises(ValidationError, match=r"nope_layers \[2\]: builtin:micro has layers 0 to 1"):
        stage.Config(model="builtin:micro", nope_layers=[0, 2])
    with pytest.raises(ValidationError, match="a model of your own keeps its architecture"):
        stage.Config(model=str(model_dir), nope_layers=[0])
    with pytest.raises(ValidationError, match="a model of your own keeps its architecture"):
        stage.Config(model=str(model_dir), rope_window=8)


# ----------------------------------------------------------------------------- compute


def test_auto_on_a_machine_without_a_gpu_is_the_cpu_in_float32():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve(ComputeConfig()) == Placement("cpu", "float32")
    assert resolve(ComputeConfig(device="cpu", dtype="bfloat16")) == Placement("cpu", "bfloat16")


def test_a_named_gpu_that_is_not_there_is_an_error_naming_the_key():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"compute.device is 'cuda:1' but torch sees no CUDA GPU"):
        resolve(ComputeConfig(device="cuda:1"))


def test_an_unknown_device_or_dtype_fails_validation():
    with pytest.raises(ValidationError, match="unknown device 'gpu'"):
        ComputeConfig(device="gpu")
    with pytest.raises(ValidationError):
        ComputeConfig(dtype="int8")


def test_inference_loads_in_the_placement_dtype_and_training_in_float32(model_dir):
    bf16 = Placement("cpu", "bfloat16")
    assert next(load_causal_lm(model_dir, placement=bf16).parameters()).dtype == torch.bfloat16
    assert next(load_causal_lm(model_dir, placement=bf16, training=True).parameters()).dtype == torch.float32
    assert Placement("cuda", "bfloat16").training_precision() == {"bf16": True, "fp16": False}


# ----------------------------------------------------------------------------- architectures


def other_architecture(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_lora_all_linear_fits_gpt2_and_qwen2_and_trains_only_adapters(kind):
    """The default `target_modules: all-linear` finds GPT-2's Conv1D projections and
    Qwen2's linear ones; a step moves the adapters and leaves the base weights alone."""
    from peft import get_peft_model

    from rlhf.training.params import LoraParams

    torch.manual_seed(0)
    model = get_peft_model(other_architecture(kind), LoraParams(enabled=True, r=4).peft_config())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(2):  # lora_B starts at 0: the first step moves B, the second A as well
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == trainable


def test_a_tokenizer_that_starts_text_with_bos_gets_it_wherever_a_prompt_is_read():
    """Llama, Mistral and Gemma tokenizers put BOS before plain text; training (TRL, the
    bucketed SFT) tokenizes with it, so generation, reward and PRM inputs, which the project
    tokenizes without special tokens, carry it in their text: one BOS, never two."""
    from tokenizers import processors

    from rlhf.models.generation import format_prompt, reward_text, text_start
    from rlhf.models.loading import build_tokenizer
    from rlhf.rewards.prm_classifier import encode_steps
    from rlhf.training.bucketed_sft import tokenize_prompt_completion

    plain = build_tokenizer()
    assert text_start(plain) == "" and format_prompt(plain, "1+2\n") == "1+2\n", "the built-in tokenizer adds none"
    llama_like = build_tokenizer()
    bos = llama_like.bos_token_id
    llama_like._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{llama_like.bos_token} $A", special_tokens=[(llama_like.bos_token, bos)]
    )
    prompt = "1+2\n"
    trained = tokenize_prompt_completion(llama_like, [prompt], ["1+2=3; answer 3"])["input_ids"][0]
    read = llama_like(format_prompt(llama_like, prompt), add_special_tokens=False)["input_ids"]
    assert read[0] == bos and read[1] != bos and trained[: len(read)] == read, "inference reads what training saw"
    rewarded = llama_like(reward_text(llama_like, prompt, "answer 3"), add_special_tokens=False)["input_ids"]
    assert rewarded[:2].count(bos) == 1 and rewarded[0] == bos
    steps = encode_steps(llama_like, prompt, ["1+2=3", "answer 3"], [True, True], separator="; ")["input_ids"]
    assert steps[: len(read)] == read


def test_a_diverged_model_is_refused_not_saved(tmp_path):
    """A model whose weights hold NaN (a diverged run) fails naming the tensors (the micro
    model ties its output layer to the embeddings: both) and leaves nothing in its folder;
    the same model with finite weights saves."""
    import torch

    from rlhf.models.loading import DivergedError, build_tiny_model, build_tokenizer, save_model

    tokenizer = build_tokenizer()
    model = build_tiny_model("micro", tokenizer, seed=0)
    save_model(model, tokenizer, tmp_path / "fine")
    assert (tmp_path / "fine/model.safetensors").is_file()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(
        DivergedError,
        match=r"diverged: 2 of 21 weight tensors hold NaN or inf \(model.embed_tokens.weight, lm_head.weight\)",
    ):
        save_model(model, tokenizer, tmp_path / "diverged")
    assert not (tmp_path / "diverged").exists()


def test_rendered_prefixes_are_continued_as_they_are_not_rendered_twice():
    """Rollouts for step labels, MCTS and refinement continue prefixes already rendered for
    the model (`format_prompt` plus steps). With a Llama-style tokenizer a second rendering
    put a second BOS before them: what the model continues must be what one rendering gives,
    so the rollout completer samples exactly what `sample` samples for the plain prompt."""
    import torch
    from tokenizers import processors

    from rlhf.models.generation import format_prompt, sample
    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.rewards.prm_labels import model_completer

    tokenizer = build_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)]
    )
    model = build_tiny_model("micro", tokenizer, seed=0)
    with torch.no_grad():  # sharper logits than at initialisation: the input shows in the samples
        for parameter in model.parameters():
            parameter.mul_(8)
    prompts = ["1+2+3\n", "4+5\n"]
    rendered = [format_prompt(tokenizer, p) for p in prompts]
    assert all(
        r.startswith(tokenizer.bos_token) and not r[len(tokenizer.bos_token) :].startswith(tokenizer.bos_token)
        for r in rendered
    )
    expected = sample(model, tokenizer, prompts, 4, 6, 1.0, 8, seed=3)
    assert model_completer(model, tokenizer, 6, 1.0, batch_size=8, seed=3)(rendered, 4) == expected
    assert sample(model, tokenizer, rendered, 4, 6, 1.0, 8, seed=3) != expected, "rendered twice: another input"


def test_a_continuation_keeps_the_word_boundary_its_first_token_carries():
    """A SentencePiece-style decoder (Llama 2, Mistral) drops the word-boundary space of the
    first token it decodes: the new tokens alone gave "7." where the model wrote " 7.", and
    prompt + completion tokenized as another sequence than the one sampled (a round trains on
    that text). A continuation is the decoded whole less the decoded prompt."""
    from rlhf.models.generation import decode_continuations
    from tests.test_prm import sentencepiece_like_tokenizer

    tokenizer = sentencepiece_like_tokenizer()
    prompt = "3 plus 4 is"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    whole = tokenizer(prompt + " 7.", add_special_tokens=False)["input_ids"]
    assert whole[: len(prompt_ids)] == prompt_ids and tokenizer.decode(whole[len(prompt_ids) :]) == "7."
    pad = tokenizer.convert_tokens_to_ids("</s>")  # a batch's left padding (special: not decoded)
    sequences = torch.tensor([[pad, *whole], [*whole[:1], *whole]])
    completions = decode_continuations(tokenizer, sequences, len(prompt_ids) + 1)
    assert completions[0] == " 7."
    assert tokenizer(prompt + completions[0], add_special_tokens=False)["input_ids"] == whole
    assert completions[1] == " 7."  # another prompt ("3 3 plus 4 is"), the same continuation


def test_generate_tells_a_completion_cut_by_the_budget_from_one_that_ended():
    """`details`: a completion that met a stop token ended; one that ran into
    max_new_tokens did not (a round never keeps it: its text stops mid-solution). The
    tokens generated count the stop token, and nothing after it."""
    from rlhf.models.generation import generate

    tokenizer = build_tokenizer()
    model = build_tiny_model("micro", tokenizer, seed=0)
    prompts = ["1+2+3\n", "4+5\n", "6-1\n", "7+7+7\n"]
    drawn = generate(model, tokenizer, prompts, 1, do_sample=True, num_return_sequences=4, seed=0, details=True)
    assert len(drawn.finished) == len(drawn.texts) == len(drawn.tokens) == 16
    assert drawn.finished == [text == "" for text in drawn.texts], "one token each: ended only where it was the EOS"
    assert not all(drawn.finished) and drawn.tokens == [1] * 16
    model.generation_config.eos_token_id = list(range(len(tokenizer)))  # every token ends a completion
    drawn = generate(model, tokenizer, prompts, 5, do_sample=True, seed=0, details=True)
    assert all(drawn.finished) and all(len(text) <= 1 for text in drawn.texts) and drawn.tokens == [1] * 4


def test_greedy_batches_are_formed_by_prompt_length_and_answered_in_order():
    """Prompts long, short, long, short at 2 a batch: greedy decoding batches the two short
    ones together and the two long ones together (each batch padded to its own longest
    row, not every batch to a long one), and returns every completion, with its details,
    where its prompt was: the same texts as decoding each prompt alone. Sampled batches
    keep the caller's order (a seed's draws go by row position)."""
    from rlhf.models.generation import format_prompt, generate

    tokenizer = build_tokenizer()
    model = build_tiny_model("micro", tokenizer, seed=0)
    prompts = ["12+13+14+15+16+17\n", "4+5\n", "21-1-1-1-1-1-1\n", "6-1\n"]
    width = [len(tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts]
    widths = []
    plain_generate = model.generate

    def recording(**batch):
        widths.append(batch["input_ids"].shape[1])
        return plain_generate(**batch)

    model.generate = recording
    alone = [generate(model, tokenizer, [p], 12, details=True) for p in prompts]
    widths.clear()
    together = generate(model, tokenizer, prompts, 12, batch_size=2, details=True)
    assert widths == [max(width[1], width[3]), max(width[0], width[2])] and width[1] < width[2]
    assert together.texts == [a.texts[0] for a in alone] and together.tokens == [a.tokens[0] for a in alone]
    assert together.finished == [a.finished[0] for a in alone]
    widths.clear()
    generate(model, tokenizer, prompts, 4, batch_size=2, do_sample=True, seed=0)
    assert widths == [max(width[:2]), max(width[2:])]


def test_published_weights_cut_short_are_named_with_how_to_restore_them(tmp_path):
    """A published model.safetensors cut short (a kill mid-copy, a full disk) failed inside
    transformers with a bare SafetensorError; it is named before anything loads, with the
    command that restores a pipeline output."""
    import pytest

    from rlhf.models.folders import UnusableModelError
    from rlhf.models.loading import build_tiny_model, build_tokenizer, load_causal_lm, save_model

    tokenizer = build_tokenizer()
    folder = tmp_path / "models/sft"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(UnusableModelError) as error:
        load_causal_lm(folder, what="models/sft")
    message = str(error.value)
    assert "model.safetensors" in message and "truncated" in message and f"dvc checkout {folder.as_posix()}" in message


@pytest.mark.parametrize("kind", ["micro", "gpt2", "qwen2-lora"])
def test_a_used_model_is_freed_by_reference_counting_alone(kind, tmp_path):
    """A stage's process freezes its imported objects out of the cyclic collector's sight
    (rlhf.models.compute.freeze_startup_objects): that is safe because a model that was
    loaded, run forward, backward and through generate holds no reference cycle, so
    dropping it frees it with the collector off."""
    import gc
    import weakref

    from peft import get_peft_model

    from rlhf.training.params import LoraParams

    if kind == "micro":  # as the stages load it, from its folder
        tokenizer = build_tokenizer()
        save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, tmp_path / "m")
        model = load_causal_lm(tmp_path / "m")
    else:
        model = other_architecture(kind.split("-")[0])
        if kind.endswith("lora"):
            model = get_peft_model(model, LoraParams(enabled=True, r=4).peft_config())
    ids = torch.randint(3, 60, (2, 8))
    gc.disable()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        alive, weight = weakref.ref(model), weakref.ref(next(model.parameters()))
        del model
        assert alive() is None and weight() is None, "the model outlived its last reference"
    finally:
        gc.enable()
