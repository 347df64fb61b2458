"""A user's own model and data, end to end: prepare -> gate -> infer in a real git + DVC
repository, on the user's files only. Every stage's main runs in DVC's order in the test's
process (a stage process adds ~10 s of imports; tests/test_pipeline_e2e.py runs the DAG as
processes under DVC and the flow), `dvc commit` records them, and `dvc repro` then has
nothing to do.

The user has what most users have: an sft file (JSONL, GSM8K-style answers ending in
`#### N`, columns mapped in params), preference pairs in the HH-RLHF layout (Parquet,
chosen / rejected with the prompt as their shared prefix, no prompt column) and one eval
suite (a `datasets.save_to_disk` folder). The model is a tiny GPT-2 or Qwen2 built here
and saved with `save_pretrained`. Everything else is derived: prefs_eval (held out of the
pairs), unpaired rows (for KTO), prompts with answers (read by the gsm8k task from the sft
answers) and the PRM's step labels (Math-Shepherd rollouts of the SFT model).

The questions are one-digit additions and the eval suite repeats sft questions, so a model
trained on the answers gets some right: accuracy is computed by the gsm8k task and is not 0.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.dag import stage_order
from tests.conftest import TINY_OVERRIDES, deep_update, make_project, run, run_and_commit, run_stages_in

pytestmark = pytest.mark.slow

HUMAN, ASSISTANT = "\n\nHuman: ", "\n\nAssistant:"


def problems() -> list[tuple[str, str, str]]:
    """(question, GSM8K-style answer, a wrong answer) for every one-digit addition."""
    rows = []
    for a in range(1, 10):
        for b in range(1, 10):
            question = f"What is {a} plus {b}?"
            rows.append(
                (question, f" {a} + {b} = {a + b}\n#### {a + b}", f" {a} + {b} = {a + b + 1}\n#### {a + b + 1}")
            )
    return rows


# params.yaml's prepare.files for them.
USER_FILES = {
    "sft": {"path": "data/raw/train.jsonl", "columns": {"prompt": "question", "completion": "answer"}},
    "prefs": {"path": "data/raw/pairs.parquet", "columns": {"chosen": "good", "rejected": "bad"}},
    "eval_heldout": {"path": "data/raw/heldout", "columns": {"prompt": "question", "answer": "solution"}},
}


def write_user_files(root: Path) -> None:
    """The user's three files, in three formats (USER_FILES)."""
    from datasets import Dataset

    data = root / "data/raw"
    data.mkdir(parents=True, exist_ok=True)
    rows = problems()
    with open(data / "train.jsonl", "w") as file:
        for question, answer, _ in rows * 4:
            file.write(json.dumps({"question": HUMAN + question + ASSISTANT, "answer": answer}) + "\n")
    pairs = [
        {"good": HUMAN + q + ASSISTANT + answer, "bad": HUMAN + q + ASSISTANT + wrong} for q, answer, wrong in rows
    ]
    pd.DataFrame(pairs).to_parquet(data / "pairs.parquet")
    heldout = rows[::5]
    Dataset.from_dict(
        {"question": [HUMAN + q + ASSISTANT for q, _, _ in heldout], "solution": [a for _, a, _ in heldout]}
    ).save_to_disk(str(data / "heldout"))


def build_model(kind: str, path: Path) -> None:
    """A tiny GPT-2 or Qwen2 with the built-in character tokenizer, saved as a user would."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from rlhf.models.loading import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)  # the same weights whatever ran before in this process (an unlucky draw learns nothing)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if kind == "gpt2":
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=64, n_layer=2, n_head=4, **ids)
        model = GPT2LMHeadModel(config)
    else:
        config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id, **ids,
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))


def user_params(files: dict, model_dir: Path, **overrides) -> dict:
    """The acceptance params (source files, three files, task gsm8k, the model), plus the
    test-size budgets of tests/conftest.py."""
    import yaml

    from tests.conftest import REPO

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    small = {k: v for k, v in TINY_OVERRIDES.items() if k not in ("prepare", "base", "gate")}
    deep_update(params, small)
    return deep_update(
        params,
        {
            "task": {"kind": "gsm8k"},
            "prepare": {"source": "files", "files": files},
            "base": {"model": str(model_dir)},
            # Enough steps for the tiny model to learn some of the answers it is trained on.
            "sft": {"max_steps": 300, "per_device_train_batch_size": 16, "learning_rate": 0.003, "save_steps": 100},
            "prm": {"derive": {"prompts": 6, "samples_per_prompt": 2, "rollouts": 2, "max_new_tokens": 24}},
            "evaluate": {"max_new_tokens": 24},
            **overrides,
        },
    )


HARNESS = {
    "evaluate": {"max_new_tokens": 24, "harness": {"suites": ["heldout"]}},
    "gate": {
        "tests": [
            {"metric": "accuracy", "relative_to": "sft", "op": ">=", "threshold": 0.0},
            {"metric": "accuracy", "suite": "harness/rlhf_heldout", "relative_to": "sft", "op": ">=", "threshold": 0.0},
            {"metric": "kl_to_ref", "relative_to": "absolute", "op": "<=", "threshold": 10.0},
        ]
    },
}


def dvc_repro(root: Path) -> str:
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return run([sys.executable, "-m", "dvc", "repro"], root, env=env).stdout


def test_user_files_and_model_run_prepare_to_infer(tmp_path):
    """A Qwen2 model through the whole DAG on the user's files, with the eval suite also run
    as an lm-evaluation-harness task (and gated on), and a self-improvement round on the
    prompts the gsm8k task derived."""
    architecture = "qwen2"
    model_dir = tmp_path / f"my-{architecture}"
    build_model(architecture, model_dir)
    root = tmp_path / "project"
    train = {"max_steps": 2, "save_steps": 2, "per_device_train_batch_size": 4}
    rounds = {"r1": {"after": "sft", "prompts": 8, "samples": 2, "max_new_tokens": 24, "train": train}}
    make_project(root, user_params(USER_FILES, model_dir, **HARNESS, improve={"rounds": rounds}))
    write_user_files(root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # DVC names the stages relative to the working directory
        ran = stage_order(root)
    run_and_commit(root, ran, uri)
    assert {"prepare", "sft", "rm", "prm", "policy@dpo", "evaluate", "gate", "infer"} <= set(ran)
    again = dvc_repro(root)
    assert not re.findall(r"Running stage", again), "dvc.lock records every stage: `dvc repro` runs nothing"

    manifest = json.loads((root / "data/prepared/manifest.json").read_text())
    assert manifest["origin"]["prefs_eval"].startswith("derived") and manifest["origin"]["unpaired"].startswith(
        "derived"
    )
    assert manifest["rows"]["prompts"] == 81 and manifest["rows"]["eval_heldout"] == 17
    prompts = pd.read_parquet(root / "data/prepared/prompts.parquet")
    assert prompts["answer"].notna().all(), "the gsm8k task reads every sft answer's `#### N`"
    prefs = pd.read_parquet(root / "data/prepared/prefs.parquet")
    assert prefs["prompt"].str.endswith(ASSISTANT).all(), "the implicit prompt ends at the assistant's turn"

    report = json.loads((root / "reports/eval.json").read_text())
    assert [s for s in report["suites"] if not s.startswith("harness/")] == ["heldout"]
    assert report["roles"]["decision"] == report["roles"]["report"] == "heldout" and "note" in report["roles"]
    sft = report["suites"]["heldout"]["sft"]
    assert sft["accuracy"] is not None and sft["accuracy"] > 0, "a model trained on the answers gets some right"
    assert "format_rate" not in sft or sft["format_rate"] is None, "gsm8k defines no format unless set"

    prm = json.loads((root / "metrics/prm.json").read_text())
    assert prm["derived_rows"] > 0 and 0.0 <= prm["step_accuracy"] <= 1.0, "step labels derived by rollouts"

    verdict = json.loads((root / "reports/gate.json").read_text())
    for result in verdict["candidates"].values():
        declared = [t for t in result["tests"] if not t["name"].startswith("validator:")]
        assert {t["metric"] for t in declared} == {"accuracy", "kl_to_ref"}, "gsm8k: accuracy and KL, no format"
        checks = {t["name"] for t in result["tests"]} - {t["name"] for t in declared}
        assert {"validator:perplexity", "validator:reward_hacking"} <= checks, "the validator's checks are tests"
        assert all(t["reason"] for t in result["tests"])
    # The harness scores the same greedy completions with the same task: the same accuracy.
    for model, metrics in report["suites"]["harness/rlhf_heldout"].items():
        assert metrics["accuracy"] == pytest.approx(report["suites"]["heldout"][model]["accuracy"]), model
    suites = {t["suite"] for r in verdict["candidates"].values() for t in r["tests"]}  # validator: heldout
    assert suites == {"heldout", "harness/rlhf_heldout"}
    infer = json.loads((root / "reports/infer.json").read_text())
    assert infer["suite"] == "heldout" and infer["strategies"]["greedy"]["accuracy"] is not None

    assert "improve@r1" in ran
    data = json.loads((root / "models/rounds/r1/round.json").read_text())["data"]
    assert (data["problems"], data["samples"]) == (8, 16)
    samples = pd.read_parquet(root / "data/rounds/r1/samples.parquet")
    heldout = set(pd.read_parquet(root / "data/prepared/eval/heldout.parquet")["prompt"])
    assert samples["prompt"].nunique() == 8 and not set(samples["prompt"]) & heldout, "no eval problem"
    assert samples["correct"].notna().all(), "every sampled answer checked by the gsm8k task"

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("rlhf-pipeline")
    stages = {r.data.tags.get("rlhf.stage") for r in client.search_runs([experiment.experiment_id])}
    assert {"prepare", "sft", "rm", "prm", "policy@dpo", "evaluate", "gate", "infer"} <= stages


def test_a_gpt2_model_trains_sft_and_dpo_on_the_users_files(tmp_path, monkeypatch, mlflow_store):
    """The other architecture family (GPT-2: Conv1D projections, learned positions) through
    the training stages on the same files: sft and policy@dpo train it and save it as a
    plain model of its own architecture. (The stages' mains in this process, in the order
    `dvc repro policy@dpo` runs them.)"""
    import torch
    from safetensors.torch import load_file

    import stages.base
    import stages.check_params
    import stages.policy
    import stages.prepare
    import stages.sft

    model_dir = tmp_path / "my-gpt2"
    build_model("gpt2", model_dir)
    root = tmp_path / "project"
    make_project(root, user_params(USER_FILES, model_dir, sft={"max_steps": 20, "save_steps": 20}))
    write_user_files(root)
    run_stages_in(monkeypatch, root)
    stages.check_params.main()
    stages.prepare.main()
    stages.base.main()
    stages.sft.main()
    stages.policy.main(["dpo"])
    start = load_file(model_dir / "model.safetensors")
    sft, dpo = (load_file(root / m / "model.safetensors") for m in ("models/sft", "models/policy/dpo"))
    assert json.loads((root / "models/sft/config.json").read_text())["model_type"] == "gpt2"
    assert any(not torch.equal(start[k], sft[k]) for k in start), "sft trained"
    assert any(not torch.equal(sft[k], dpo[k]) for k in sft), "dpo trained"
