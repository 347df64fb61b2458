"""`base.chat_template`: a base model without a chat template takes conversational data.

The user's model is a tiny Qwen2 with the built-in character tokenizer stripped of its chat
template (a base model, as Llama-3.2-1B or Mistral-7B-v0.1 ship). SFT on conversations
refuses it; with `base.chat_template: chatml` stage base adds ChatML's two tokens, resizes
the embeddings (models/base becomes a copy), and SFT trains on the assistant turns; the
SFT model carries the template and its end-of-turn EOS. A template whose tokens the
vocabulary has keeps models/base a pointer, with the tokenizer beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_OVERRIDES, deep_update, make_project, params_problems, tiny_params

QUESTIONS = [(a, b) for a in range(1, 10) for b in range(1, 10)]


def base_model(path: Path) -> Path:
    """A tiny Qwen2 whose tokenizer has no chat template, saved as a user would."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.models.loading import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def chat_project(tmp_path: Path, template: str | None) -> Path:
    root = tmp_path / "project"
    params = yaml.safe_load((Path(__file__).parent.parent / "params.yaml").read_text())
    deep_update(params, {k: v for k, v in TINY_OVERRIDES.items() if k not in ("prepare", "base")})
    deep_update(
        params,
        {
            "task": {"kind": "last_number"},
            "prepare": {
                "source": "files",
                "files": {"sft": {"path": "data/raw/chat.jsonl"}, "eval_heldout": {"path": "data/raw/heldout.jsonl"}},
            },
            "base": {"model": str(base_model(tmp_path / "user-model")), "chat_template": template},
            "policy": {"offline": [], "online": ["grpo"], "grpo": {"rewards": [{"name": "answer_match"}]}},
        },
    )
    make_project(root, params)
    raw = root / "data/raw"
    with open(raw / "chat.jsonl", "w") as file:
        for a, b in QUESTIONS * 2:
            turns = [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
            file.write(json.dumps({"messages": turns}) + "\n")
    with open(raw / "heldout.jsonl", "w") as file:
        for a, b in QUESTIONS[::9]:
            file.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}) + "\n")
    return root


def run_stages(root: Path, monkeypatch, *names: str) -> None:
    import importlib

    monkeypatch.chdir(root)
    for name in names:
        importlib.import_module(f"stages.{name}").main()


@pytest.mark.slow
def test_chatml_on_a_base_model_trains_on_conversations(tmp_path, monkeypatch, mlflow_store):
    from rlhf.models.generation import format_prompt
    from rlhf.models.loading import load_tokenizer
    from rlhf.training.methods.sft import SFTDataError

    root = chat_project(tmp_path, None)
    with pytest.raises(SFTDataError, match="has no chat template: add one"):
        run_stages(root, monkeypatch, "prepare", "base", "sft")

    root = chat_project(tmp_path / "with", "chatml")
    run_stages(root, monkeypatch, "prepare", "base", "sft")
    base = root / "models/base"
    assert not (base / "pointer.json").exists(), "new tokens: a copy of the model, not a pointer"
    tokenizer = load_tokenizer(base)
    config = json.loads((base / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == len(load_tokenizer(tmp_path / "with/user-model")) + 2
    assert tokenizer.eos_token == "<|im_end|>"
    sft = load_tokenizer(root / "models/sft")
    assert (root / "models/sft/chat_template.jinja").is_file() and sft.eos_token == "<|im_end|>"
    assert (
        format_prompt(sft, [{"role": "user", "content": "1+2?"}])
        == "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    metrics = json.loads((root / "metrics/sft.json").read_text())
    assert metrics["steps"] == TINY_OVERRIDES["sft"]["max_steps"] and metrics["dropped_rows"] == 0


@pytest.mark.slow
def test_a_template_on_known_tokens_keeps_the_pointer(tmp_path, monkeypatch, mlflow_store):
    """A template file written in tokens the vocabulary has: models/base stays a pointer to
    the user's folder (no copy), with the tokenizer that carries the template beside it."""
    from rlhf.models.loading import load_tokenizer

    template = tmp_path / "mine.jinja"
    template.write_text(
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|end|>' }}{% endgeneration %}"
        "{% else %}{{ m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    root = chat_project(tmp_path, str(template))
    run_stages(root, monkeypatch, "prepare", "base", "sft")
    base = root / "models/base"
    pointer = json.loads((base / "pointer.json").read_text())
    assert pointer["path"] == str((tmp_path / "user-model").resolve())
    tokenizer = load_tokenizer(base)
    assert tokenizer.chat_template == template.read_text() and tokenizer.eos_token == "<|end|>"
    assert not load_tokenizer(tmp_path / "user-model").chat_template  # the user's folder is not touched
    assert (root / "models/sft/chat_template.jinja").read_text() == template.read_text()


def test_a_template_that_is_not_there_and_one_for_the_builtin_model_are_named(tmp_path):
    params = tiny_params(base={"model": "builtin:micro", "chat_template": "chatml"})
    assert any(
        p.startswith("base: chat_template: not read by a built-in model (it has its own template)")
        for p in params_problems(tmp_path, params)
    )
    params = tiny_params()
    params["base"] = {"model": str(tmp_path), "chat_template": "chatmll"}
    (tmp_path / "config.json").write_text("{}")
    found = params_problems(tmp_path, params)
    assert any(p.startswith("base.chat_template: unknown chat template 'chatmll': name one of chatml,") for p in found)
    assert any("llama3" in p and "qwen2_5" in p for p in found)  # TRL's templates are named too


def test_text_rows_become_conversations_for_an_instruct_model(tmp_path):
    """prepare.files.<name>.chat: a text prompt becomes one user turn and each text
    response one assistant turn (TRL's conversational format), in every contract; the
    answers an eval suite carries stay as they were."""
    import stages.prepare
    from rlhf.tasks import TaskConfig, get_task

    (tmp_path / "sft.jsonl").write_text(json.dumps({"question": "2+3?", "solution": "#### 5"}) + "\n")
    pairs = [{"prompt": f"2+{b}?", "chosen": str(2 + b), "rejected": "6"} for b in (3, 5, 6, 7)]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    (tmp_path / "dev.jsonl").write_text(json.dumps({"prompt": "4+4?", "answer": "8"}) + "\n")
    files = {
        "sft": {
            "path": str(tmp_path / "sft.jsonl"),
            "chat": True,
            "columns": {"prompt": "question", "completion": "solution"},
        },
        "prefs": {"path": str(tmp_path / "prefs.jsonl"), "chat": True},
        "eval_dev": {"path": str(tmp_path / "dev.jsonl"), "chat": True},
    }
    config = stages.prepare.Config(source="files", files=files)
    tables, _ = stages.prepare.run(config, get_task(TaskConfig(kind="gsm8k")))
    user, assistant = (
        (lambda text: [{"role": "user", "content": text}]),
        (lambda text: [{"role": "assistant", "content": text}]),
    )
    assert list(tables["sft"]["prompt"].iloc[0]) == user("2+3?")
    assert list(tables["sft"]["completion"].iloc[0]) == assistant("#### 5")
    pair = tables["prefs"].iloc[0]
    assert list(pair["prompt"])[0]["role"] == "user" and list(pair["rejected"]) == assistant("6")
    dev = tables["eval_dev"].iloc[0]
    assert list(dev["prompt"]) == user("4+4?") and dev["answer"] == "8"
