"""Recipes for real models (configs/recipes/*.yaml): each merges into params.yaml and passes
the params check; applying one keeps params.yaml's other keys and comments, and one that
does not validate leaves params.yaml as it was."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from rlhf.recipes import RECIPES_DIR, apply, merged_text, recipe_names
from tests.conftest import REPO

RECIPES = recipe_names()


def test_there_are_recipes_for_the_models_people_train():
    assert {
        "qwen2.5-0.5b-gsm8k",
        "llama3.2-1b-qlora-ultrafeedback",
        "llama3.1-8b-qlora-dpo-24gb",
        "qwen2.5-1.5b-grpo-vllm-4gpu",
    } <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_passes_the_params_check_and_names_its_gpu_memory(name, tmp_path):
    import stages

    recipe = RECIPES_DIR / f"{name}.yaml"
    header = [line for line in recipe.read_text().splitlines() if line.startswith("#")]
    assert any(line.startswith("# GPU memory: about ") for line in header), "a recipe says what GPU it needs"
    assert any(f"python -m rlhf.recipes apply {name}" in line for line in header), "and how to use it"
    merged = tmp_path / "params.yaml"
    merged.write_text(merged_text((REPO / "params.yaml").read_text(), recipe.read_text()))
    params = stages.load_all(str(merged))
    overlay = yaml.safe_load(recipe.read_text())
    assert params["base"].model == overlay["base"]["model"]
    for section, values in overlay.items():  # every key of the recipe is in force
        for key, value in values.items():
            if not isinstance(value, dict):
                got = getattr(params[section], key)
                assert (list(got) if isinstance(got, tuple) else got) == value or hasattr(got, "model_dump"), key


@pytest.mark.slow  # seconds (a DVC repo, stage processes or training): out of the quick tier
def test_apply_merges_keeps_comments_and_refuses_what_does_not_validate(tmp_path):
    """Applying a recipe changes the keys it names, keeps every other key and the file's
    comments; a recipe whose merge does not validate changes nothing and says why, by key."""
    params = tmp_path / "params.yaml"
    original = (REPO / "params.yaml").read_text()
    params.write_text(original)
    diff = apply("qwen2.5-0.5b-gsm8k", params)
    assert "+  kind: gsm8k" in diff
    after = params.read_text()
    assert "# how answers are read and checked" in after and "infer:" in after
    data = yaml.safe_load(after)
    assert data["base"]["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and data["base"]["revision"] is None
    assert data["verifier"]["per_device_train_batch_size"] == 8 and data["rm"]["kind"] == "likelihood"  # kept
    assert data["policy"]["dpo"]["beta"] == 0.1  # a method the recipe does not train keeps its section

    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  learning_rate: 2.0\n  lora: {enabled: true, rank: 8}\n")
    params.write_text(original)
    with pytest.raises(SystemExit) as error:
        apply(str(bad), params)
    message = str(error.value)
    assert "bad.yaml merged into" in message and "nothing changed" in message
    assert "sft.learning_rate: Input should be less than 1" in message and "sft.lora.rank: unknown key" in message
    assert params.read_text() == original


def test_the_command_lists_the_recipes():
    out = subprocess.run([sys.executable, "-m", "rlhf.recipes", "list"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()] == RECIPES


def test_the_8b_recipe_mends_llamas_template_that_trl_cannot_mark(tmp_path):
    """TRL 1.16 trains on the assistant's turns through {% generation %} markers and can add
    them to Llama 3's template, not to Llama 3.1's (the one Llama-3.1-8B-Instruct ships):
    SFT refuses that template before loading the model. The 8B recipe puts TRL's Llama 3
    training template on the tokenizer (base.chat_template: llama3), which SFT accepts."""
    from rlhf.models.loading import build_tokenizer
    from rlhf.models.templates import apply_template, read_template, trl_templates_dir
    from rlhf.training.methods.sft import SFTDataError, check_assistant_masking

    shipped = build_tokenizer()
    shipped.chat_template = (trl_templates_dir() / "llama3_1.jinja").read_text()
    with pytest.raises(SFTDataError, match=r"sft\.loss_on: completion .* TRL cannot patch it"):
        check_assistant_masking(shipped, "sft", tmp_path)
    recipe = yaml.safe_load((RECIPES_DIR / "llama3.1-8b-qlora-dpo-24gb.yaml").read_text())
    assert recipe["base"]["chat_template"] == "llama3" and recipe["sft"].get("loss_on", "completion") == "completion"
    mended = build_tokenizer()
    apply_template(mended, read_template(recipe["base"]["chat_template"]))
    check_assistant_masking(mended, "sft", tmp_path)
    turn = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    text = mended.apply_chat_template(turn, tokenize=False)
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n2<|eot_id|>" in text
