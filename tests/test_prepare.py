"""Stage prepare with the data people have, and the params checks that say what is missing.

A user gives an sft file and an eval suite, maybe preference pairs: prepare derives the
held-out pairs, the unpaired rows and the prompts with their answers, writes the absent
tables with no rows, and records where every table came from; the built-in task and user
files mix in one prepare. Params that ask for what the data cannot feed fail before any
compute, naming the key to change or the file to add.
"""

from __future__ import annotations

import copy
import json

import pandas as pd
import pytest
import yaml

from rlhf.data.contracts import DataValidationError
from rlhf.tasks import TaskConfig, get_task
from stages import load_all
from stages.prepare import Config, run
from tests.conftest import REPO, assert_each_once, params_problems

GSM8K = get_task(TaskConfig(kind="gsm8k"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def user_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft = [{"q": f"What is {a} plus 1?", "a": f"{a} + 1 = {a + 1}\n#### {a + 1}"} for a in range(10)]
    sft.append({"q": "What is 0 plus 1?", "a": "0 + 1 = 1\n#### 1"})  # a repeated prompt
    sft.append({"q": "Say hello.", "a": "Hello!"})  # no `#### N`: no answer to read
    pairs = [{"prompt": f"{a}+1?", "chosen": f"#### {a + 1}", "rejected": f"#### {a}"} for a in range(20)]
    return {
        "sft": {"path": write_jsonl(tmp_path / "sft.jsonl", sft), "columns": {"prompt": "q", "completion": "a"}},
        "prefs": {"path": write_jsonl(tmp_path / "prefs.jsonl", pairs)},
        "eval_heldout": {"path": write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1?", "answer": "2"}])},
    }


def test_prepare_derives_held_out_pairs_unpaired_rows_and_prompts_with_answers(user_files):
    tables, origins = run(Config(source="files", files=user_files, heldout_share=0.25), GSM8K)
    assert len(tables["prefs_eval"]) == 5 and len(tables["prefs"]) == 15, "a quarter of 20 pairs held out"
    assert not set(tables["prefs_eval"]["prompt"]) & set(tables["prefs"]["prompt"])
    unpaired = tables["unpaired"]
    assert len(unpaired) == 30 and unpaired["label"].tolist() == [True, False] * 15, "the training pairs only"
    prompts = tables["prompts"]
    assert len(prompts) == 11, "one row per distinct sft prompt"
    answers = dict(zip(prompts["prompt"], prompts["answer"]))
    assert answers["What is 4 plus 1?"] == "5" and answers["Say hello."] is None
    for name in ("prm", "prm_eval"):
        assert len(tables[name]) == 0 and list(tables[name].columns) == ["prompt", "completions", "labels"]
    assert origins["prefs_eval"].startswith("derived: 5 pairs of 5 prompts held out") and origins["prm"].startswith(
        "absent"
    )
    assert origins["sft"] == user_files["sft"]["path"]


def test_held_out_pairs_take_whole_prompts_and_eval_prompts_seen_in_training_are_counted(user_files, tmp_path):
    """Three pairs per prompt (UltraFeedback's layout): prefs_eval holds whole prompts, none
    of them in prefs. Eval problems the SFT file holds too are counted per suite and table
    in the manifest (`eval_overlap`) and printed: a model is scored on what it trained on."""
    from stages.prepare import prepare

    pairs = [
        {"prompt": f"{a}+1?", "chosen": f"#### {a + 1}", "rejected": f"#### {a + b}"}
        for a in range(8)
        for b in (2, 3, 4)
    ]
    user_files["prefs"] = {"path": write_jsonl(tmp_path / "triples.jsonl", pairs)}
    problems = [{"prompt": "What is 4 plus 1?", "answer": "5"}, {"prompt": "9+9?", "answer": "18"}]
    user_files["eval_heldout"] = {"path": write_jsonl(tmp_path / "leak.jsonl", problems)}
    config = Config(source="files", files=user_files, heldout_share=0.25)
    tables, origins = run(config, GSM8K)
    held, kept = set(tables["prefs_eval"]["prompt"]), set(tables["prefs"]["prompt"])
    assert len(tables["prefs_eval"]) == 6 and len(held) == 2 and not held & kept
    manifest = prepare(tmp_path / "prepared", config, GSM8K)
    assert manifest["eval_overlap"] == {"eval_heldout": {"sft": 1, "prompts": 1}}


def test_an_eval_suite_without_answers_fails_for_a_task_that_scores_answers(user_files, tmp_path):
    """An answer column left unmapped (or mapped under a misspelt field) would make accuracy
    null and fail every candidate at the gate, after all the training: prepare says so."""
    user_files["eval_heldout"] = {"path": write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1?", "solution": "2"}])}
    with pytest.raises(
        DataValidationError, match=r"prepare.files.eval_heldout: no row has an answer, and task.kind 'gsm8k'"
    ):
        run(Config(source="files", files=user_files), GSM8K)


def test_a_prm_file_alone_gets_its_held_out_share(user_files, tmp_path):
    """Step labels given without prm_eval: a share of them is held out as prm_eval, as for
    preference pairs (the PRM stage needs both; it failed after SFT and the verifier)."""
    rows = [
        {"prompt": f"{a}+1+1?", "completions": [f"{a}+1={a + 1}", f"{a + 1}+1={a + 2}"], "labels": [True, a % 2 == 0]}
        for a in range(10)
    ]
    user_files["prm"] = {"path": write_jsonl(tmp_path / "steps.jsonl", rows)}
    config = Config(source="files", files=user_files, heldout_share=0.2)
    tables, origins = run(config, GSM8K)
    assert len(tables["prm_eval"]) == 2 and len(tables["prm"]) == 8
    assert not set(tables["prm_eval"]["prompt"]) & set(tables["prm"]["prompt"])
    assert origins["prm_eval"] == (
        "derived: 2 step-labelled solutions of 2 prompts held out of prm (heldout_share 0.2; no prompt on both sides)"
    )
    assert "prm_eval" in config.available()


def test_a_prm_step_that_holds_the_step_separator_is_refused_naming_its_row(user_files, tmp_path):
    """Steps of several lines under a task whose steps are lines: the PRM would be fitted on
    the file's steps and score solutions split at every line (best-of-N, MCTS, rounds)."""
    rows = [
        {"prompt": "x?", "completions": ["Let x = 1.", "So 2"], "labels": [True, True]},
        {"prompt": "y?", "completions": ["Let y = 1.", "\nThen 2y = 2.\nSo 2"], "labels": [True, False]},
    ]
    user_files["prm"] = {"path": write_jsonl(tmp_path / "steps.jsonl", rows)}
    with pytest.raises(DataValidationError, match=r"steps.jsonl.*row 2: step 2 holds the task's step separator '\\n'"):
        run(Config(source="files", files=user_files), GSM8K)
    rows[1]["completions"][1] = "\nThen 2y = 2."  # a blank line before a step is the step's own
    write_jsonl(tmp_path / "steps.jsonl", rows)
    assert len(run(Config(source="files", files=user_files, heldout_share=0.5), GSM8K)[0]["prm"]) == 1


def test_a_task_without_answers_derives_prompts_without_answers(user_files):
    tables, _ = run(Config(source="files", files=user_files), get_task(TaskConfig(kind="none")))
    assert tables["prompts"]["answer"].isna().all()


def test_without_preference_pairs_their_tables_are_empty_and_say_what_supplies_them(user_files):
    del user_files["prefs"]
    tables, origins = run(Config(source="files", files=user_files), GSM8K)
    assert all(len(tables[n]) == 0 for n in ("prefs", "prefs_eval", "unpaired"))
    assert origins["prefs"] == "absent: give prepare.files.prefs" and origins["unpaired"] == origins["prefs"]


def test_builtin_and_user_files_mix_in_one_prepare(user_files, tmp_path):
    extra = {"prefs": user_files["prefs"]}
    sizes = {"sft": 50, "prefs": 10, "prefs_eval": 4, "unpaired": 4, "prm": 4, "prm_eval": 4, "prompts": 4}
    builtin = {"sizes": {**sizes, "eval_dev": 4, "eval_test": 4}}
    tables, origins = run(Config(builtin=builtin, files=extra), get_task())
    assert len(tables["prefs"]) == 30 and origins["prefs"].startswith("builtin + ")
    assert len(tables["prefs_eval"]) == 4, "the built-in held-out pairs stay as they are"
    chat = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    messages = {"sft": {"path": write_jsonl(tmp_path / "chat.jsonl", chat)}}
    with pytest.raises(DataValidationError, match=r"prepare.files.sft: columns \['messages'\] cannot be added"):
        run(Config(builtin=builtin, files=messages), get_task())


def test_files_in_two_formats_fail_naming_each_table_and_its_file(user_files, tmp_path):
    """Chat preference pairs beside text SFT and eval files: DPO would train through the
    chat template while SFT, sampling and evaluation read plain text. prepare refuses,
    naming the tables of each format and their files; in one format the same data passes."""
    chat_pairs = [
        {
            "prompt": [{"role": "user", "content": f"{a}+1?"}],
            "chosen": [{"role": "assistant", "content": f"#### {a + 1}"}],
            "rejected": [{"role": "assistant", "content": f"#### {a}"}],
        }
        for a in range(20)
    ]
    user_files["prefs"]["path"] = path = write_jsonl(tmp_path / "chat_prefs.jsonl", chat_pairs)
    with pytest.raises(DataValidationError) as error:
        run(Config(source="files", files=user_files), GSM8K)
    assert path in error.value.path and user_files["sft"]["path"] in error.value.path
    (problem,) = error.value.problems
    assert problem.startswith(
        f"the prepared tables mix formats (messages: prefs ({path}), prefs_eval (derived: 2 pairs of 2 prompts held out"
    )
    assert f"text: sft ({user_files['sft']['path']}), " in problem and "eval_heldout (" in problem
    assert problem.endswith("Give every file in one format (all text or all messages)")
    chat_sft = [
        {"messages": [{"role": "user", "content": f"{a}+1?"}, {"role": "assistant", "content": f"#### {a + 1}"}]}
        for a in range(10)
    ]
    chat_eval = [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}]
    user_files["sft"] = {"path": write_jsonl(tmp_path / "chat_sft.jsonl", chat_sft)}
    user_files["eval_heldout"]["path"] = write_jsonl(tmp_path / "chat_eval.jsonl", chat_eval)
    tables, _ = run(Config(source="files", files=user_files), GSM8K)
    assert tables["prompts"]["prompt"].iloc[0] == [{"role": "user", "content": "0+1?"}]


def test_an_answer_the_task_cannot_read_fails_in_prepare_naming_file_and_row(user_files, tmp_path):
    """A numeric task's eval answer "N/A" would crash evaluate (or a round, after its
    sampling); prepare refuses it, naming the file and the row."""
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": None}, {"prompt": "?", "answer": "N/A"}]
    user_files["eval_heldout"]["path"] = write_jsonl(tmp_path / "eval.jsonl", rows)
    with pytest.raises(DataValidationError) as error:
        run(Config(source="files", files=user_files), GSM8K)
    assert error.value.problems == [
        f"{tmp_path / 'eval.jsonl'}: row 3: 'answer' task kind 'gsm8k' compares numbers, but the reference answer "
        "'N/A' is not one; correct it, or leave it empty (no answer)"
    ]
    run(Config(source="files", files=user_files), get_task(TaskConfig(kind="regex", pattern=r"#### (\S+)")))


# ----------------------------------------------------------------------------- params checks


@pytest.fixture
def params(tmp_path, user_files):
    """params.yaml's defaults with the user's files (source files, task gsm8k)."""
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["task"] = {"kind": "gsm8k"}
    data["prepare"]["source"] = "files"
    data["prepare"]["files"] = user_files
    return data


problems = params_problems


def test_the_acceptance_params_validate(tmp_path, params):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    load_all(str(path))


def test_missing_inputs_name_the_key_that_would_supply_them(tmp_path, params):
    data = copy.deepcopy(params)
    del data["prepare"]["files"]["prefs"]
    data["policy"]["offline"] = ["dpo", "kto"]
    data["policy"]["online"] = ["grpo"]
    data["policy"]["grpo"]["rewards"] = [{"name": "reward_model"}]
    data["infer"]["suite"] = "test"
    found = problems(tmp_path, data)
    expected = [
        "policy.offline: dpo needs prefs data: add prepare.files.prefs",
        "policy.offline: kto needs unpaired data: add prepare.files.prefs",
        "policy.grpo.rewards[0]: reward reward_model needs the reward model, which needs preference data",
        "infer.suite: no eval suite 'test' (prepare writes ['heldout']); add prepare.files.eval_test",
    ]
    assert_each_once(found, expected)
    assert len(found) == len(expected)


def test_evaluated_suites_hold_what_the_validator_and_the_gate_read(tmp_path, params):
    """evaluate.suites: [test] leaves out the decision suite (dev) that validate and the
    gate read by default, and a gate test names heldout: each fails with the params, not
    after the whole evaluation (validate found no completions, every gate test no metric)."""
    params["prepare"]["files"]["eval_dev"] = dict(params["prepare"]["files"]["eval_heldout"])
    params["prepare"]["files"]["eval_test"] = dict(params["prepare"]["files"]["eval_heldout"])
    params["evaluate"]["suites"] = ["test"]
    params["gate"]["tests"] = [{"metric": "accuracy", "suite": "heldout", "relative_to": "sft", "op": ">="}]
    params["gate"]["select_metric"] = "accuracy"
    fix = "add it to evaluate.suites, or set evaluate.suites: null (every suite)"
    assert problems(tmp_path, params) == [
        f"gate.tests[0].suite: suite 'heldout' is read from the eval report, but evaluate.suites is ['test']; {fix}",
        f"evaluate.suites: ['test'] leaves out the decision suite 'dev', which validate.suite, gate.select_suite "
        f"read by default; {fix}",
    ]
    params["evaluate"]["suites"] = ["test", "dev", "heldout"]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    load_all(str(path))


def test_a_gate_metric_no_suite_reports_fails_naming_the_key(tmp_path, params):
    """A misspelt metric would reject every candidate forever ("metric missing"), and a
    misspelt selection metric fail once one passes; both are named with the params. A
    harness suite's metrics are lm-eval's own and are not checked here."""
    params["gate"]["tests"] = [
        {"metric": "acuracy", "relative_to": "sft"},
        {"metric": "acc_norm", "suite": "harness/hellaswag", "relative_to": "sft"},
    ]
    params["gate"]["select_metric"] = "format"
    params["evaluate"]["harness"] = {"tasks": ["hellaswag"]}
    found = problems(tmp_path, params)
    assert found[0].startswith(
        "gate.tests[0].metric: no metric 'acuracy' in an eval suite's report (did you mean accuracy"
    )
    assert found[1].startswith(
        "gate.select_metric: no metric 'format' in an eval suite's report (did you mean format_rate"
    )
    assert len(found) == 2, found


def test_a_prompts_file_without_answers_is_prepared_with_an_empty_answer_column(user_files, tmp_path):
    """`answer` is optional in a prompts file: the prepared table has the column, empty, so
    that the stages reading it (the PRM's derived labels, the rounds) find no answer rather
    than fail on a missing column (stage prm raised KeyError: 'answer')."""
    user_files["prompts"] = {"path": write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hi"}, {"prompt": "yo"}])}
    tables, _ = run(Config(source="files", files=user_files), GSM8K)
    assert list(tables["prompts"].columns) == ["prompt", "answer"]
    assert tables["prompts"]["answer"].isna().all()


def test_a_prompt_with_demonstrations_of_different_answers_is_warned_of(user_files, capsys):
    """Two demonstrations of one prompt with different answers: prompts keeps the first
    (the answer rewards count the other wrong), and prepare says so with an example. The
    repeated prompt of the fixture, with the same answer both times, is no conflict."""
    path = user_files["sft"]["path"]
    with open(path, "a") as file:
        file.write(json.dumps({"q": "What is 3 plus 1?", "a": "3 + 1 = 5\n#### 5"}) + "\n")
    tables, _ = run(Config(source="files", files=user_files), GSM8K)
    assert dict(zip(tables["prompts"]["prompt"], tables["prompts"]["answer"]))["What is 3 plus 1?"] == "4"
    out = capsys.readouterr().out
    assert "prepare: warning: 1 sft prompt(s) have demonstrations with different answers (e.g. 'What is 3 plus " in out
    assert "1?': 4, 5); prompts keeps the first" in out


def test_a_task_that_reads_no_answer_in_the_demonstrations_is_refused_or_warned_of(user_files, capsys):
    """GSM8K-style files under the default task.kind (builtin, `answer N`) read no answer:
    an error naming the sft file and the kinds to set (the kind was most likely left as it
    was). Under a kind chosen that reads none of them (a regex for `ANSWER=N`) only a
    warning: SFT on general data scored on a task is a use. Under gsm8k, neither."""
    with pytest.raises(DataValidationError) as error:
        run(Config(source="files", files=user_files), get_task())
    assert str(error.value).startswith(f"{user_files['sft']['path']}: 1 problem(s) found:\n  none of the 12 sft")
    assert "set task.kind to the kind that reads your files' answers (gsm8k, math" in str(error.value)
    run(Config(source="files", files=user_files), get_task(TaskConfig(kind="regex", pattern=r"ANSWER=(\d+)")))
    assert "prepare: warning: task.kind 'regex' reads no answer in any of the 12 sft demonstrations" in (
        capsys.readouterr().out
    )
    run(Config(source="files", files=user_files), GSM8K)
    assert "warning" not in capsys.readouterr().out


def test_file_entries_that_nothing_would_read_fail_with_the_params(tmp_path, params):
    """A held-out file without the file it is held out of (the RM and PRM would train
    without it, on nothing or on derived labels), a Hub `config` on a local file, and an
    eval suite with no name (written as data/prepared/eval/.parquet)."""
    data = copy.deepcopy(params)
    prefs = data["prepare"]["files"].pop("prefs")
    data["prepare"]["files"]["prefs_eval"] = prefs
    data["prepare"]["files"]["prm_eval"] = prefs
    data["prepare"]["files"]["eval_"] = dict(data["prepare"]["files"]["eval_heldout"])
    data["prepare"]["files"]["eval_heldout"]["config"] = "main"
    data["policy"]["offline"], data["policy"]["online"] = [], ["grpo"]
    data["policy"]["grpo"]["rewards"] = [{"name": "answer_match"}]
    found = " ".join(problems(tmp_path, data))
    for expected in [
        "files.eval_: name the suite after eval_ (e.g. eval_heldout)",
        f"files.eval_heldout.config: {tmp_path / 'eval.jsonl'} is a local path; config names a Hub dataset's",
        "files.prefs_eval: given without files.prefs, which it is held out of; add files.prefs, or remove prefs_eval",
        "files.prm_eval: given without files.prm, which it is held out of",
    ]:
        assert found.count(expected) == 1, (expected, found)


def test_a_selection_metric_the_run_does_not_measure_fails_with_the_params(tmp_path, params):
    """gate.select_metric ranks the candidates that pass: one the run never measures (a
    reward without preference data, a format the task lacks, a KL not measured, accuracy
    without answers) failed in the gate, after the whole pipeline, once one passed."""
    data = copy.deepcopy(params)
    del data["prepare"]["files"]["prefs"]
    data["policy"]["offline"], data["policy"]["online"], data["infer"]["strategies"] = [], ["grpo"], ["greedy"]
    data["policy"]["grpo"]["rewards"] = [{"name": "answer_match"}]
    for metric, expected in [
        ("reward", "gate.select_metric: metric reward needs the reward model, which needs preference data"),
        ("format_rate", "gate.select_metric: task 'gsm8k' defines no format (set task.format_pattern)"),
        ("kl_to_ref", "gate.select_metric: kl_to_ref is not measured with evaluate.kl_prompts 0; set kl_prompts "
         "above 0, or choose another metric"),
    ]:  # fmt: skip
        data["gate"]["select_metric"] = metric
        data["evaluate"]["kl_prompts"] = 0
        assert any(p.startswith(expected) for p in problems(tmp_path, data)), metric
    data["task"] = {"kind": "none"}
    data["gate"]["select_metric"] = "accuracy"
    assert any(
        p.startswith("gate.select_metric: metric accuracy needs checkable answers") for p in problems(tmp_path, data)
    )


def test_a_task_without_answers_cannot_feed_answer_rewards_or_derive_step_labels(tmp_path, params):
    data = copy.deepcopy(params)
    data["task"] = {"kind": "none"}
    data["policy"]["online"] = ["grpo"]
    data["policy"]["grpo"]["rewards"] = [{"name": "answer_match"}]
    found = problems(tmp_path, data)
    assert any(p.startswith("policy.grpo.rewards[0]: reward answer_match needs checkable answers") for p in found)
    assert any(p.startswith("infer.strategies: strategy mcts needs a process reward model") for p in found)
    assert any(p.startswith("infer.best_of_n.rewards[0]: best_of_n reward prm needs a process") for p in found)
    data["evaluate"]["harness"] = {"suites": ["heldout"]}
    data["merge"]["method"] = "greedy_soup"
    found = problems(tmp_path, data)
    assert any(p.startswith("evaluate.harness.suites: a suite run as a harness task is scored by its") for p in found)
    assert any(p.startswith("merge.method: greedy_soup adds a model to the soup when it raises task") for p in found)
    data["evaluate"]["harness"]["include_path"] = str(tmp_path / "no_such_folder")
    (found,) = problems(tmp_path, data)
    assert found.startswith("evaluate.harness.include_path: ") and "no_such_folder is not a folder" in found


def test_inference_strategies_that_cannot_work_for_the_task_fail_in_check_params(tmp_path, params):
    data = copy.deepcopy(params)
    data["infer"]["best_of_n"]["rewards"] = [{"name": "answer_match"}, {"name": "format"}, {"name": "length"}]
    found = problems(tmp_path, data)
    assert found == [
        "infer.best_of_n.rewards[0]: answer_match reads the reference answer, which best-of-N must not see (it "
        "would pick the right sample); use one that reads no answer: prm, reward_model, format, length or repetition",
        "infer.best_of_n.rewards[1]: the format reward needs a pattern: task 'gsm8k' defines no format; give the "
        "reward a `pattern` (a regular expression a well-formed reply matches), set task.format_pattern, or remove "
        "the entry",
    ]
    data["infer"]["best_of_n"]["rewards"] = [{"name": "length"}]
    data["task"] = {"kind": "none"}
    found = problems(tmp_path, data)
    assert any(p.startswith("infer.strategies: self_consistency votes on answers; task.kind 'none'") for p in found)


def test_a_harness_score_is_a_gate_suite_but_not_a_suite_to_run(tmp_path, params):
    data = copy.deepcopy(params)
    data["evaluate"]["harness"] = {"suites": ["heldout"]}
    data["gate"]["tests"] = [{"metric": "accuracy", "suite": "harness/rlhf_heldout", "relative_to": "sft"}]
    data["infer"]["suite"] = "harness/rlhf_heldout"
    assert problems(tmp_path, data) == [
        "infer.suite: 'harness/rlhf_heldout' is an lm-evaluation-harness score, not a suite of problems this stage "
        "can run; name one of ['heldout']"
    ]


def test_the_default_gate_of_a_task_without_answers_needs_preference_data(tmp_path, params):
    data = copy.deepcopy(params)
    data["task"] = {"kind": "none"}
    del data["prepare"]["files"]["prefs"]
    data["policy"]["offline"] = []
    data["policy"]["online"] = ["grpo"]
    data["policy"]["grpo"]["rewards"] = [{"name": "length"}]
    data["infer"]["strategies"] = ["greedy"]
    found = problems(tmp_path, data)
    assert found == [
        "gate: task.kind 'none' has no checkable answers, so the default gate judges the reward model's reward, "
        "which needs preference data: add prepare.files.prefs, or set gate.tests and gate.select_metric"
    ]


def test_derived_prompts_are_what_the_online_methods_read(user_files):
    tables, _ = run(Config(source="files", files=user_files), GSM8K)
    assert set(tables["prompts"].columns) == {"prompt", "answer"}
    assert isinstance(tables["prompts"], pd.DataFrame)
