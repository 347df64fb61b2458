"""The process reward model: input layout, aggregation, metrics, training (full and LoRA),
resume, and bad data. Training runs use the micro model for 2-4 steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from rlhf.data.contracts import DataValidationError
from rlhf.models.loading import build_tokenizer
from rlhf.rewards.prm import load_prm
from rlhf.rewards.prm_classifier import (
    IGNORE,
    ClassifierPRM,
    build_dataset,
    encode_steps,
    load_prm_model,
    save_prm,
    truncate_to_steps,
)
from rlhf.rewards.steps import DEFAULT_SEPARATOR, aggregate, prm_metrics, split_completion
from rlhf.tasks import TaskConfig
from rlhf.tasks.arithmetic import ArithmeticTask, TaskSizes, TaskSpec, generate_datasets
from rlhf.training.params import TrainingParams
from rlhf.training.prm_trainer import prm_trainer, prm_training_args
from rlhf.training.trainer_setup import train_resumable

# The built-in task's step separator: the PRM functions default to DEFAULT_SEPARATOR ("\n"),
# so everything on built-in data passes the task's explicitly.
SEP = ArithmeticTask.step_separator


def weights(model_dir) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(file)).items()}


def changed(a: dict, b: dict, prefix: str = "") -> list[str]:
    return [k for k in a if k in b and k.startswith(prefix) and not torch.equal(a[k], b[k])]


def test_labels_sit_on_the_last_token_of_each_separator():
    """Char-level tokens: "1+2\\n" is positions 0-3; "1+2=3" 4-8, "; " 9-10; "answer 3" 11-18,
    "; " 19-20. Step 1's label is at 10, step 2's at 20; all else is -100."""
    tokenizer = build_tokenizer()
    row = encode_steps(tokenizer, "1+2\n", ["1+2=3", "answer 3"], [True, False], separator=SEP)
    assert tokenizer.decode(row["input_ids"]) == "1+2\n1+2=3; answer 3; "
    assert len(row["input_ids"]) == len(row["labels"]) == 21
    assert {i: label for i, label in enumerate(row["labels"]) if label != IGNORE} == {10: 1, 20: 0}
    # Scoring (no labels) marks the same positions.
    unlabelled = encode_steps(tokenizer, "1+2\n", ["1+2=3", "answer 3"], separator=SEP)
    assert unlabelled["input_ids"] == row["input_ids"]
    assert [i for i, label in enumerate(unlabelled["labels"]) if label != IGNORE] == [10, 20]
    # A conversational prompt goes through the chat template (each chat marker is one token).
    chat = encode_steps(tokenizer, [{"role": "user", "content": "1+2"}], ["1+2=3"], [True], separator=SEP)
    assert tokenizer.decode(chat["input_ids"]) == "<|user|>1+2<|end|><|assistant|>1+2=3; "
    assert [i for i, label in enumerate(chat["labels"]) if label != IGNORE] == [len(chat["input_ids"]) - 1]
    with pytest.raises(ValueError, match="2 steps but 1 labels"):
        encode_steps(tokenizer, "1+2\n", ["1+2=3", "answer 3"], [True], separator=SEP)


def sentencepiece_like_tokenizer():
    """A BPE tokenizer behind a Metaspace pre-tokenizer that marks only the start of a text
    (Llama 2 and Mistral's `prepend_scheme="first"`), trained here on a few solutions."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    corpus = [f"{a} plus {b} is {a + b}. so the answer is {a + b}." for a in range(20) for b in range(5)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


def test_steps_are_tokenized_as_the_model_wrote_them():
    """A SentencePiece-style tokenizer puts a word-boundary mark before every text it
    tokenizes alone: step by step, each step and separator started with one the model never
    wrote. The completion is tokenized as one text, as written; each label sits on the
    last token before the next step's text, and the likelihood PRM's spans cover each step's
    tokens plus the one after."""
    from rlhf.rewards.prm_likelihood import encode

    tokenizer = sentencepiece_like_tokenizer()
    steps, separator = ["3 plus 4 is 7.", "so the answer is 7."], " "
    completion = "3 plus 4 is 7. so the answer is 7. "
    prompt_ids = tokenizer("q:", add_special_tokens=False)["input_ids"]
    whole = tokenizer(completion, add_special_tokens=False)["input_ids"]
    pieces = sum((tokenizer(s + separator, add_special_tokens=False)["input_ids"] for s in steps), [])
    assert pieces != whole, "piece by piece gives other ids than the text as written"
    row = encode_steps(tokenizer, "q:", steps, [True, False], separator=separator)
    assert row["input_ids"] == prompt_ids + whole
    marked = {i: label for i, label in enumerate(row["labels"]) if label != IGNORE}
    assert list(marked.values()) == [1, 0]
    # The separator's space joins the next word (`▁so`): step 1's label is on the token before it.
    assert tokenizer.decode(row["input_ids"][len(prompt_ids) : list(marked)[0] + 1]) == steps[0]
    assert list(marked)[1] == len(row["input_ids"]) - 1
    ids, spans = encode(tokenizer, "q:", steps, separator)
    assert ids == prompt_ids + tokenizer(separator.join(steps), add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    assert [tokenizer.decode(ids[a : b - 1]).strip() for a, b in spans] == steps
    assert spans[-1][1] == len(ids), "the last step's span ends with EOS"


def test_long_rows_keep_their_whole_steps():
    """The 21-token row above: within 15 tokens only step 1 (ending at 10) fits, so it is cut
    to 11 tokens; within 8 tokens not even step 1 fits and the row is dropped."""
    tokenizer = build_tokenizer()
    row = encode_steps(tokenizer, "1+2\n", ["1+2=3", "answer 3"], [True, False], separator=SEP)
    cut = truncate_to_steps(row, 15)
    assert len(cut["input_ids"]) == 11 and cut["labels"][-1] == 1 and cut["labels"].count(IGNORE) == 10
    assert truncate_to_steps(row, 21) is row
    assert truncate_to_steps(row, 8) is None
    table = {"prompt": ["1+2\n", "1+2\n"], "completions": [["1+2=3", "answer 3"], ["1+2=3"]], "labels": [[1, 1], [1]]}
    assert len(build_dataset(tokenizer, table, SEP, max_length=15)) == 2
    with pytest.raises(ValueError, match="max_length=8"):
        build_dataset(tokenizer, table, SEP, max_length=8)


@pytest.mark.slow
def test_the_training_table_is_memory_mapped_and_a_rerun_finds_its_tokens_in_the_cache(tmp_path, capsys):
    """Given step labels, the stage reads its training table as a memory-mapped dataset (not
    a frame) and tokenises it with a cached map: a second load and build (as on a rerun of
    the stage) reads the same cache file, not a new one. Rows are cut and dropped to
    max_length as a frame's are, and counted."""
    import os

    from datasets import Dataset

    import stages.prm as stage

    data, eval_data = write_prm_tables(tmp_path, train_rows=24)
    tokenizer = build_tokenizer()

    def build(max_length):
        rows, held_out, _ = stage.load_labels(stage.Config(), ArithmeticTask(), data, eval_data, tmp_path / "out")
        assert isinstance(rows, Dataset) and rows.cache_files and isinstance(held_out, pd.DataFrame)
        return build_dataset(tokenizer, rows, SEP, max_length)

    first = build(40)
    files = [f["filename"] for f in first.cache_files]
    inodes = [os.stat(f).st_ino for f in files]
    again = build(40)
    assert [f["filename"] for f in again.cache_files] == files
    assert [os.stat(f).st_ino for f in files] == inodes, "the tokens were read from the cache, not written again"
    assert again["input_ids"] == first["input_ids"] and set(again.column_names) == {"input_ids", "labels"}

    frame = pd.read_parquet(data)
    table = list(zip(frame["prompt"], map(list, frame["completions"]), map(list, frame["labels"])))
    lengths = [len(encode_steps(tokenizer, *row, separator=SEP)["input_ids"]) for row in table]
    encoded = [encode_steps(tokenizer, *row, separator=SEP) for row in table]

    def fitted(length):
        return [truncate_to_steps(row, length) for row in encoded]

    # A length that cuts some rows and drops others (whose first step does not fit).
    cut_to = next(n for n in range(4, max(lengths)) if 0 < fitted(n).count(None) < len(table) // 2)
    capsys.readouterr()
    built = build(cut_to)
    printed = capsys.readouterr().out
    expected = fitted(cut_to)
    kept = [row for row in expected if row is not None]
    assert built["input_ids"] == [row["input_ids"] for row in kept] and built["labels"] == [r["labels"] for r in kept]
    cut = sum(row is not None and n > cut_to for row, n in zip(expected, lengths))
    dropped = len(expected) - len(kept)
    assert f"prm: {cut} row(s) cut to the whole steps within max_length={cut_to}, {dropped} dropped" in printed
    assert cut > 0 and len(kept) < len(expected)


def test_aggregation():
    """Steps scored 0.9, 0.5, 0.8: min 0.5, prod 0.9 * 0.5 * 0.8 = 0.36, last 0.8."""
    assert aggregate([0.9, 0.5, 0.8], "min") == 0.5
    assert aggregate([0.9, 0.5, 0.8], "prod") == pytest.approx(0.36)
    assert aggregate([0.9, 0.5, 0.8], "last") == 0.8
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate([0.9], "mean")
    with pytest.raises(ValueError, match="no step scores"):
        aggregate([], "min")


def test_split_completion_on_the_default_and_the_task_separator():
    """With no separator named the PRM splits one step per line; the built-in task's
    solutions split on '; '. Blank steps are dropped and trailing space with them; a leading
    space stays, since the PRM must read the text the model wrote ("Assistant: 7", not
    "Assistant:7")."""
    assert DEFAULT_SEPARATOR == "\n"
    assert split_completion(" 1+2=3; answer 3\n", SEP) == [" 1+2=3", "answer 3"]
    assert split_completion("1+2=3; answer 3", DEFAULT_SEPARATOR) == ["1+2=3; answer 3"]
    assert split_completion("first\n\n  \nsecond\n", DEFAULT_SEPARATOR) == ["first", "second"]
    assert split_completion("", SEP) == []


def test_metrics_on_hand_made_predictions():
    """Predicted good = P > 0.5.
    A labels TTT, scores .9 .8 .6 -> TTT (3 right); B TFF, .9 .6 .2 -> TTF (2 right);
    C TTF, .6 .9 .1 -> TTF (3 right): step accuracy 8/9.
    Bad class: predicted {B3, C3}, actual {B2, B3, C3}: tp 2, fp 0, fn 1 -> F1 4/5.
    Good class: predicted 7, actual 6, tp 6, fp 1 (B2), fn 0 -> F1 12/13.
    First error: B's predicted first bad step is 3 (true 2), C's is 3 (true 3) -> 1/2.
    Outcome (A all good, B and C not): min .6/.2/.1 and last .6/.2/.1 all agree -> 1;
    prod .432/.108/.054 calls A bad -> 2/3."""
    scores = [[0.9, 0.8, 0.6], [0.9, 0.6, 0.2], [0.6, 0.9, 0.1]]
    labels = [[True, True, True], [True, False, False], [True, True, False]]
    metrics = prm_metrics(scores, labels)
    assert metrics["step_accuracy"] == pytest.approx(8 / 9)
    assert metrics["f1_bad"] == pytest.approx(4 / 5)
    assert metrics["f1_good"] == pytest.approx(12 / 13)
    assert metrics["first_error_accuracy"] == pytest.approx(1 / 2)
    assert metrics["outcome_accuracy_min"] == 1.0 and metrics["outcome_accuracy_last"] == 1.0
    assert metrics["outcome_accuracy_prod"] == pytest.approx(2 / 3)
    assert metrics["bad_step_fraction"] == pytest.approx(3 / 9)
    assert (metrics["eval_solutions"], metrics["eval_steps"]) == (3, 9)


def test_metrics_without_a_bad_step_held_out_are_undefined_not_zero():
    """Every held-out step good and every one predicted good: the bad-step F1 and the
    first-error accuracy measure nothing (None, not 0.0, which reads as a PRM that finds no
    bad step); the good-step F1 is 1. One step predicted bad with none held out: F1 0."""
    labels = [[True, True], [True]]
    metrics = prm_metrics([[0.9, 0.8], [0.7]], labels)
    assert metrics["f1_bad"] is None and metrics["first_error_accuracy"] is None
    assert metrics["f1_good"] == 1.0 and metrics["bad_step_fraction"] == 0.0
    assert prm_metrics([[0.9, 0.2], [0.7]], labels)["f1_bad"] == 0.0


# ----------------------------------------------------------------------------- with a model


def write_prm_tables(root, train_rows: int = 16, eval_rows: int = 8):
    sizes = TaskSizes(**{**dict.fromkeys(TaskSizes.__dataclass_fields__, 0), "prm": train_rows, "prm_eval": eval_rows})
    data = generate_datasets(TaskSpec(), sizes, seed=0)
    folder = root / "data/prepared"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("prm", "prm_eval"):
        pd.DataFrame(data[name]).to_parquet(folder / f"{name}.parquet")
    return folder / "prm.parquet", folder / "prm_eval.parquet"


def test_prefix_of_k_steps_scores_k_steps_and_batching_changes_nothing(micro_dir):
    tokenizer = build_tokenizer()
    save_prm(load_prm_model(micro_dir), tokenizer, micro_dir, SEP)
    prm = load_prm(micro_dir)
    assert isinstance(prm, ClassifierPRM) and prm.separator == SEP
    steps = ["1+2=3", "3+4=7", "answer 7"]
    full, prefix, other = prm.score_steps(["1+2+4\n", "1+2+4\n", "5-1\n"], [steps, steps[:2], ["5-1=4"]])
    assert len(full) == 3 and len(prefix) == 2 and len(other) == 1
    assert all(0.0 < s < 1.0 for s in full)
    # Causal attention: a step's score depends only on what precedes it, padding or not.
    assert prefix == pytest.approx(full[:2], abs=1e-5)
    assert prm.score_steps(["5-1\n"], [["5-1=4"]])[0] == pytest.approx(other, abs=1e-5)
    whole = prm.score_completions(["1+2+4\n", "1+2+4\n"], ["1+2=3; 3+4=7; answer 7", ""], how="prod")
    assert whole == pytest.approx([math.prod(full), 0.0], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_stage_trains_saves_and_reports(tmp_path, monkeypatch, mlflow_store, micro_dir, lora):
    import stages.prm as stage

    monkeypatch.chdir(tmp_path)
    write_prm_tables(tmp_path)
    config = stage.Config(
        kind="classifier", init="sft", max_steps=2, per_device_train_batch_size=4, logging_steps=1, save_steps=2,
        learning_rate=1e-2, lora={"enabled": lora, "r": 4},
    )  # fmt: skip
    monkeypatch.setattr(stage, "load_model_stage", lambda *args, **kwargs: {"prm": config, "task": TaskConfig()})
    stage.main()

    metrics = json.loads((tmp_path / "metrics/prm.json").read_text())
    assert metrics["steps_trained"] == 2 and math.isfinite(metrics["train_loss"])
    assert metrics["eval_solutions"] == 8 and 0.0 <= metrics["step_accuracy"] <= 1.0
    assert {f"outcome_accuracy_{how}" for how in ("min", "prod", "last")} <= set(metrics)
    curve = pd.read_csv(tmp_path / "plots/prm/loss.csv")
    assert len(curve) == 2 and curve["loss"].map(math.isfinite).all()
    out = tmp_path / "models/prm"
    assert not any(p.name.startswith("adapter") for p in out.iterdir()), "adapters are merged on save"
    assert json.loads((out / "prm.json").read_text()) == {"kind": "classifier", "step_separator": SEP}
    trained = weights(out)
    assert trained["score.weight"].shape == (2, 32)
    assert changed(weights(micro_dir), trained, "model.layers"), "the body is trained, not only the head"
    assert not (tmp_path / "checkpoints/prm").exists()


@pytest.mark.slow  # seconds (a DVC repo, stage processes or training): out of the quick tier
def test_a_separator_the_tokenizer_drops_fails_naming_the_key_before_labels(
    tmp_path, monkeypatch, mlflow_store, micro_dir
):
    """A tokenizer whose normaliser removes the task's separator (a real one dropped
    newlines) gives the PRM nowhere to put a step's label: refused naming
    task.step_separator, before labels are read or derived and before any model loads."""
    from tokenizers import normalizers

    import stages.prm as stage
    from rlhf.params import ParamsError

    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace(SEP, "")
    tokenizer.save_pretrained(str(micro_dir))
    config = stage.Config(kind="classifier", init="sft", max_steps=2)
    monkeypatch.setattr(stage, "load_model_stage", lambda *args, **kwargs: {"prm": config, "task": TaskConfig()})
    monkeypatch.setattr(stage, "load_labels", lambda *args: pytest.fail("labels read before the separator's check"))
    with pytest.raises(ParamsError, match=r"task\.step_separator: .* tokenizes to nothing with the tokenizer of "):
        stage.main()
    assert not (tmp_path / "models/prm").exists()


@pytest.mark.slow
def test_a_resumed_run_reproduces_an_uninterrupted_one(tmp_path, monkeypatch, mlflow_store, micro_dir):
    """Stop after step 2 (checkpoint-2), resume in a fresh trainer to step 4: the weights
    equal those of a run that was never stopped."""
    from transformers import TrainerCallback, set_seed

    from rlhf.data.contracts import validate_contract

    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    class CountSteps(TrainerCallback):
        taken = 0

        def on_step_end(self, args, state, control, **kwargs):
            CountSteps.taken += 1

    monkeypatch.chdir(tmp_path)
    data, _ = write_prm_tables(tmp_path)
    tokenizer = build_tokenizer()
    train = build_dataset(tokenizer, validate_contract(pd.read_parquet(data), "prm", data), SEP)
    params = TrainingParams(max_steps=4, per_device_train_batch_size=4, save_steps=2, learning_rate=1e-2)

    def trainer(out):
        args = prm_training_args(params, out)
        set_seed(0)
        return prm_trainer(args, load_prm_model(micro_dir), tokenizer, train)

    straight = trainer(tmp_path / "straight")
    straight.train()
    stopped = trainer(tmp_path / "resumed")
    stopped.add_callback(StopAt2())
    stopped.train()
    assert stopped.state.global_step == 2
    resumed = trainer(tmp_path / "resumed")
    resumed.add_callback(CountSteps())
    assert train_resumable(resumed, "prm", "test").endswith("checkpoint-2")
    assert resumed.state.global_step == 4 and CountSteps.taken == 2, "steps 3 and 4 only"
    for name, value in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value)


def test_a_prm_scores_in_the_compute_dtype_and_a_lora_base_trains_a_float32_head(micro_dir, monkeypatch):
    """Computing in bfloat16 (a GPU's compute.dtype, set here on the CPU): a classifier PRM
    scores steps in bfloat16, as a reward model is served (it had loaded as float32 master
    weights: twice the memory in MCTS, best-of-N and the rewards); stage prm trains in full
    on float32 master weights, and under LoRA on a bfloat16 base with its new head float32."""
    import rlhf.models.compute as compute

    save_prm(load_prm_model(micro_dir), build_tokenizer(), micro_dir, SEP)
    monkeypatch.setattr(compute, "_current", compute.Placement("cpu", "bfloat16"))
    prm = load_prm(micro_dir)
    assert {p.dtype for p in prm.model.parameters()} == {torch.bfloat16} and not prm.model.training
    [scores] = prm.score_steps(["1+2+4\n"], [["1+2=3", "3+4=7", "answer 7"]])
    assert len(scores) == 3 and all(0.0 < s < 1.0 for s in scores)
    assert {p.dtype for p in load_prm_model(micro_dir, training=True).parameters()} == {torch.float32}
    base = load_prm_model(micro_dir, training=True, adapters=True)
    head = {n for n, p in base.named_parameters() if p.dtype == torch.float32}
    assert head and all(n.startswith(("score.", "classifier.")) for n in head), head
    assert base.get_input_embeddings().weight.dtype == torch.bfloat16
    # Pure half precision (model.dtype bfloat16, computing in float32: no autocast): the head
    # stays in the base's dtype, which its input has, and a step's forward runs.
    import rlhf.models.settings as model_settings

    monkeypatch.setattr(compute, "_current", compute.Placement("cpu", "float32"))
    monkeypatch.setattr(model_settings, "_current", model_settings.current().model_copy(update={"dtype": "bfloat16"}))
    pure = load_prm_model(micro_dir, training=True, adapters=True)
    assert {p.dtype for p in pure.parameters()} == {torch.bfloat16}
    assert pure(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 2)


def test_bad_rows_fail_before_training_naming_file_and_row(tmp_path):
    import stages.prm as stage

    data, eval_data = write_prm_tables(tmp_path, train_rows=4)
    frame = pd.read_parquet(data)
    frame.at[1, "labels"] = [True]  # row 2: fewer labels than steps
    frame.to_parquet(data)
    with pytest.raises(DataValidationError) as error:
        stage.load_labels(stage.Config(), ArithmeticTask(), data, eval_data, tmp_path / "out")
    assert str(data) in str(error.value) and "row 2: 'completions' has" in str(error.value)


@pytest.mark.parametrize("kind", ["likelihood", None], ids=["likelihood", "default-kind"])
def test_likelihood_config_rejects_training_keys_and_classifier_accepts_them(kind):
    """Kind likelihood (the default) fits a calibration and trains no weights: a training key
    such as max_steps is an error naming the key (all of them when several are set);
    kind classifier reads them. The step separator is no param: it is the task's."""
    import stages.prm as stage

    chosen = {"kind": kind} if kind else {}
    with pytest.raises(ValidationError, match="max_steps: not read by kind likelihood.*remove it"):
        stage.Config(**chosen, max_steps=10)
    with pytest.raises(ValidationError, match="lora, max_steps: not read by kind likelihood.*remove them"):
        stage.Config(**chosen, max_steps=10, lora={"enabled": True})
    likelihood = stage.Config(**chosen, init="sft", score_batch_size=8)
    assert likelihood.kind == "likelihood" and likelihood.score_batch_size == 8
    classifier = stage.Config(kind="classifier", max_steps=10, lora={"enabled": True})
    assert classifier.max_steps == 10 and classifier.lora.enabled
    with pytest.raises(ValidationError, match="step_separator"):
        stage.Config(kind="classifier", step_separator="; ")


# ----------------------------------------------------------------------------- likelihood PRM


def test_likelihood_features_are_the_lms_token_logprobs(micro_dir):
    """For prompt '1+2\n' and steps ['1+2=3', 'answer 3'], step 1's span is its 5 tokens plus
    the first separator token ';', step 2's is its 8 tokens plus EOS; each feature is read
    off log p(token_t | tokens < t) computed here by hand from one forward pass."""
    from rlhf.models.loading import load_causal_lm
    from rlhf.rewards.prm_likelihood import encode, likelihood_features

    tokenizer, lm = build_tokenizer(), load_causal_lm(micro_dir)
    ids, spans = encode(tokenizer, "1+2\n", ["1+2=3", "answer 3"], "; ")
    assert spans == [(4, 10), (11, 20)] and ids[9] == tokenizer.convert_tokens_to_ids(";")
    assert ids[19] == tokenizer.eos_token_id and len(ids) == 20
    with torch.inference_mode():
        logps = lm(torch.tensor([ids])).logits[0].log_softmax(-1)
    token = torch.tensor([float(logps[t - 1, ids[t]]) for t in range(1, len(ids))])  # token[t-1] = log p(ids[t])
    step1, step2 = token[3:9], token[10:19]
    expected = torch.tensor(
        [
            [step1.min(), step1.min(), step1.mean()],
            [step2.min(), min(step1.min(), step2.min()), step2.mean()],
        ]
    )
    (features,) = likelihood_features(lm, tokenizer, ["1+2\n"], [["1+2=3", "answer 3"]], SEP)
    assert torch.allclose(features, expected, atol=1e-5)

    # A partial path (MCTS's): its last step is followed by the separator, not the EOS, so
    # its features are those the step has inside the whole solution (with the EOS they
    # asked how likely the solution was to stop there).
    partial, closed = (
        encode(tokenizer, "1+2\n", ["1+2=3"], "; ", finished=False),
        encode(tokenizer, "1+2\n", ["1+2=3"], "; "),
    )
    assert partial[1] == closed[1] == [(4, 10)] and partial[0][9] == ids[9] != closed[0][9] == tokenizer.eos_token_id
    (prefix,) = likelihood_features(lm, tokenizer, ["1+2\n"], [["1+2=3"]], SEP, finished=[False])
    assert torch.allclose(prefix, expected[:1], atol=1e-5)


def test_fit_logistic_separates_a_separable_feature():
    """Labels = (x > 0) on x in [-2, 2]: the fitted P(good) is above 0.9 at x = 2, below
    0.1 at x = -2, and the loss curve decreases."""
    from rlhf.rewards.likelihood import fit_logistic

    x = torch.linspace(-2, 2, 41)[:, None]
    weights, bias, curve = fit_logistic(x, (x[:, 0] > 0), l2=0.0)
    probability = torch.sigmoid(torch.tensor([[2.0], [-2.0]]) @ weights + bias)
    assert probability[0] > 0.9 and probability[1] < 0.1
    assert curve[-1]["loss"] < curve[0]["loss"]


@pytest.mark.slow
def test_likelihood_fit_over_batches_is_the_fit_over_the_whole_table(micro_dir):
    """The calibration is fitted from the rows a batch at a time (the stage streams its
    table): batches of 3 rows give the weights of one batch holding every row."""
    from rlhf.models.loading import load_causal_lm
    from rlhf.rewards.prm_likelihood import LikelihoodPRM

    sizes = TaskSizes(**{**dict.fromkeys(TaskSizes.__dataclass_fields__, 0), "prm": 10})
    table = generate_datasets(TaskSpec(), sizes, seed=0)
    rows = {k: [row[k] for row in table["prm"]] for k in ("prompt", "completions", "labels")}
    tokenizer, lm = build_tokenizer(), load_causal_lm(micro_dir)
    whole = LikelihoodPRM.fit(lm, tokenizer, [rows], SEP)
    batches = [{k: v[i : i + 3] for k, v in rows.items()} for i in range(0, 10, 3)]
    batched = LikelihoodPRM.fit(lm, tokenizer, batches, SEP)
    assert sum(map(len, rows["labels"])) > 10 and len(set(label for r in rows["labels"] for label in r)) == 2
    torch.testing.assert_close(batched.weights, whole.weights, atol=1e-4, rtol=1e-4)
    assert batched.bias == pytest.approx(whole.bias, abs=1e-4)


@pytest.mark.slow
def test_likelihood_stage_saves_a_prm_that_loads_and_scores(tmp_path, monkeypatch, mlflow_store, micro_dir):
    import stages.prm as stage
    from rlhf.rewards.prm_likelihood import LikelihoodPRM

    monkeypatch.chdir(tmp_path)
    write_prm_tables(tmp_path)
    config = stage.Config(kind="likelihood", init="sft")
    monkeypatch.setattr(stage, "load_model_stage", lambda *args, **kwargs: {"prm": config, "task": TaskConfig()})
    stage.main()
    metrics = json.loads((tmp_path / "metrics/prm.json").read_text())
    assert metrics["kind"] == "likelihood" and 0.0 <= metrics["step_accuracy"] <= 1.0
    assert pd.read_csv(tmp_path / "plots/prm/loss.csv")["loss"].map(math.isfinite).all()
    prm = load_prm(tmp_path / "models/prm")
    assert isinstance(prm, LikelihoodPRM) and prm.separator == SEP, "the task's separator is saved with it"
    (scores,) = prm.score_steps(["1+2+4\n"], [["1+2=3", "3+4=7", "answer 7"]])
    assert len(scores) == 3 and all(0.0 < s < 1.0 for s in scores)


def test_a_missing_reader_model_fails_naming_the_param(tmp_path, monkeypatch, mlflow_store):
    """prm.init: verifier without models/verifier: one error naming the param and the path,
    before any model is loaded (no hub lookup)."""
    import stages.prm as stage

    monkeypatch.chdir(tmp_path)
    data, eval_data = write_prm_tables(tmp_path)
    rows, held_out, _ = stage.load_labels(stage.Config(), ArithmeticTask(), data, eval_data, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"prm.init 'verifier' \(models/verifier\) directory models/verifier"):
        stage.run(stage.Config(), SEP, Path("models/verifier"), rows, held_out, tmp_path / "out")


def test_token_logprobs_in_row_chunks_are_the_whole_batchs(micro_dir):
    """A logits budget of one row at a time gives the log-probs of one forward over the
    batch (padding and all), so a large vocabulary is scored without its full logits."""
    from rlhf.models.loading import load_causal_lm
    from rlhf.rewards.likelihood import token_logprobs

    tokenizer, lm = build_tokenizer(), load_causal_lm(micro_dir)
    batch = tokenizer(["1+2\n1+2=3; answer 3", "12+7\nanswer 19", "3\n"], return_tensors="pt", padding=True)
    with torch.inference_mode():
        whole = token_logprobs(lm, batch["input_ids"], batch["attention_mask"])
        one_row = batch["input_ids"].shape[1] * lm.get_output_embeddings().weight.shape[0] * 4
        chunked = token_logprobs(lm, batch["input_ids"], batch["attention_mask"], logits_budget=one_row)
    assert whole.shape == (3, batch["input_ids"].shape[1] - 1)
    assert torch.allclose(chunked, whole, atol=1e-5)


def test_a_classifier_prm_on_an_architecture_without_a_token_head_fails_naming_the_kind(tmp_path):
    """transformers has no token-classification class for Gemma 3: the classifier PRM says
    to use the likelihood kind, before any training (it was transformers' raw error)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from rlhf.models.loading import build_tokenizer, save_model
    from rlhf.rewards.prm_classifier import load_prm_model

    tokenizer = build_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    save_model(Gemma3ForCausalLM(config), tokenizer, tmp_path / "gemma")
    with pytest.raises(ValueError, match=r"model type 'gemma3_text'; set prm.kind: likelihood"):
        load_prm_model(tmp_path / "gemma")


def test_a_prm_of_another_separator_is_refused_wherever_it_would_score_steps(tmp_path, monkeypatch):
    """A PRM as stage prm writes it (prm.json's `step_separator`), trained on other steps
    than the task's: refused by stage infer for MCTS and for best-of-N's prm reward, by the
    prm reward itself (policy training), and by check_params for `infer.prm`. `infer.prm`
    is best-of-N's PRM too (it read models/prm whatever infer.prm said)."""
    from rlhf.models.folders import UnusableModelError
    from rlhf.models.loading import build_tiny_model, save_model
    from rlhf.rewards.functions import PRMReward
    from rlhf.rewards.prm_classifier import load_prm_model, save_prm
    from rlhf.tasks import get_task
    from stages.infer import Config, run
    from tests.conftest import params_problems, tiny_params

    tokenizer = build_tokenizer()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/prepared/eval").mkdir(parents=True)
    pd.DataFrame({"prompt": ["12+7-3\n"], "answer": ["16"]}).to_parquet(tmp_path / "data/prepared/eval/test.parquet")
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, tmp_path / "models/sft")
    save_prm(load_prm_model(tmp_path / "models/sft"), tokenizer, tmp_path / "models/lines_prm", "\n")
    save_prm(load_prm_model(tmp_path / "models/sft"), tokenizer, tmp_path / "models/own_prm", "; ")
    task = get_task()
    wrong = r"models/lines_prm: the PRM splits steps on '\\n' but the task on '; '"
    for strategy in ("mcts", "best_of_n"):
        with pytest.raises(UnusableModelError, match=rf"^infer.prm {wrong}" if strategy == "mcts" else wrong):
            run(Config(strategies=["greedy", strategy], prm="models/lines_prm"), task, "test")
    with pytest.raises(UnusableModelError, match=rf"^reward prm {wrong}"):
        PRMReward(name="prm", path="models/lines_prm").build(task, {})
    data = tiny_params()
    data["infer"]["prm"] = "models/lines_prm"
    assert any(
        p.startswith("infer.prm") and "models/lines_prm: the PRM splits steps on" in p
        for p in params_problems(tmp_path, data)
    )
    # No models/prm here: best-of-N reranks with infer.prm's.
    report, _ = run(Config(strategies=["best_of_n"], prm="models/own_prm", best_of_n={"n": 2}), task, "test")
    assert report["strategies"]["best_of_n"]["samples_per_problem"] == 2
