"""The context compressor (rlhf/models/compressor.py), its training (rlhf/training/compress.py,
stage compress), the long-context word problems (rlhf/tasks/long_context.py) and the
readings evaluate scores them in (rlhf/evaluation/contexts.py)."""

from __future__ import annotations

import random
import re

import pandas as pd
import pytest
import torch

from rlhf.models.compressor import CompressorError, CompressorMismatchError, ContextCompressor, check_settings
from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model
from rlhf.tasks.long_context import joined, short_context, split_question, with_context
from rlhf.tasks.story_words import NAMES, THINGS
from rlhf.tasks.word_problems import WordProblemSizes, generate_datasets, sample_problem

SMALL = WordProblemSizes(sft=20, prefs=8, prefs_eval=4, unpaired=4, prm=4, prm_eval=4, prompts=4, eval_dev=12,
                         eval_test=6, eval_test_unseen=4, compress=24)  # fmt: skip


def test_a_long_context_hides_the_facts_among_distractors_about_others():
    rng = random.Random(0)
    for _ in range(50):
        problem = sample_problem(rng)
        row = with_context(problem.question, rng, 1000)
        facts, question = split_question(problem.question)
        assert len(row["context"]) >= 1000 and row["prompt"] == question
        assert row["relevant"] == " ".join(facts) and row["relevant"] in row["context"]
        # No distractor speaks of the problem's people or things: the question has one answer.
        rest = row["context"].replace(row["relevant"], "")
        mentioned = [w for w in NAMES + tuple(t for t, _ in THINGS) if re.search(rf"\b{w}\b", problem.question)]
        assert mentioned and not any(re.search(rf"\b{w}\b", rest) for w in mentioned), (problem.question, rest)
        assert sum(c.isdigit() for c in rest) > 20, "distractors carry numbers too"
    short = short_context(problem.question, rng)
    assert short.endswith(question) and all(f in short for f in facts)


def test_the_long_context_variant_leaves_the_plain_word_problems_as_they_were():
    plain = generate_datasets(SMALL, seed=3)
    again = generate_datasets(SMALL, seed=3)
    assert plain == again and "compress" not in plain and "context" not in plain["eval_dev"][0]
    long = generate_datasets(SMALL, seed=3, context_chars=400)
    assert set(long) == set(plain) | {"compress"} and len(long["compress"]) == 24
    row = long["eval_dev"][0]
    assert set(row) == {"context", "prompt", "relevant", "answer", "difficulty"} and len(row["context"]) >= 400
    assert set(long["compress"][0]) == {"context", "prompt", "relevant", "completion"}
    assert long["compress"][0]["completion"].splitlines()[-1].startswith("#### ")
    # The training tables read the facts and the question in the long-context format.
    assert all(joined("", "") in r["prompt"] for r in long["sft"])


def test_the_window_reading_keeps_the_end_of_the_context_and_the_whole_question():
    from rlhf.evaluation.contexts import cut_to_window, readings
    from rlhf.models.generation import format_prompt

    tokenizer = build_tokenizer()
    context = " ".join(f"Sentence {i} is here." for i in range(100))
    prompt = [{"role": "user", "content": "How many?"}]
    cut = cut_to_window(tokenizer, context, prompt, budget=120)
    text = cut[0]["content"]
    length = len(tokenizer(format_prompt(tokenizer, cut), add_special_tokens=False)["input_ids"])
    assert length == 120 and text.endswith(joined("Sentence 99 is here.", "How many?"))
    assert "Sentence 0 " not in text
    suite = pd.DataFrame(
        {"context": [context], "prompt": [prompt], "relevant": ["Sentence 7 is here."], "answer": ["1"]}
    )
    views = readings(suite, tokenizer, 120)
    assert views[""]["prompt"][0] == cut
    assert views["/relevant"]["prompt"][0][0]["content"] == joined("Sentence 7 is here.", "How many?")


@pytest.fixture
def micro():
    tokenizer = build_tokenizer()
    return build_tiny_model("micro", tokenizer, seed=0), tokenizer


def test_bad_settings_fail_naming_the_key():
    with pytest.raises(
        CompressorError, match=r"compress.tokens \(32\) is not smaller than compress.chunk_tokens \(32\)"
    ):
        check_settings(32, 32, 256)
    with pytest.raises(CompressorError, match=r"compress.chunk_tokens \+ compress.tokens \(250 \+ 10\) exceeds"):
        check_settings(10, 250, 256)
    check_settings(8, 64, 256)


def test_a_crop_keeps_the_relevant_sentences_and_as_many_around_them_as_asked():
    from rlhf.tasks.long_context import cropped
    from rlhf.training.compress import with_crops

    context, relevant = "A b. C d. The facts. More facts. E f. G h. I j.", "The facts. More facts."
    rng = random.Random(0)
    for extra in range(8):
        crop = cropped(context, relevant, extra, rng)
        assert relevant in crop and crop in context, crop
        assert crop.count(".") == 2 + min(extra, 5)
    assert cropped(context, "not in it", 2, rng) == context
    rows = pd.DataFrame(
        {"context": [context] * 2, "prompt": ["Q?"] * 2, "completion": ["1"] * 2, "relevant": [relevant] * 2}
    )
    grown = with_crops(rows, [0, 2], seed=0)
    assert len(grown) == 6 and (grown["context"] == relevant).sum() == 2 and (grown["context"] == context).sum() == 2


def test_crops_and_recite_without_relevant_sentences_fail_before_training(tmp_path):
    from stages.compress import Config, run

    data = tmp_path / "compress.parquet"
    pd.DataFrame({"context": ["A long text."], "prompt": ["Q?"], "completion": ["1"]}).to_parquet(data)
    asks = (
        ({"crops": [0]}, "compress.crops"),
        ({"recite": 1.0}, "compress.recite"),
        ({"select": 1}, "compress.select"),
    )
    for settings, key in asks:
        with pytest.raises(
            CompressorError,
            match=rf"{re.escape(key)} read each row's relevant sentences, and .*compress.parquet has no `relevant` column",
        ):
            run(Config(enabled=True, **settings), tmp_path / "no-model", data, tmp_path / "out")


def test_slots_replace_chunks_and_save_and_load_with_the_model_they_serve(micro, tmp_path):
    model, tokenizer = micro
    compressor = ContextCompressor.new(model, tokens=4, chunk_tokens=16, served_path="models/sft", window=256)
    contexts = ["x" * 40, "y" * 10]
    slots, mask = compressor.compress_prompts(tokenizer, contexts)
    # 40 tokens: 3 chunks of 16 (the last part padding), 4 slots each; 10 tokens: one chunk.
    assert slots.shape == (2, 12, model.config.hidden_size)
    assert mask.tolist() == [[1] * 12, [1] * 4 + [0] * 8] and compressor.context_slots(tokenizer, contexts) == [12, 4]
    compressor.save_pretrained(tmp_path / "k4")
    again = ContextCompressor.from_pretrained(tmp_path / "k4", build_tiny_model("micro", tokenizer, seed=0))
    assert torch.allclose(again.compress_prompts(tokenizer, contexts)[0], slots, atol=1e-6)
    # A checkpoint resumes through `load_trained`: the trained parts into a fresh compressor.
    fresh = ContextCompressor.new(build_tiny_model("micro", tokenizer, seed=0), 4, 16, "models/sft", seed=5)
    assert not torch.allclose(fresh.compress_prompts(tokenizer, contexts)[0], slots, atol=1e-6)
    fresh.load_trained(tmp_path / "k4")
    assert torch.allclose(fresh.compress_prompts(tokenizer, contexts)[0], slots, atol=1e-6)
    with pytest.raises(CompressorMismatchError, match="was trained for the model in models/sft"):
        ContextCompressor.from_pretrained(tmp_path / "k4", build_tiny_model("micro", tokenizer, seed=1))
    with pytest.raises(CompressorError, match="holds no context compressor"):
        ContextCompressor.from_pretrained(tmp_path, model)


def test_a_compressor_serves_its_checkpoint_however_the_reader_loads_it(micro, tmp_path, monkeypatch):
    """The fingerprint is of the served checkpoint as stored: a reader that loads the same
    folder in bfloat16 (an evaluate block's own `model.dtype`, or a GPU's compute dtype) gets
    the compressor; another checkpoint is refused, and a compressor saved with a fingerprint
    of the weights (before this one existed) still loads on the model it names."""
    import json

    import rlhf.models.compute as compute
    from rlhf.models.loading import load_causal_lm

    model, tokenizer = micro
    save_model(model, tokenizer, tmp_path / "sft")
    save_model(build_tiny_model("micro", tokenizer, seed=1), tokenizer, tmp_path / "other")
    ContextCompressor.new(load_causal_lm(tmp_path / "sft"), 4, 16, str(tmp_path / "sft")).save_pretrained(
        tmp_path / "k4"
    )
    assert json.loads((tmp_path / "k4/compressor_config.json").read_text())["served"]["fingerprint_of"] == "checkpoint"
    monkeypatch.setattr(compute, "_current", compute.Placement("cpu", "bfloat16"))
    reader = load_causal_lm(tmp_path / "sft")
    assert reader.dtype == torch.bfloat16
    assert ContextCompressor.from_pretrained(tmp_path / "k4", reader).compress_prompts(tokenizer, ["x" * 40])[0].shape
    with pytest.raises(CompressorMismatchError, match="was trained for the model in"):
        ContextCompressor.from_pretrained(tmp_path / "k4", load_causal_lm(tmp_path / "other"))
    monkeypatch.undo()
    config = json.loads((tmp_path / "k4/compressor_config.json").read_text())
    old = ContextCompressor.new(build_tiny_model("micro", tokenizer, seed=0), 4, 16, "m")
    config["served"] = {k: v for k, v in old.served.items() if k != "fingerprint_of"}  # as saved before
    (tmp_path / "k4/compressor_config.json").write_text(json.dumps(config))
    ContextCompressor.from_pretrained(tmp_path / "k4", load_causal_lm(tmp_path / "sft"))


def test_the_checkpoint_fingerprint_reads_scalars_and_short_rows_and_tells_values_apart(tmp_path):
    """safetensors allows 0-d tensors (a scale, a step count): the fingerprint reads them,
    and rows shorter than its 64 values, and changes when a stored value does."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from rlhf.models.folders import fingerprint

    weights = {"scale": torch.tensor(0.5), "bias": torch.arange(3.0), "w": torch.ones(2, 100)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    first, way = fingerprint(SimpleNamespace(name_or_path=str(tmp_path)))
    assert way == "checkpoint"
    save_file({**weights, "scale": torch.tensor(0.25)}, str(tmp_path / "model.safetensors"))
    assert fingerprint(SimpleNamespace(name_or_path=str(tmp_path)))[0] != first


def test_sentence_chunks_hold_whole_sentences_so_a_fact_sits_in_one_chunk(micro, tmp_path):
    """`chunk_by: sentences` packs as many whole sentences into a chunk as fit and cuts a
    longer sentence every `chunk_tokens`; the chunks are laid out at multiples of
    `chunk_tokens`, the labels of `select` follow them, and the setting saves and loads."""
    from rlhf.models.compressor import chunk_spans, relevant_chunks

    model, tokenizer = micro  # a character a token
    text = "Aaaa bbb. Cc dd eee. The code is 41. " + "F" * 40 + "."
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert text.index("Cc") == 10 and text.index("The") == 21 and text.index("F") == 37 and len(text) == 78
    assert chunk_spans(text, offsets, 16) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 78)]
    assert chunk_spans(text, offsets, 16, "sentences") == [(0, 10), (10, 21), (21, 37), (37, 53), (53, 69), (69, 78)]
    assert chunk_spans("", [], 16, "sentences") == [(0, 0)]
    # By tokens the fact is cut over two chunks; by sentences it sits in one.
    assert relevant_chunks(tokenizer, [text], ["The code is 41."], 16) == [[False, True, True, False, False]]
    assert relevant_chunks(tokenizer, [text], ["The code is 41."], 16, "sentences") == [
        [False, False, True, False, False, False]
    ]
    compressor = ContextCompressor.new(model, 4, 16, "models/sft", window=256, chunk_by="sentences")
    ids, mask = compressor.context_ids(tokenizer, [text, "Short one."])
    assert ids.shape == (2, 6 * 16) and mask[0].reshape(6, 16).sum(-1).tolist() == [10, 11, 16, 16, 16, 9]
    assert tokenizer.decode(ids[0, 32:48]) == "The code is 41. " and mask[1].sum() == 10
    slots, slot_mask = compressor.compress_prompts(tokenizer, [text, "Short one."])
    assert slots.shape == (2, 24, model.config.hidden_size) and slot_mask.sum(-1).tolist() == [24, 4]
    assert compressor.context_slots(tokenizer, [text, "Short one."]) == [24, 4]
    compressor.save_pretrained(tmp_path / "k4")
    again = ContextCompressor.from_pretrained(tmp_path / "k4", build_tiny_model("micro", tokenizer, seed=0))
    assert again.chunk_by == "sentences"
    assert torch.allclose(again.compress_prompts(tokenizer, [text])[0], slots[:1], atol=1e-6)
    # Byte-level BPE (GPT-2, Llama 3, Qwen2) puts the space before a sentence in its first
    # token, " The" at (7, 11) after "Aaa bb." : that token opens the sentence's chunk.
    text = "Aaa bb. The code is 41. Foo bar."
    bpe = [(0, 3), (3, 6), (6, 7), (7, 11), (11, 16), (16, 19), (19, 22), (22, 23), (23, 27), (27, 31), (31, 32)]
    assert [text[bpe[a][0] : bpe[b - 1][1]] for a, b in chunk_spans(text, bpe, 6, "sentences")] == [
        "Aaa bb.",
        " The code is 41.",
        " Foo bar.",
    ]
    with pytest.raises(CompressorError, match="chunk_by 'words'"):
        ContextCompressor.new(build_tiny_model("micro", tokenizer, seed=0), 4, 16, "m", chunk_by="words")


def test_the_model_reads_each_chunks_slots_at_the_same_positions_in_training_and_generation(micro):
    model, tokenizer = micro
    compressor = ContextCompressor.new(model, tokens=4, chunk_tokens=16, served_path="m", window=256)
    assert compressor.slot_positions == "parallel"
    slots, slot_mask = compressor.compress_prompts(tokenizer, ["x" * 40, "y" * 10])  # 3 chunks (12 slots), 1 (4)
    embeds, mask, positions = compressor.decoder_inputs(slots, slot_mask, [[5, 6, 7], [5, 6]])
    # Parallel: every chunk's slots at 0..3, the prompt from 4; the shorter row left-padded.
    assert positions[0].tolist() == [0, 1, 2, 3] * 3 + [4, 5, 6]
    assert mask[1].tolist() == [0] * 9 + [1] * 6 and positions[1, 9:].tolist() == [0, 1, 2, 3, 4, 5]
    compressor.slot_positions = "sequential"
    assert compressor.decoder_inputs(slots, slot_mask, [[5, 6, 7], [5, 6]])[2][0].tolist() == list(range(15))
    compressor.slot_positions = "parallel"
    # Generation reads the slots at the positions training scored them at.
    prompts = [[{"role": "user", "content": "Code?"}]] * 2
    from rlhf.models.generation import format_prompt

    pieces = [tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts]
    embeds, mask, positions = compressor.decoder_inputs(slots, slot_mask, pieces)
    compressor.slot_positions = "sequential"
    sequential = compressor.decoder_inputs(slots, slot_mask, pieces)[2]
    compressor.slot_positions = "parallel"
    with torch.no_grad(), compressor.reading():
        logits = compressor.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits[:, -1]
        other = compressor.model(inputs_embeds=embeds, attention_mask=mask, position_ids=sequential).logits[:, -1]
    assert not torch.allclose(logits[0], other[0], atol=1e-4), "the slots' positions change what the model reads"
    texts = compressor.generate(tokenizer, ["x" * 40, "y" * 10], prompts, max_new_tokens=1)
    assert texts == [tokenizer.decode([int(i)], skip_special_tokens=True) for i in logits.argmax(-1)]


def test_training_moves_only_the_compressor_and_lowers_the_answers_loss(micro):
    model, tokenizer = micro
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compressor = ContextCompressor.new(model, tokens=4, chunk_tokens=16, served_path="m", window=256)
    rng = random.Random(0)
    rows = [(f"The code is {n}. " + "Filler words here. " * 3, str(n)) for n in (rng.randint(10, 99) for _ in range(8))]
    contexts = [c for c, _ in rows]
    prompts = [[{"role": "user", "content": "Code?"}]] * len(rows)
    answers = [[{"role": "assistant", "content": a}] for _, a in rows]
    trained = [p for p in compressor.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=3e-3)
    first = compressor.loss(tokenizer, contexts, prompts, answers).item()
    for _ in range(25):
        loss = compressor.loss(tokenizer, contexts, prompts, answers)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < first - 0.05, (first, loss.item())  # a frozen random decoder: slots move it a little
    base = compressor.model.get_base_model()
    after = {k.replace("base_layer.", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(before[k], after[k]) for k in before), "the served model's weights are untouched"
    texts = compressor.generate(tokenizer, contexts[:2], prompts[:2], max_new_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def test_a_compressor_of_a_bfloat16_model_trains_its_parts_in_float32(micro):
    """Served in bfloat16 (a GPU's dtype), the model reads bfloat16 slots, while the memory
    embeddings, the slot map and the relevance head stay float32: one Adam step of 1e-3
    moves the slot map's identity (in bfloat16 it rounds away: 0.0078 apart at 1.0)."""
    model, tokenizer = micro
    compressor = ContextCompressor.new(model.to(torch.bfloat16), tokens=4, chunk_tokens=16, served_path="m")
    parts = {"memory": compressor.memory, "proj": compressor.proj.weight, "relevance": compressor.relevance.weight}
    assert {name: p.dtype for name, p in parts.items()} == dict.fromkeys(parts, torch.float32)
    slots, _ = compressor.compress_prompts(tokenizer, ["x" * 40, "y" * 10])
    assert slots.dtype == torch.bfloat16, "the slots enter the model in its dtype"
    diagonal = compressor.proj.weight.diagonal().clone()
    optimizer = torch.optim.Adam([p for p in compressor.parameters() if p.requires_grad], lr=1e-3)
    loss = compressor.loss(tokenizer, ["The code is 42. Filler."] * 2, [[{"role": "user", "content": "Code?"}]] * 2,
                           [[{"role": "assistant", "content": "42"}]] * 2)  # fmt: skip
    loss.backward()
    optimizer.step()
    assert (compressor.proj.weight.diagonal() - diagonal).abs().max() > 5e-4, "the step moved the slot map"


def test_the_encoder_reads_at_most_encode_rows_chunks_a_pass_and_gets_the_same_slots(micro):
    """A batch of long contexts is many chunks (128 contexts of 8,000 tokens: 8,000): the
    encoder reads them `encode_rows` at a time, and the slots are those of one pass."""
    model, tokenizer = micro
    compressor = ContextCompressor.new(model, tokens=4, chunk_tokens=16, served_path="m", window=256)
    contexts = ["x" * 100, "y" * 30, "z" * 70]  # 7 chunks each (padded to the longest): 21 rows
    with torch.no_grad():
        whole, whole_mask = compressor.compress_prompts(tokenizer, contexts)
        passes = []
        body = compressor.model.get_base_model().base_model
        hook = body.register_forward_pre_hook(lambda _, args, kwargs: passes.append(kwargs["inputs_embeds"].shape[0]),
                                              with_kwargs=True)  # fmt: skip
        compressor.encode_rows = 8
        try:
            split, split_mask = compressor.compress_prompts(tokenizer, contexts)
        finally:
            hook.remove()
    assert passes == [8, 8, 5]
    torch.testing.assert_close(split, whole)
    assert torch.equal(split_mask, whole_mask)


def test_relevant_chunks_are_the_chunks_a_relevant_sentence_overlaps(micro):
    """The built-in tokenizer reads a character a token: chunks of 10 characters. "Facts
    here." spans characters 14-24 (chunks 1 and 2), "More." 40-45 (chunk 4); a sentence not
    in the context is refused naming its row."""
    from rlhf.models.compressor import relevant_chunks

    _, tokenizer = micro
    context = "Aaaaaaaa bbbb Facts here. Cccccc dddddd More. Eeeeeeee"
    assert context.index("Facts here.") == 14 and context.index("More.") == 40 and len(context) == 54
    assert relevant_chunks(tokenizer, [context], ["Facts here. More."], 10) == [[False, True, True, False, True, False]]
    with pytest.raises(CompressorError, match=r"row 0: relevant sentence 'Not there.' is not in its context"):
        relevant_chunks(tokenizer, [context], ["Not there."], 10)


@pytest.mark.slow  # seconds (a DVC repo, stage processes or training): out of the quick tier
def test_select_reads_the_best_scored_chunks_and_learns_which_hold_the_facts(micro, tmp_path):
    """select 1: of a context's used chunks, only the best-scored chunk's slots stay on, or
    those `must` marks (training's chunks holding the facts), however many; padding chunks
    never. Trained, the relevance head scores the
    chunk holding each row's fact above the others (it starts at 0 for every chunk), the
    answer loss reads that chunk alone, and the head saves and loads with the compressor."""
    model, tokenizer = micro
    compressor = ContextCompressor.new(model, tokens=2, chunk_tokens=16, served_path="m", window=256, select=1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    scores = torch.tensor([[0.1, 2.0, -1.0], [-5.0, 9.0, 9.0]])
    assert compressor.selected(mask, scores).tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    must = torch.tensor([[True, False, True], [False, True, False]])  # row 1's chunk 1 is padding
    assert compressor.selected(mask, scores, must).tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    must = torch.tensor([[False, False, True], [False, False, False]])
    assert compressor.selected(mask, scores, must).tolist() == [[0, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert compressor.context_slots(tokenizer, ["x" * 40, "y" * 10, ""]) == [2, 2, 0]
    rng = random.Random(0)
    filler = ["Filler words here. ", "Other words there. ", "More filler words. "]
    rows = []
    for n in (rng.randint(10, 99) for _ in range(8)):
        sentences = filler[:]
        sentences.insert(rng.randint(0, 3), f"The code is {n}. ")
        rows.append(("".join(sentences)[:-1], f"The code is {n}.", str(n)))
    contexts, relevant = [c for c, _, _ in rows], [r for _, r, _ in rows]
    prompts = [[{"role": "user", "content": "Code?"}]] * len(rows)
    answers = [[{"role": "assistant", "content": a}] for *_, a in rows]
    optimizer = torch.optim.Adam([p for p in compressor.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(40):
        loss = compressor.loss(tokenizer, contexts, prompts, answers, relevant)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    from rlhf.models.compressor import relevant_chunks

    labels = torch.tensor(
        [row + [False] * (5 - len(row)) for row in relevant_chunks(tokenizer, contexts, relevant, 16)]
    )
    with torch.no_grad():
        _, slot_mask, scores = compressor.compress_prompts(tokenizer, contexts, prompts, scores=True)
    used = slot_mask[:, ::2].bool()
    assert scores[labels].min() > scores[used & ~labels].max(), (scores, labels)
    compressor.save_pretrained(tmp_path / "k2")
    again = ContextCompressor.from_pretrained(tmp_path / "k2", build_tiny_model("micro", tokenizer, seed=0))
    assert again.select == 1 and torch.equal(again.relevance.weight, compressor.relevance.weight)
    with pytest.raises(CompressorError, match="compress.select trains on each row's `relevant` sentences"):
        compressor.loss(tokenizer, contexts, prompts, answers)


def test_select_back_propagates_through_the_chunks_it_reads_and_the_best_scored_only(micro):
    """With `select`, training encodes every chunk once without gradients (to score it) and
    again with gradients only the chunks read, the best-scored and one drawn per row: the
    loss has the value that encoding every chunk with gradients gives, and its gradient
    reaches the encoder through those chunks alone."""
    from rlhf.models.compressor import relevant_chunks

    model, tokenizer = micro
    compressor = ContextCompressor.new(model, tokens=2, chunk_tokens=16, served_path="m", window=256, select=1)
    torch.manual_seed(0)
    torch.nn.init.normal_(compressor.relevance.weight, std=0.5)
    filler = "Filler words here. Other words there. More filler words. Yet more words. "
    contexts = [filler + "The code is 41.", "The code is 7. " + filler, filler[:40] + " The code is 3. " + filler]
    relevant = ["The code is 41.", "The code is 7.", "The code is 3."]
    prompts = [[{"role": "user", "content": "Code?"}]] * 3
    answers = [[{"role": "assistant", "content": a}] for a in ("41", "7", "3")]
    body = compressor.model.get_base_model().base_model
    passes = []
    hook = body.register_forward_hook(
        lambda module, args, kwargs, out: passes.append((kwargs["inputs_embeds"].shape[0], torch.is_grad_enabled())),
        with_kwargs=True,
    )
    loss = compressor.loss(tokenizer, contexts, prompts, answers, relevant)
    hook.remove()
    # The reference: every chunk encoded with gradients, then the same reading.
    reference = compressor.loss(tokenizer, contexts, prompts, answers, relevant, every_chunk=True)
    assert torch.allclose(loss, reference, atol=1e-5), (loss, reference)
    slots, slot_mask, scores = compressor.compress_prompts(tokenizer, contexts, prompts, scores=True)
    labels = torch.zeros_like(scores)
    for row, chunks in enumerate(relevant_chunks(tokenizer, contexts, relevant, 16)):
        labels[row, : len(chunks)] = torch.tensor(chunks, dtype=labels.dtype)
    used = slot_mask[:, ::2].bool()
    read = compressor.selected(slot_mask, scores, must=labels.bool())
    best = compressor.selected(slot_mask, scores)
    chunks = used.numel()
    picked = int((read[:, ::2].bool() | best[:, ::2].bool()).sum())
    # The encoder's two passes (all chunks without gradients, the picked with), then the decoder's.
    assert passes[0] == (chunks, False) and passes[1][1] and passes[2] == (3, True), passes
    assert picked <= passes[1][0] <= picked + 3 and passes[1][0] < int(used.sum()), (passes, picked)
    loss.backward()
    adapter = [p for n, p in compressor.named_parameters() if "lora_B" in n]
    assert compressor.relevance.weight.grad.abs().sum() > 0 and all(p.grad is not None for p in adapter)
    # The selection loss alone reaches the encoder too, through the chunks encoded again.
    compressor.zero_grad()
    compressor._selected_slots(tokenizer, contexts, prompts, relevant)[2].backward()
    assert sum(float(p.grad.abs().sum()) for p in adapter if p.grad is not None) > 0


def stage_inputs(tmp_path):
    """(models/sft: the untrained micro model, a compress table of conversations) in `tmp_path`."""
    tokenizer = build_tokenizer()
    serve = tmp_path / "models/sft"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, serve)
    rows = generate_datasets(SMALL, seed=0, context_chars=60)["compress"]
    data = tmp_path / "compress.parquet"
    pd.DataFrame(rows).assign(prompt=lambda f: f["prompt"].map(lambda p: [{"role": "user", "content": p}]),
                              completion=lambda f: f["completion"].map(
                                  lambda c: [{"role": "assistant", "content": c}])).to_parquet(data)  # fmt: skip
    return serve, data


@pytest.mark.slow
def test_the_stage_trains_a_compressor_under_model_gradient_checkpointing(tmp_path, monkeypatch, mlflow_store):
    """Stage compress with params model.gradient_checkpointing (a big model's memory
    setting): the Trainer's checkpointing call reaches the served model, and the run ends
    with a trained compressor (it failed with an AttributeError)."""
    from stages.compress import Config, run

    serve, data = stage_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    config = Config(enabled=True, tokens=[4], chunk_tokens=16, max_steps=2, save_steps=2, logging_steps=1, select=1,
                    per_device_train_batch_size=4, model={"gradient_checkpointing": True})  # fmt: skip
    metrics, curve = run(config, serve, data, tmp_path / "out")
    assert len(curve) == 2 and metrics["compressors"]["k4"]["final_loss"] is not None
    assert (tmp_path / "out/k4/compressor_config.json").is_file()


@pytest.mark.slow
def test_the_stage_trains_and_saves_a_compressor_that_loads_back(tmp_path, monkeypatch, mlflow_store):
    """stages.compress.run: transformers' Trainer over the rows, into a folder
    `from_pretrained` reads."""
    from stages.compress import Config, run

    serve, data = stage_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    config = Config(enabled=True, tokens=[4], chunk_tokens=16, max_steps=4, save_steps=2, logging_steps=1,
                    per_device_train_batch_size=4)  # fmt: skip
    metrics, curve = run(config, serve, data, tmp_path / "out")
    assert metrics["compressors"]["k4"]["ratio"] == 4 and len(curve) == 4
    from rlhf.models.loading import load_causal_lm

    loaded = ContextCompressor.from_pretrained(tmp_path / "out/k4", load_causal_lm(serve))
    assert loaded.tokens == 4 and loaded.chunk_tokens == 16
    untrained = ContextCompressor.new(load_causal_lm(serve), 4, 16, "x")
    assert not torch.equal(loaded.memory, untrained.memory), "the memory embeddings trained"


@pytest.mark.slow
def test_a_killed_compress_run_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_one(
    tmp_path, monkeypatch, mlflow_store, capsys
):
    """A run stopped after step 3 (checkpoint at step 2) resumes from checkpoint-2 and ends
    with the weights of a run never stopped: the Trainer's resume, through the compressor's
    own `save_pretrained` and `load_trained`."""
    from transformers import TrainerCallback

    import rlhf.training.trainer_setup as trainer_setup
    from rlhf.models.loading import load_causal_lm
    from stages.compress import Config, run

    tokenizer = build_tokenizer()
    serve = tmp_path / "models/sft"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, serve)
    rows = generate_datasets(SMALL, seed=0, context_chars=60)["compress"]
    data = tmp_path / "compress.parquet"
    pd.DataFrame(rows)[["context", "prompt", "completion"]].to_parquet(data)
    monkeypatch.chdir(tmp_path)
    config = Config(enabled=True, tokens=[4], chunk_tokens=16, max_steps=4, save_steps=2, logging_steps=1,
                    per_device_train_batch_size=4)  # fmt: skip
    run(config, serve, data, tmp_path / "whole")
    trainer_setup.discard_checkpoints(tmp_path / "checkpoints", "compress")  # as the stage does once published

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt("killed")

    callbacks = trainer_setup.tracking_callbacks
    monkeypatch.setattr(trainer_setup, "tracking_callbacks", lambda: [*callbacks(), Stop()])
    with pytest.raises(KeyboardInterrupt):
        run(config, serve, data, tmp_path / "stopped")
    assert list((tmp_path / "checkpoints").rglob("checkpoint-2")), "a checkpoint to resume from"
    monkeypatch.setattr(trainer_setup, "tracking_callbacks", callbacks)
    capsys.readouterr()
    run(config, serve, data, tmp_path / "resumed")
    assert re.search(r"compress: resuming from \S*checkpoint-2", capsys.readouterr().out)

    whole = ContextCompressor.from_pretrained(tmp_path / "whole/k4", load_causal_lm(serve))
    resumed = ContextCompressor.from_pretrained(tmp_path / "resumed/k4", load_causal_lm(serve))
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    assert not torch.equal(whole.memory, ContextCompressor.new(load_causal_lm(serve), 4, 16, "x").memory)


def test_params_that_read_no_trained_compressor_fail_before_any_stage(tmp_path):
    from tests.conftest import params_problems, tiny_params

    params = tiny_params(
        evaluate={"compress": {"enabled": True}},
        infer={"compress": {"enabled": True, "tokens": [16]}, "candidate": "merged"},
        compress={"tokens": [32, 128]},
    )
    problems = params_problems(tmp_path, params)
    assert "evaluate.compress.enabled: stage compress trains no compressor (compress.enabled is false)" in problems
    params["compress"]["enabled"] = True
    params["prepare"]["source"], params["task"] = "word_problems", {"kind": "gsm8k"}
    problems = params_problems(tmp_path, params)
    assert any(p.startswith("compress.enabled: no compress table to train on") for p in problems), problems
    assert any(p.startswith("compress.tokens: 128 slots for a chunk of compress.chunk_tokens 128") for p in problems)
    assert "infer.compress.tokens: [16] not among compress.tokens [32, 128]" in problems
    assert any(p.startswith("infer.compress.enabled: the compressors serve models/sft (compress.serve), not "
                            "infer.candidate merged") for p in problems)  # fmt: skip


@pytest.mark.slow
def test_evaluate_and_infer_read_a_long_context_suite_three_ways(tmp_path, monkeypatch, mlflow_store):
    """stages.evaluate.run and stages.infer.run on a long-context suite: the context cut to
    the window (the suite itself), the relevant sentences, and through the compressor."""
    from rlhf.models.folders import write_absent
    from rlhf.tasks import TaskConfig, get_task
    from stages.evaluate import Config as EvaluateConfig
    from stages.evaluate import run as evaluate
    from stages.infer import Config as InferConfig
    from stages.infer import run as infer

    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer()
    model = build_tiny_model("micro", tokenizer, seed=0)
    save_model(model, tokenizer, tmp_path / "models/sft")
    write_absent(tmp_path / "models/rm", "no pairs")
    ContextCompressor.new(model, 4, 16, "models/sft").save_pretrained(tmp_path / "models/compressor/k4")
    rows = generate_datasets(SMALL, seed=0, context_chars=300)["eval_dev"][:4]
    suite = pd.DataFrame(rows).assign(prompt=lambda f: f["prompt"].map(lambda p: [{"role": "user", "content": p}]))
    (tmp_path / "data/prepared/eval").mkdir(parents=True)
    suite.to_parquet(tmp_path / "data/prepared/eval/dev.parquet")
    task = get_task(TaskConfig(kind="gsm8k"))
    config = EvaluateConfig(max_new_tokens=16, kl_prompts=0, samples=1, window=96, compress={"enabled": True})
    report, outcomes, _, completions = evaluate(config, task, [], ["dev"])
    assert set(report["suites"]) == {"dev", "dev/relevant", "dev/compressed-4x"}
    assert report["suites"]["dev/compressed-4x"]["sft"]["slots"] == pytest.approx(
        sum(-(-len(r["context"]) // 16) * 4 for r in rows) / 4
    )
    cut = completions["suites"]["dev"]["prompts"][0][0]["content"]
    assert len(cut) < len(rows[0]["context"]) and cut.endswith(rows[0]["prompt"]), "the end of the context fits"
    assert completions["suites"]["dev/relevant"]["prompts"][0][0]["content"].startswith(rows[0]["relevant"])
    assert len(outcomes["suites"]["dev/compressed-4x"]["models"]["sft"]["accuracy"]) == 4

    settings = InferConfig(strategies=["greedy"], max_new_tokens=16, window=96, compress={"enabled": True})
    infer_report, _ = infer(settings, task, "dev")
    assert set(infer_report["strategies"]) == {"greedy", "compressed-4x"}
    assert infer_report["strategies"]["compressed-4x"]["accuracy"] is not None

    # `rlhf generate` reads a context file through the compressor, and refuses one made for another model.
    import json

    from rlhf.inference.generate import main as generate_main

    (tmp_path / "context.txt").write_text(rows[0]["context"])
    flags = ["--model", "models/sft", "--chat", "--context", "context.txt", "--max-new-tokens", "8"]
    capsys_lines = _printed(generate_main, [*flags, "--compressor", "models/compressor/k4", rows[0]["prompt"]])
    record = json.loads(capsys_lines[-1])
    assert record["prompt"] == rows[0]["prompt"] and record["samples"] == 1
    save_model(build_tiny_model("micro", tokenizer, seed=1), tokenizer, tmp_path / "models/other")
    with pytest.raises(SystemExit, match="was trained for the model in models/sft"):
        generate_main(["--model", "models/other", *flags[2:], "--compressor", "models/compressor/k4", "How many?"])
    with pytest.raises(SystemExit, match="--compressor reads a long context: give it with --context FILE"):
        generate_main(["--model", "models/sft", "--compressor", "models/compressor/k4", "How many?"])


def _printed(function, argv: list[str]) -> list[str]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        function(argv)
    return buffer.getvalue().splitlines()
