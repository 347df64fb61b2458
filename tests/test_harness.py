"""lm-evaluation-harness backend (rlhf.evaluation.harness): a prepared eval suite run as a
local harness task scores exactly what evaluate scores, on exactly the same generations."""

from __future__ import annotations

import socket

import pandas as pd
import pytest

from rlhf.evaluation.harness import (
    clean_metrics,
    evaluate_harness,
    harness_completions,
    harness_outcomes,
    run_harness,
    write_suite_task,
)

SUITE = 40
TRAINED = 20  # the first TRAINED problems are memorised; the rest the model has never seen
# `answer N` and its EOS fit; `answer NN` just fits without its EOS: some completions stop
# at EOS, others at the budget, and both stops must agree with plain generate.
MAX_NEW_TOKENS = 9


@pytest.fixture(scope="module")
def memorised():
    """The built-in tiny model after 100 full-batch steps on the answers alone
    (`<prompt>answer N</s>`) of the first TRAINED of SUITE held-out problems: it gets most
    of those right and few of the others, so the suite's accuracy is neither 0 nor 1. The
    suite is ordered by answer so that the trained half holds the one-digit answers (the
    completions that stop at EOS within MAX_NEW_TOKENS)."""
    import torch

    from rlhf.models.loading import build_tiny_model, build_tokenizer
    from rlhf.tasks.arithmetic import TaskSizes, TaskSpec, generate_datasets
    from tests.conftest import fit_texts

    sizes = TaskSizes(sft=0, prefs=0, prefs_eval=0, unpaired=0, prm=0, prm_eval=0, prompts=0, eval_dev=SUITE)
    rows = sorted(generate_datasets(TaskSpec(), sizes, seed=0)["eval_dev"], key=lambda r: int(r["answer"]))
    tokenizer = build_tokenizer()
    model = build_tiny_model("tiny", tokenizer, seed=0)
    texts = [r["prompt"] + "answer " + r["answer"] + tokenizer.eos_token for r in rows[:TRAINED]]
    torch.manual_seed(0)
    fit_texts(model, tokenizer, texts, 100, lr=3e-3, optimizer="AdamW")
    tokenizer.padding_side = "left"
    return model, tokenizer, pd.DataFrame(rows)


@pytest.fixture
def no_network(monkeypatch):
    """The Hub switched on, as the project leaves it (tests switch it off), and any attempt
    to resolve a host or open a connection fails the test."""
    import datasets
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.slow
def test_suite_task_matches_pipeline_accuracy_and_generations(memorised, tmp_path, no_network):
    from rlhf.models.generation import generate
    from rlhf.tasks import get_task

    model, tokenizer, suite = memorised
    suite.to_parquet(tmp_path / "dev.parquet")
    yaml_path = write_suite_task(
        tmp_path / "dev.parquet", "rlhf_dev", tmp_path / "tasks", max_new_tokens=MAX_NEW_TOKENS
    )
    assert yaml_path == tmp_path / "tasks" / "rlhf_dev.yaml"

    results = evaluate_harness(
        model, tokenizer, ["rlhf_dev"], include_path=tmp_path / "tasks", bootstrap_iters=0, log_samples=True
    )

    # Evaluate's own path: greedy generate, then the task's answer check.
    task = get_task(None)
    ours = generate(model, tokenizer, suite["prompt"].tolist(), MAX_NEW_TOKENS, do_sample=False)
    correct = [task.is_correct(c, a) for c, a in zip(ours, suite["answer"])]
    accuracy = sum(correct) / len(correct)
    assert 0 < sum(correct) < SUITE, f"the memorised model should get some, not all, right: {ours}"
    # One character is one token of the built-in tokenizer.
    assert any(len(c) < MAX_NEW_TOKENS for c in ours), "some completion should stop at EOS"
    assert any(len(c) == MAX_NEW_TOKENS for c in ours), "some completion should run to the budget"

    assert harness_completions(results, "rlhf_dev") == ours
    assert harness_outcomes(results, "rlhf_dev", "accuracy") == [float(c) for c in correct]
    assert results["results"]["rlhf_dev"]["sample_len"] == SUITE
    metrics = clean_metrics(results)["rlhf_dev"]
    assert metrics["accuracy"] == accuracy
    assert metrics["format_rate"] == sum(task.is_well_formatted(c) for c in ours) / SUITE


@pytest.mark.slow
def test_run_harness_reports_clean_metrics_with_stderr_and_limit(memorised, tmp_path, no_network):
    import torch

    model, tokenizer, suite = memorised
    suite.to_parquet(tmp_path / "dev.parquet")
    write_suite_task(tmp_path / "dev.parquet", "rlhf_dev", tmp_path / "tasks", max_new_tokens=MAX_NEW_TOKENS)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    (tmp_path / "more_tasks").mkdir()  # include_path may name several folders
    metrics = run_harness(
        model, tokenizer, ["rlhf_dev"], include_path=[tmp_path / "tasks", tmp_path / "more_tasks"], limit=TRAINED
    )
    # lm-eval reseeds torch's global generator; run_harness hands the caller's back.
    assert torch.equal(torch.rand(3), expected_draw)
    # The first TRAINED problems are the memorised ones: accuracy well above the suite's.
    assert set(metrics) == {"rlhf_dev"}
    assert set(metrics["rlhf_dev"]) == {"accuracy", "accuracy_stderr", "format_rate", "format_rate_stderr"}
    accuracy = metrics["rlhf_dev"]["accuracy"]
    assert accuracy > 0.5
    # A mean's closed-form standard error over the TRAINED problems (sample std / sqrt(n)).
    expected = (accuracy * (1 - accuracy) * TRAINED / (TRAINED - 1) / TRAINED) ** 0.5
    assert metrics["rlhf_dev"]["accuracy_stderr"] == pytest.approx(expected)


@pytest.mark.slow
def test_unknown_task_names_it_and_suggests_close_names(tmp_path):
    (tmp_path / "tasks").mkdir()
    # The name is checked before the model is used: None stands in for both.
    with pytest.raises(ValueError, match=r"unknown harness task\(s\) 'hellaswg' \(close: hellaswag") as error:
        run_harness(None, None, ["hellaswg"], include_path=tmp_path / "tasks")
    assert str(tmp_path / "tasks") in str(error.value)


def test_the_task_index_is_kept_while_its_folder_is_unchanged(tmp_path):
    """Evaluate scores every model with the same tasks: lm-eval's index of a folder is
    built once (the built-in tasks' takes ~9 s), and again once a task is added to it."""
    from rlhf.evaluation.harness import _task_manager

    pd.DataFrame({"prompt": ["1+2\n"], "answer": ["3"]}).to_parquet(tmp_path / "dev.parquet")
    write_suite_task(tmp_path / "dev.parquet", "rlhf_dev", tmp_path / "tasks", max_new_tokens=8)
    first = _task_manager(["rlhf_dev"], tmp_path / "tasks")
    assert _task_manager(["rlhf_dev"], tmp_path / "tasks") is first
    write_suite_task(tmp_path / "dev.parquet", "rlhf_test", tmp_path / "tasks", max_new_tokens=8)
    again = _task_manager(["rlhf_test"], tmp_path / "tasks")
    assert again is not first and "rlhf_test" in again.task_index and "rlhf_test" not in first.task_index


def test_missing_include_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="include_path .*missing is not a folder"):
        run_harness(None, None, ["rlhf_dev"], include_path=tmp_path / "missing")
    (tmp_path / "tasks").mkdir()
    with pytest.raises(FileNotFoundError, match="include_path .*other is not a folder"):
        run_harness(None, None, ["rlhf_dev"], include_path=[tmp_path / "tasks", tmp_path / "other"])


def test_clean_metrics_maps_filters_and_drops_non_numeric():
    """lm-eval's keys → ours: the default filter `none` disappears, any other follows a
    slash; "N/A" stderrs, aliases and sample counts are dropped."""
    results = {
        "results": {
            "gsm8k": {
                "alias": "gsm8k",
                "sample_len": 10,
                "exact_match,strict-match": 0.25,
                "exact_match_stderr,strict-match": 0.1,
                "exact_match,flexible-extract": 0.5,
                "exact_match_stderr,flexible-extract": "N/A",
            },
            "arc_easy": {"acc,none": 0.75, "acc_stderr,none": 0.05, "acc_norm,none": 0.5},
        }
    }
    assert clean_metrics(results) == {
        "gsm8k": {
            "exact_match/strict-match": 0.25,
            "exact_match_stderr/strict-match": 0.1,
            "exact_match/flexible-extract": 0.5,
        },
        "arc_easy": {"acc": 0.75, "acc_stderr": 0.05, "acc_norm": 0.5},
    }


def test_write_suite_task_rejects_unusable_suites(tmp_path):
    pd.DataFrame({"prompt": ["1+2\n"]}).to_parquet(tmp_path / "no_answer.parquet")
    with pytest.raises(ValueError, match=r"needs columns prompt and answer; missing \['answer'\]"):
        write_suite_task(tmp_path / "no_answer.parquet", "t", tmp_path / "tasks", max_new_tokens=8)
    pd.DataFrame({"prompt": ["1+2\n"], "answer": ["3"]}).to_parquet(tmp_path / "ok.parquet")
    with pytest.raises(ValueError, match="letters, digits"):
        write_suite_task(tmp_path / "ok.parquet", "dev.v2", tmp_path / "tasks", max_new_tokens=8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_suite_task(tmp_path / "absent.parquet", "t", tmp_path / "tasks", max_new_tokens=8)


@pytest.mark.slow
def test_evaluate_refuses_an_unusable_harness_suite_or_task_before_loading_a_model(tmp_path, monkeypatch):
    """A chat suite cannot be a harness suite task, a misspelt harness task is in no
    registry, and a registry task whose dataset is not cached cannot be had offline: stage
    evaluate says so before it loads (or evaluates) any model; here there is no model at
    all, so a later check would fail on loading instead."""
    import datasets
    import huggingface_hub.constants

    from rlhf.evaluation.harness import HarnessDataError
    from rlhf.tasks import get_task
    from stages import evaluate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/prepared/eval").mkdir(parents=True)
    chat = [[{"role": "user", "content": "1+2?"}], [{"role": "user", "content": "2+2?"}]]
    pd.DataFrame({"prompt": chat, "answer": ["3", "4"]}).to_parquet("data/prepared/eval/chat.parquet")
    pd.DataFrame({"prompt": ["1+2\n"], "answer": ["3"]}).to_parquet("data/prepared/eval/dev.parquet")
    assert not (tmp_path / "models").exists()
    config = evaluate.Config(harness={"suites": ["chat"]})
    with pytest.raises(ValueError, match=r"rows \[1, 2\]: 'prompt' is a conversation; a suite task feeds text"):
        evaluate.run(config, get_task(None), [], ["dev"])
    config = evaluate.Config(harness={"tasks": ["hellaswagg"], "suites": ["dev"]})
    with pytest.raises(ValueError, match=r"unknown harness task\(s\) 'hellaswagg' \(close: hellaswag"):
        evaluate.run(config, get_task(None), [], ["dev"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    config = evaluate.Config(harness={"tasks": ["arc_easy"]})
    with pytest.raises(HarnessDataError, match=r"^evaluate.harness.tasks: harness task 'arc_easy' cannot load its"):
        evaluate.run(config, get_task(None), [], ["dev"])


@pytest.mark.slow
def test_check_params_finds_a_misspelt_harness_task_and_a_chat_harness_suite(tmp_path, monkeypatch):
    """Both stopped stage evaluate only, after every policy had trained; check_params (the
    first stage) names them."""
    import json

    from rlhf.params import validate_params
    from stages import all_configs
    from stages.check_params import harness_problems
    from tests.conftest import tiny_params

    monkeypatch.chdir(tmp_path)
    chat = [{"prompt": [{"role": "user", "content": "1+2?"}], "answer": "3"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in chat))
    data = tiny_params()
    data["prepare"]["files"] = {"eval_chat": {"path": "chat.jsonl"}}
    data["evaluate"]["harness"] = {"tasks": ["hellaswagg"], "suites": ["chat"]}
    params = validate_params(data, all_configs(), "params.yaml")
    problems = harness_problems(params)
    assert len(problems) == 2
    assert problems[0].startswith("evaluate.harness.tasks: unknown harness task(s) 'hellaswagg' (close: hellaswag")
    assert problems[1].startswith("evaluate.harness.suites: suite 'chat' holds conversations")


@pytest.mark.slow
def test_a_tokenizer_that_starts_text_with_bos_gets_it_in_the_harness_as_in_generate(memorised, tmp_path, no_network):
    """Llama-style tokenizers put BOS before plain text, and the pipeline's `generate` reads
    prompts with it (as training saw them); the harness lets the tokenizer decide, so its
    generations are evaluate's. The BOS changes this model's greedy answers, so a harness
    that left it out would not match."""
    import copy

    from tokenizers import processors

    from rlhf.models.generation import generate

    model, plain, suite = memorised
    tokenizer = copy.deepcopy(plain)
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)]
    )
    suite.to_parquet(tmp_path / "dev.parquet")
    write_suite_task(tmp_path / "dev.parquet", "rlhf_dev", tmp_path / "tasks", max_new_tokens=MAX_NEW_TOKENS)
    results = evaluate_harness(
        model, tokenizer, ["rlhf_dev"], include_path=tmp_path / "tasks", bootstrap_iters=0, log_samples=True
    )
    prompts = suite["prompt"].tolist()
    ours = generate(model, tokenizer, prompts, MAX_NEW_TOKENS, do_sample=False)
    assert ours != generate(model, plain, prompts, MAX_NEW_TOKENS, do_sample=False), "the BOS should matter here"
    assert harness_completions(results, "rlhf_dev") == ours
