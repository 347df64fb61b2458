"""Self-improvement rounds (stages/improve.py): the params of a round, the checks that keep
a sample, the round's gate, and the loop as DVC stages (one per round, a failed gate stops
it, a change to the last round reruns that round only)."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest
import yaml

from rlhf.params import ParamsError
from rlhf.tasks.arithmetic import ArithmeticTask
from rlhf.training.round_gate import default_tests, gate
from rlhf.training.rounds import (
    judge_samples,
    kept_rows,
    majority,
    preference_pairs,
    round_problems,
    train_candidate,
)
from stages import CHECKPOINTS_DIR, REF_LOGPS_CACHE
from stages.improve import SFT_DATA, Config, Settings
from tests.conftest import REPO, assert_each_once, make_project, params_problems, run, run_stages_in, tiny_params

TASK = ArithmeticTask()


def test_a_round_merges_its_keys_into_the_defaults():
    config = Config(
        defaults={"samples": 4, "train": {"max_steps": 50, "learning_rate": 5e-4}},
        rounds={"r1": {"after": "sft", "train": {"max_steps": 80}}, "r2": {"after": "rounds/r1", "samples": 2}},
    )
    first, second = config.settings("r1"), config.settings("r2")
    assert (first.samples, first.train.max_steps, first.train.learning_rate) == (4, 80, 5e-4)
    assert (second.samples, second.train.max_steps) == (2, 50)
    from rlhf.training.rounds import round_seed

    assert round_seed(0, "r1") != round_seed(0, "r2") and round_seed(3, "r1") == round_seed(0, "r1") + 3


@pytest.mark.parametrize(
    "rounds, message",
    [
        ({"r1": {"operands": [6, 6]}}, "rounds.r1.after: missing"),
        ({"r1": {"after": "rounds/r2"}, "r2": {"after": "sft"}}, "rounds.r1.after: 'rounds/r2' is not one of"),
        ({"r1": {"after": "sft", "sampels": 3}}, "rounds.r1.sampels: unknown key"),
        ({"r1": {"after": "sft", "operands": [7, 6]}}, "operands [7, 6]"),
        ({"r1": {"after": "sft", "method": "rpo", "ewc": {"strength": 1.0}}}, "with method rpo set rpo.ewc"),
        ({"r1": {"after": "sft", "method": "dpo"}}, "rounds.r1.method: Input should be 'sft' or 'rpo'"),
    ],
)
def test_bad_rounds_name_the_round_and_key(rounds, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Config(rounds=rounds)


def test_params_yaml_errors_name_the_round(tmp_path):
    from stages import load_all

    params = tiny_params(improve={"rounds": {"r1": {"after": "policy/dpo", "keep_per_prompt": 0}}})
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError, match=r"improve: .*rounds\.r1\.keep_per_prompt: Input should be greater than 0"):
        load_all(str(path))


def test_round_problems_follow_the_curriculum_and_skip_eval_problems():
    settings = Settings(prompts=50, operands=(6, 7))
    params = {"prepare": type("P", (), {"builtin": type("B", (), {"max_value": 29})()})()}
    prompts, answers = round_problems(settings, TASK, params, seed=1, exclude=set())
    assert len(set(prompts)) == 50
    assert {p.count("+") + p.count("-") + 1 for p in prompts} <= {6, 7}
    assert all(str(eval(p.strip())) == a for p, a in zip(prompts, answers))  # + and - only: eval is the answer
    again, _ = round_problems(settings, TASK, params, seed=1, exclude=set(prompts[:10]))
    assert not set(again) & set(prompts[:10]), "problems of the eval suites are never training problems"


def test_checks_keep_the_right_samples():
    right, wrong = "3+4=7; answer 7", "3+4=8; answer 8"
    samples = [[right, wrong, right, wrong], [wrong, wrong, wrong, right]]
    answers = ["7", "7"]
    by_answer = judge_samples(Settings(checks=["answer"]), TASK, ["3+4\n"] * 2, answers, samples, None)
    assert [[r["kept"] for r in group] for group in by_answer] == [[True, False, True, False], [False] * 3 + [True]]
    # No answer key: the majority answer is kept when at least min_vote_share of the samples state it.
    by_vote = judge_samples(
        Settings(checks=["vote"], min_vote_share=0.6), TASK, ["3+4\n"] * 2, [None] * 2, samples, None
    )
    assert [[r["kept"] for r in group] for group in by_vote] == [[False] * 4, [True, True, True, False]]
    assert majority(TASK, samples[1]) == ("8", 0.75)
    # A repair of problem 2 that states 7 is judged against its problem's samples (whose
    # majority, 8, it does not state), not as a group of one whose majority it is.
    alone = judge_samples(Settings(checks=["vote"], min_vote_share=0.6), TASK, ["3+4\n"], [None], [[right]], None)
    assert alone[0][0]["kept"], "a group of one is its own majority"
    repair = judge_samples(
        Settings(checks=["vote"], min_vote_share=0.6), TASK, ["3+4\n"], [None], [[right]], None,
        votes=[majority(TASK, samples[1])],
    )  # fmt: skip
    assert not repair[0][0]["kept"]
    # A sample cut at max_new_tokens is not kept, whatever its text passes.
    cut = judge_samples(
        Settings(checks=["answer"]), TASK, ["3+4\n"], ["7"], [[right, right]], None, finished=[[True, False]]
    )
    assert [r["kept"] for r in cut[0]] == [True, False] and [r["answer_check"] for r in cut[0]] == [True, True]
    assert kept_rows(["a", "b"], by_answer, keep_per_prompt=2) == [
        {"prompt": "a", "completion": right},
        {"prompt": "b", "completion": right},
    ]


def test_a_difficulty_a_suite_file_lacks_fails_in_check_params_and_in_the_round(tmp_path, monkeypatch):
    """A suite from the user's file (prepare.files.eval_hard, labels easy and hard): a gate
    test at `medium` stops check_params with the key and the file's labels; a suite without a
    difficulty column says so; a round reads the labels of the suite prepare wrote, before
    it samples anything."""
    import pandas as pd

    from stages import check_params
    from stages.improve import check_difficulties

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/raw").mkdir(parents=True)
    rows = [
        {"prompt": "2+3\n", "answer": "5", "difficulty": "easy"},
        {"prompt": "9+8\n", "answer": "17", "difficulty": "hard"},
        {"prompt": "4+4\n", "answer": "8", "difficulty": None},  # an empty cell: the label `missing`
    ]
    (tmp_path / "data/raw/hard.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data/raw/plain.jsonl").write_text(json.dumps({"prompt": "1+1\n", "answer": "2"}) + "\n")
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["prepare"]["files"] = {
        "eval_hard": {"path": "data/raw/hard.jsonl"},
        "eval_plain": {"path": "data/raw/plain.jsonl"},
    }
    data["gate"]["tests"] = [
        {"metric": "accuracy", "suite": "hard", "difficulty": ["hard", "medium"], "relative_to": "sft"},
        {"metric": "accuracy", "suite": "plain", "difficulty": "easy", "relative_to": "sft"},
        {"metric": "accuracy", "suite": "hard", "difficulty": "hard", "relative_to": "sft"},
    ]
    data["improve"]["rounds"] = {"r1": {"after": "sft", "progress_suite": "hard", "progress_difficulty": "medium"}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError) as error:
        check_params.main()
    assert error.value.problems == [
        "gate.tests[0]: suite 'hard' has no problem of difficulty medium (its difficulties: easy, hard, missing); "
        "name those, or null for every problem",
        "gate.tests[1]: suite 'plain' has no problem of difficulty easy (its difficulties: none: no answered "
        "problem has a difficulty); name those, or null for every problem",
        "improve.rounds.r1.progress_difficulty: suite 'hard' has no problem of difficulty medium (its "
        "difficulties: easy, hard, missing); name those, or null for every problem",
    ]
    assert not (tmp_path / "reports/params.ok").exists()

    # The file changed after check_params passed: the round finds it in what prepare wrote.
    from stages import load_all

    data["gate"]["tests"] = data["gate"]["tests"][2:]
    data["improve"]["rounds"]["r1"]["progress_difficulty"] = "hard"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    params = load_all()
    check_difficulties(params, "r1")  # nothing prepared yet: nothing to check against
    (tmp_path / "data/prepared/eval").mkdir(parents=True)
    pd.DataFrame(rows).assign(difficulty=["easy", "medium", None]).to_parquet(
        tmp_path / "data/prepared/eval/hard.parquet"
    )
    with pytest.raises(
        ParamsError,
        match=r"improve.rounds.r1.progress_difficulty: suite 'hard' has no problem of "
        r"difficulty hard \(its difficulties: easy, medium, missing\)",  # the empty cell as in the file
    ):
        check_difficulties(params, "r1")


def test_steps_check_rejects_a_right_answer_reached_by_a_wrong_path():
    """8+5-3+4 is 14; a chain that adds the numbers in another order lands on 14 too, and a
    slip can land on it: the answer check keeps all three, the steps check only the sound one."""
    sound = "8+5=13; 13-3=10; 10+4=14; answer 14"
    scrambled = "8+4=12; 12+5=17; 17-3=14; answer 14"
    slip = "8+5=12; 12-3=9; 9+4=14; answer 14"  # two wrong sums that cancel
    wrong = "8+5=13; 13-3=10; 10+4=15; answer 15"
    unfinished = ["8+5=13; 13-3=10", "8+5=13; 13-3=10; 10+4=14"]  # sound steps, no answer (cut off)
    samples = [[sound, scrambled, slip, wrong, *unfinished]]
    by_answer = judge_samples(Settings(checks=["answer"]), TASK, ["8+5-3+4\n"], ["14"], samples, None)
    assert [r["kept"] for r in by_answer[0]] == [True, True, True, False, False, False]
    by_steps = judge_samples(Settings(checks=["steps"]), TASK, ["8+5-3+4\n"], ["14"], samples, None)
    assert [r["kept"] for r in by_steps[0]] == [True, False, False, False, False, False]
    assert [r["correct"] for r in by_steps[0]] == [True, True, True, False, False, False]


def test_the_steps_check_needs_a_task_that_checks_steps(tmp_path):
    from stages import load_all

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["task"] = {"kind": "last_number"}
    data["improve"]["defaults"]["checks"] = ["steps"]
    data["improve"]["rounds"] = {
        "r1": {"after": "sft", "checks": ["answer", "steps"]},
        "r2": {"after": "rounds/r1"},
        "r3": {"after": "rounds/r2"},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError) as error:
        load_all(str(path))
    need = "the steps check needs a task that checks steps; task.kind 'last_number' does not (use answer, vote or prm)"
    assert f"improve.rounds.r1.checks: {need}" in error.value.problems
    assert error.value.problems.count(f"improve.defaults.checks: {need}") == 1  # r2 and r3 inherit it: named once

    data["improve"]["defaults"]["checks"] = ["answer"]
    data["improve"]["rounds"] = {"r1": {"after": "sft", "prefer": ["steps"]}}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError) as error:
        load_all(str(path))
    assert f"improve.rounds.r1.prefer: {need}" in error.value.problems


def test_kept_rows_take_the_most_sampled_right_chain_before_a_lucky_one_and_repairs_last():
    sound, lucky = "3+4=7; 7-2=5; answer 5", "3+4=8; 8-2=5; answer 5"  # a slip that lands on 5
    group = [{"completion": c, "kept": True} for c in (lucky, sound, sound, lucky, sound)]
    group += [
        {"completion": "x", "kept": False},
        {"completion": "3+4=7; 7-2=5;  answer 5", "kept": True, "source": "refined"},
    ]
    rows = kept_rows(["p"], [group], keep_per_prompt=1)
    assert rows == [{"prompt": "p", "completion": sound}]
    ranked = [r["completion"] for r in kept_rows(["p"], [group], keep_per_prompt=3)]
    assert ranked == [sound, lucky, "3+4=7; 7-2=5;  answer 5"]


def test_prefer_steps_trains_first_on_a_right_chain_in_the_problems_order_and_keeps_the_others():
    """`prefer: [steps]`: a problem whose samples reach its answer in the problem's order and
    in another order trains on the in-order chain, though the other was sampled more often;
    a problem with only the other kind still keeps it (unlike `checks: [steps]`), and rpo's
    chosen chain follows the same order."""
    in_order, reordered, wrong = "3+4=7; 7+5=12; answer 12", "3+5=8; 8+4=12; answer 12", "3+4=7; 7+5=13; answer 13"
    prompts, answers = ["3+4+5\n", "3+4+5\n"], ["12", "12"]
    samples = [[reordered, reordered, in_order, wrong], [reordered, wrong, wrong, reordered]]
    plain = judge_samples(Settings(checks=["answer"]), TASK, prompts, answers, samples, None)
    assert [r["completion"] for r in kept_rows(prompts, plain, 1)] == [reordered, reordered]
    preferring = judge_samples(Settings(checks=["answer"], prefer=["steps"]), TASK, prompts, answers, samples, None)
    assert [[r["kept"] for r in group] for group in preferring] == [[r["kept"] for r in group] for group in plain]
    assert [r["completion"] for r in kept_rows(prompts, preferring, 1)] == [in_order, reordered]
    assert [p["chosen"] for p in preference_pairs(prompts, preferring, 1)] == [in_order, reordered]
    filtering = judge_samples(Settings(checks=["answer", "steps"]), TASK, prompts, answers, samples, None)
    assert [r["completion"] for r in kept_rows(prompts, filtering, 1)] == [in_order]


def test_rpo_pairs_put_each_kept_chain_over_the_mistake_the_model_makes_most():
    sound, lucky = "3+4=7; 7-2=5; answer 5", "3+4=8; 8-2=5; answer 5"
    usual, rare = "3+4=7; 7-2=4; answer 4", "3+4=8; 8-2=6; answer 6"
    mixed = [{"completion": c, "kept": c in (sound, lucky)} for c in (rare, usual, sound, usual, lucky, sound)]
    mixed.append({"completion": "3+4=7; 7-2=3; answer 3", "kept": False, "source": "refined"})  # not the model's own
    solved = [{"completion": sound, "kept": True}] * 3  # nothing to prefer it over
    failed = [{"completion": usual, "kept": False}] * 3  # nothing to prefer
    verdicts = [mixed, solved, failed]
    assert preference_pairs(["p", "q", "r"], verdicts, 1) == [{"prompt": "p", "chosen": sound, "rejected": usual}]
    assert preference_pairs(["p", "q", "r"], verdicts, 3) == [
        {"prompt": "p", "chosen": sound, "rejected": usual},
        {"prompt": "p", "chosen": lucky, "rejected": rare},
    ]


def test_an_rpo_candidate_trains_from_the_round_start_against_it(in_project):
    """Method rpo trains the round's starting model (no models/sft exists here) with that
    model as DPO's reference: at the first step the policy is the reference, so the sigmoid
    loss is -log sigmoid(0) = log 2 exactly; the weights then move."""
    import math

    import pandas as pd
    import torch

    from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model
    from stages import load_model_stage

    tokenizer = build_tokenizer()
    start = in_project / "models/rounds/r0"
    save_model(build_tiny_model("micro", tokenizer, seed=3), tokenizer, start)
    table = in_project / "data/rounds/r1/train.parquet"
    table.parent.mkdir(parents=True)
    pairs = [
        {"prompt": f"{a}+{b}\n", "chosen": f"answer {a + b}", "rejected": f"answer {a - b}"}
        for a, b in ((3, 4), (5, 2), (6, 1), (2, 9))
    ]
    pd.DataFrame(pairs).to_parquet(table)
    rpo = {"sft_weight": 0.0, "max_steps": 2, "per_device_train_batch_size": 2, "logging_steps": 1, "save_steps": 2}
    settings = Settings(method="rpo", rpo=rpo)
    out = in_project / "models/rounds/r1/candidate"
    folders = {"checkpoints": CHECKPOINTS_DIR, "sft_data": SFT_DATA, "ref_cache": REF_LOGPS_CACHE}
    key_of = partial(load_model_stage()["improve"].key, "r1")
    metrics, curve = train_candidate(
        settings, key_of, start, table, out, "round-r1", table, trust_remote_code=False, **folders
    )
    assert metrics["steps"] == 2
    assert curve[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    before, after = _weights(start), _weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the candidate trained"


def _suite(values: list[float]) -> dict:
    return {
        "metrics": {"accuracy": sum(values) / len(values)},
        "outcomes": {"accuracy": values},
        "digest": f"d{len(values)}",
    }


def test_a_round_with_every_sample_cut_says_so_when_it_stops():
    """Nothing kept because every sample hit max_new_tokens (a chat model whose end of turn
    is not its EOS): the stop reason names that cause; with some samples finished it does not."""
    from rlhf.training.rounds import nothing_kept_reason

    settings = Settings(max_new_tokens=32)
    reason = nothing_kept_reason({"samples": 256, "unfinished_samples": 256}, settings)
    assert reason.startswith("no sample passed the checks: nothing to train on (every one of the 256 samples was cut")
    assert "max_new_tokens 32" in reason and "EOS token" in reason
    assert nothing_kept_reason({"samples": 256, "unfinished_samples": 10}, settings) == (
        "no sample passed the checks: nothing to train on"
    )


def test_the_round_gate_asks_for_progress_and_retention():
    settings = Settings(retention_margin=0.02, bootstrap_samples=500)
    tests = default_tests(settings, ["dev", "dev_long", "test"], "dev")
    assert [(t.name, t.suite, t.relative_to, t.op, t.threshold) for t in tests] == [
        ("progress", "dev_long", "champion", ">", 0.0),
        ("retention", "dev", "sft", ">=", -0.02),
    ]
    n = 200
    sft = {"dev": _suite([1.0] * n), "dev_long": _suite([0.0] * n)}
    start = sft
    better = {"dev": _suite([1.0] * n), "dev_long": _suite([1.0] * 60 + [0.0] * (n - 60))}
    verdict = gate(settings, tests, "r1", sft, start, better)
    assert verdict["promote"] == "r1"
    forgot = {"dev": _suite([1.0] * (n - 40) + [0.0] * 40), "dev_long": better["dev_long"]}
    verdict = gate(settings, tests, "r1", sft, start, forgot)
    assert verdict["promote"] is None
    assert [f.split(":")[0] for f in verdict["candidates"]["r1"]["failures"]] == ["retention"]
    same = gate(settings, tests, "r1", sft, start, sft)
    assert [f.split(":")[0] for f in same["candidates"]["r1"]["failures"]] == ["progress"]
    assert " vs the round's start over 200 problems: lower bound" in same["candidates"]["r1"]["failures"][0]


def test_a_round_gate_at_its_frontier_is_not_diluted():
    """dev_long: 100 problems of 6 numbers, 50 of 7 and 50 of 8. Round r2 (7 numbers) gains
    10 of the 7-number and 10 of the 8-number problems and loses 12 of the 6-number ones
    (mastered earlier): on all of dev_long, +8/200 = +0.04, whose interval holds 0, so
    `progress` fails; `progress_difficulty: [7, 8]` pairs the 100 problems of 7 and 8
    numbers only, +20/100 = +0.20, and the round passes."""
    labels = ["6"] * 100 + ["7"] * 50 + ["8"] * 50
    start_long = [1.0] * 80 + [0.0] * 20 + [1.0] * 20 + [0.0] * 30 + [1.0] * 10 + [0.0] * 40
    candidate_long = [1.0] * 68 + [0.0] * 32 + [1.0] * 30 + [0.0] * 20 + [1.0] * 20 + [0.0] * 30

    def suites(long: list[float]) -> dict:
        dev_long = _suite(long) | {"difficulty": labels}
        by = {k: sum(v for v, label in zip(long, labels) if label == k) / labels.count(k) for k in ("6", "7", "8")}
        counts = {k: labels.count(k) for k in by}
        dev_long["metrics"] |= {"accuracy_by_difficulty": by, "problems_by_difficulty": counts}
        return {"dev": _suite([1.0] * 200), "dev_long": dev_long}

    start, candidate = suites(start_long), suites(candidate_long)
    whole = Settings(bootstrap_samples=2000)
    verdict = gate(whole, default_tests(whole, ["dev", "dev_long"], "dev"), "r2", start, start, candidate)
    progress = verdict["candidates"]["r2"]["tests"][0]
    assert progress["difference"] == pytest.approx(8 / 200)
    assert progress["interval"][0] < 0 and not progress["passed"] and verdict["promote"] is None

    frontier = Settings(bootstrap_samples=2000, progress_difficulty=[7, 8])  # as YAML gives them
    tests = default_tests(frontier, ["dev", "dev_long"], "dev")
    assert (tests[0].name, tests[0].suite, tests[0].difficulty) == ("progress@7,8", "dev_long", ["7", "8"])
    verdict = gate(frontier, tests, "r2", start, start, candidate)
    progress = verdict["candidates"]["r2"]["tests"][0]
    assert progress["difference"] == pytest.approx(20 / 100) and progress["interval"][0] > 0.1
    assert "over 100 problems" in progress["reason"]
    assert progress["value"] == pytest.approx(0.5) and progress["baseline"] == pytest.approx(0.3)
    assert verdict["promote"] == "r2"
    assert Settings(progress_difficulty=8).progress_difficulty == ["8"]


def test_a_difficulty_the_suite_does_not_have_fails_before_compute(tmp_path):
    """Built-in suites: dev has 3-5 numbers, dev_long 6-8. A gate test at 9 numbers, a
    round's own progress_difficulty with a 9 and a default one at 2 are each named with the
    key to change; the frontier [6, 7, 8] passes."""
    from stages import load_all

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["prepare"]["builtin"]["long_operands"] = [6, 8]
    data["gate"]["tests"] = [{"metric": "accuracy", "suite": "dev_long", "difficulty": 9, "relative_to": "sft"}]
    data["improve"]["defaults"]["progress_difficulty"] = 2
    data["improve"]["rounds"] = {
        "r1": {"after": "sft", "operands": [6, 6], "progress_difficulty": [6, 9]},
        "r2": {"after": "rounds/r1", "operands": [7, 7]},
        "r3": {"after": "rounds/r2", "operands": [8, 8], "progress_difficulty": [8], "progress_suite": "dev"},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError) as error:
        load_all(str(path))
    assert error.value.problems == [
        "gate.tests[0]: suite 'dev_long' has no problem of difficulty 9 (its difficulties: 6, 7, 8); name those, "
        "or null for every problem",
        "improve.rounds.r1.progress_difficulty: suite 'dev_long' has no problem of difficulty 9 (its "
        "difficulties: 6, 7, 8); name those, or null for every problem",
        "improve.defaults.progress_difficulty: suite 'dev_long' has no problem of difficulty 2 (its "
        "difficulties: 6, 7, 8); name those, or null for every problem",
        "improve.rounds.r3.progress_difficulty: suite 'dev' has no problem of difficulty 8 (its difficulties: "
        "3, 4, 5); name those, or null for every problem",
    ]
    data["gate"]["tests"][0]["difficulty"] = 8
    data["improve"]["defaults"]["progress_difficulty"] = None
    data["improve"]["rounds"]["r1"]["progress_difficulty"] = [6, 7, 8]
    data["improve"]["rounds"]["r3"]["progress_suite"] = "dev_long"
    path.write_text(yaml.safe_dump(data))
    load_all(str(path))


# ----------------------------------------------------------------------------- the loop


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_rounds_as_dvc_stages(tmp_path, monkeypatch):
    """Three rounds on the micro project through `dvc repro`: r1 trains and passes, r2's gate
    rejects it (an impossible test) so the loop stops, r3 passes r2's winner through; a
    change to r3's params makes r3 alone stale. Two rounds beside the chain, run by their
    stage's main in this process on the same project: one that repairs every sample, one
    with nothing to pair."""
    import torch

    always = [{"metric": "kl_to_ref", "relative_to": "absolute", "op": "<=", "threshold": 1e9}]
    never = [{"metric": "kl_to_ref", "relative_to": "absolute", "op": "<=", "threshold": -1.0}]
    params = tiny_params(
        improve={
            "defaults": {
                "prompts": 6,
                "operands": [3, 3],
                "samples": 2,
                "max_new_tokens": 16,
                # The micro model writes no answers: a PRM bar every step clears keeps its samples.
                "checks": ["prm"],
                "prm_threshold": 1e-9,
                "train": {"max_steps": 2, "per_device_train_batch_size": 4, "save_steps": 2, "logging_steps": 1},
                "tests": always,
                "suites": ["dev"],
            },
            "rounds": {
                "r1": {"after": "sft"},
                # r2 evaluates a suite r1 did not: SFT and its start are evaluated on it too.
                "r2": {"after": "rounds/r1", "tests": never, "suites": ["dev", "test"]},
                "r3": {"after": "rounds/r2"},
                # A PRM bar no micro-model step clears: every sample is rejected and repaired.
                "fix": {"after": "sft", "refine": True, "refine_attempts": 2, "prm_threshold": 0.999},
                # One sample a problem: none has both a kept and a rejected one to pair.
                "pairs": {"after": "sft", "method": "rpo", "samples": 1},
            },
        }
    )
    root = make_project(tmp_path / "project", params)
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    # The stages before the rounds, run here and recorded by `dvc commit`: `dvc repro`
    # runs the rounds alone.
    from tests.conftest import run_and_commit
    from tests.test_pipeline_e2e import ran

    run_and_commit(root, ["check_params", "prepare", "base", "sft", "verifier", "prm"], env["MLFLOW_TRACKING_URI"])
    output = run([sys.executable, "-m", "dvc", "repro", "improve@r3"], root, env=env).stdout
    assert ran(output) == ["improve@r1", "improve@r2", "improve@r3"], output
    import stages.improve

    with monkeypatch.context() as mp:
        run_stages_in(mp, root, env["MLFLOW_TRACKING_URI"])
        stages.improve.main(["fix"])
        stages.improve.main(["pairs"])

    reports = {r: json.loads((root / f"models/rounds/{r}/round.json").read_text()) for r in ("r1", "r2", "r3")}
    assert reports["r1"]["passed"] and reports["r1"]["winner"] == "r1" and reports["r1"]["data"]["new_rows"] > 0
    assert reports["r2"]["passed"] is False and reports["r2"]["stopped_at"] == "r2"
    assert "kl_to_ref" in reports["r2"]["stop_reason"]
    assert set(reports["r2"]["sft"]) == set(reports["r2"]["winner_eval"]) == {"dev", "test"}
    assert reports["r3"]["stopped_at"] == "r2" and reports["r3"]["trained"] is False
    absent = json.loads((root / "data/rounds/r3/absent.json").read_text())  # not an empty out DVC warns of
    assert absent["reason"].startswith("round r3 drew no samples: ")
    sft, r1, r2, r3 = (_weights(root / f"models/{m}") for m in ("sft", "rounds/r1", "rounds/r2", "rounds/r3"))
    assert any(not torch.equal(sft[k], r1[k]) for k in sft), "round 1 trained"
    assert all(torch.equal(r1[k], r2[k]) and torch.equal(r1[k], r3[k]) for k in r1), "the winner stays r1"
    samples = __import__("pandas").read_parquet(root / "data/rounds/r1/samples.parquet")
    # A PRM bar every step clears keeps every sample that ended; one cut at max_new_tokens never.
    assert len(samples) == 6 * 2 and samples["kept"].any() and (samples["kept"] == samples["finished"]).all()
    summary = json.loads((root / "reports/rounds/r2.json").read_text())
    assert summary["stopped"] is True and summary["failures"]
    repair = json.loads((root / "models/rounds/fix/round.json").read_text())["data"]["repair"]
    assert repair["samples"] == 12 and repair["flagged"] == 12, "every rejected sample went to the repair"
    assert repair["repaired"] + repair["unrepaired"] == 12
    pairs = json.loads((root / "models/rounds/pairs/round.json").read_text())
    assert "train" not in pairs and "no pair to train on (method rpo)" in pairs["stop_reason"]
    assert pairs["data"]["kept_samples"] > 0 and pairs["data"]["training_rows"] == 0

    # Only round 3's entry changes: DVC would rerun round 3 and nothing before it.
    params["improve"]["rounds"]["r3"]["samples"] = 3
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = run([sys.executable, "-m", "dvc", "status"], root, env=env).stdout
    assert "improve@r3" in status and "improve@r1" not in status and "improve@r2" not in status

    import mlflow

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    names = set(mlflow.search_runs(search_all_experiments=True)["tags.mlflow.runName"])
    assert {"improve@r1", "improve@r2", "improve@r3", "improve@fix", "improve@pairs"} <= names


# ----------------------------------------------------------------------------- a user's own task


def test_rounds_a_user_task_cannot_feed_fail_in_check_params(tmp_path):
    """Rounds on a task without checkable answers, built-in problems for a user's task, and
    a PRM check with nothing to build the PRM from: each named by its key before compute."""

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["task"] = {"kind": "none"}
    for name in ("sft.jsonl", "e.jsonl"):
        (tmp_path / name).write_text('{"prompt": "hi", "completion": "hello"}\n')
    files = {"sft": {"path": str(tmp_path / "sft.jsonl")}, "eval_chat": {"path": str(tmp_path / "e.jsonl")}}
    data["prepare"] |= {"source": "files", "files": files}
    data["improve"]["rounds"] = {
        "r1": {"after": "sft", "operands": [6, 6]},
        "r2": {"after": "rounds/r1", "checks": ["prm"], "refine": True},
    }
    expected = [
        "improve.rounds: a round keeps samples and gates its candidate by their answers; task.kind 'none' has no "
        "checkable answers: choose a task kind that checks them, or set improve.rounds: {}",
        "improve.rounds.r1.operands: generates built-in problems, but task.kind is 'none', whose problems come from "
        "data/prepared/prompts.parquet: set it to null",
        "improve.rounds.r2.checks: the prm check needs a process reward model: add prepare.files.prm (step labels)",
        "improve.rounds.r2.refine: refine needs a process reward model: add prepare.files.prm (step labels)",
    ]
    assert_each_once(params_problems(tmp_path, data), expected)


def test_a_rounds_test_metrics_are_checked_before_compute(tmp_path):
    """A round's own tests name metrics its evaluation reports: a misspelt one, the reward
    (a round scores no reward model) and a format rate for a task without a format fail in
    check_params naming the key, not after the round sampled and trained (it stopped, with
    "metric missing"). Defaults' tests are named once."""
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["task"] = {"kind": "gsm8k"}
    test = {"relative_to": "sft", "op": ">=", "threshold": 0.0}
    data["improve"]["defaults"]["tests"] = [{"metric": "format_rate", **test}]
    data["improve"]["rounds"] = {
        "r1": {"after": "sft", "tests": [{"metric": "acuracy", **test}, {"metric": "reward", **test}]},
        "r2": {"after": "rounds/r1"},
        "r3": {"after": "rounds/r2"},
    }
    expected = [
        "improve.rounds.r1.tests[0].metric: no metric 'acuracy' in an eval suite's report (did you mean accuracy",
        "improve.rounds.r1.tests[1]: a round's evaluation scores no reward model, so it has no reward; test accuracy",
        "improve.defaults.tests[0]: task 'gsm8k' defines no format (set task.format_pattern)",
    ]
    found = params_problems(tmp_path, data)
    assert_each_once(found, expected)
    assert sum(p.startswith("improve.defaults.tests[0]:") for p in found) == 1


def test_a_rounds_suites_and_start_are_checked_before_compute(tmp_path, monkeypatch):
    """A round's suite names, a suite its tests read but it does not evaluate, and a start
    from a policy method the params do not train fail in check_params naming the key; a
    start from a champion folder without a model (nothing promoted yet) fails before any
    problem is drawn, saying so."""
    from rlhf.models.folders import UnusableModelError
    from stages.improve import check_start

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["improve"]["defaults"]["retention_suite"] = "tset"
    data["improve"]["rounds"] = {
        "r1": {"after": "policy/ppo", "suites": ["devv"], "progress_suite": "dev_lng"},
        "r2": {"after": "rounds/r1", "retention_suite": "dev", "suites": ["dev_long"]},
    }
    expected = [
        "improve.rounds.r1.suites: no eval suite 'devv'",
        "improve.rounds.r1.progress_suite: no eval suite 'dev_lng'",
        "improve.defaults.retention_suite: no eval suite 'tset'",
        "improve.rounds.r1.after: policy/ppo is not trained: policy.offline and policy.online list ['dpo']",
        "improve.rounds.r2.suites: the round's tests read ['dev'], which it does not evaluate (['dev_long'])",
    ]
    assert_each_once(params_problems(tmp_path, data), expected)

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models/champion").mkdir(parents=True)
    (tmp_path / "models/champion/README.md").write_text("no champion yet")
    with pytest.raises(UnusableModelError, match=r"^improve.rounds.r1.after: champion: models/champion holds no model"):
        check_start("r1", "champion", Path("models/champion"))


PREPARED_PROMPTS = Path("data/prepared/prompts.parquet")


def test_round_problems_of_a_user_table(tmp_path, monkeypatch):
    """prompts.parquet as a user's data makes it: distinct prompts, none from an eval suite,
    only answered ones for the answer check, chat prompts as messages; nothing left to sample
    is one message with the counts, before any model is loaded."""
    import pandas as pd

    from rlhf.tasks import TaskConfig, get_task

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/prepared").mkdir(parents=True)
    path = tmp_path / "data/prepared/prompts.parquet"

    def write(rows):
        pd.DataFrame({k: pd.Series([r[k] for r in rows], dtype=object) for k in rows[0]}).to_parquet(path)

    write(
        [
            {"prompt": "What is 1 plus 1?", "answer": "2"},
            {"prompt": "What is 1 plus 1?", "answer": "2"},  # the same prompt again
            {"prompt": "What is 3 plus 3?", "answer": "6"},  # in an eval suite
            {"prompt": "Say hello.", "answer": None},
        ]
    )
    task, exclude = get_task(TaskConfig(kind="gsm8k")), {"What is 3 plus 3?"}
    assert round_problems(Settings(checks=["answer"]), task, {}, 0, exclude, prompts_file=PREPARED_PROMPTS) == (
        ["What is 1 plus 1?"],
        ["2"],
    )
    prompts, answers = round_problems(Settings(checks=["vote"]), task, {}, 0, exclude, prompts_file=PREPARED_PROMPTS)
    assert sorted(prompts) == ["Say hello.", "What is 1 plus 1?"], "no answer key: unanswered prompts count too"
    with pytest.raises(ValueError) as error:
        round_problems(
            Settings(checks=["answer"]), task, {}, 0, exclude | {"What is 1 plus 1?"}, "r1", PREPARED_PROMPTS
        )
    assert str(error.value) == (
        "r1: no problem to sample: data/prepared/prompts.parquet has 4 prompts, 3 of them in an eval suite, 1 without "
        "an answer (the answer check needs one). Give prepare.files.prompts (prompt, answer) with prompts the eval "
        "suites do not hold"
    )
    with pytest.raises(ValueError, match=r"^r1.operands: generates built-in problems, but task.kind is 'gsm8k'"):
        round_problems(Settings(operands=(6, 6)), task, {}, 0, set(), "r1")
    chat = [{"role": "user", "content": "What is 2 plus 2?"}]
    write([{"prompt": chat, "answer": "4"}])
    assert round_problems(Settings(), task, {}, 0, set(), prompts_file=PREPARED_PROMPTS) == ([chat], ["4"]), (
        "a chat prompt: a list of messages"
    )

    # A conversation with a system turn in an eval suite file (Parquet reads it back as an
    # array of dicts) is that suite's problem, as prompts.parquet reads it too.
    from rlhf.training.rounds import eval_prompts

    system = [{"role": "system", "content": "Be brief."}, *chat]
    write([{"prompt": system, "answer": "4"}, {"prompt": chat, "answer": "4"}])
    (tmp_path / "data/prepared/eval").mkdir()
    pd.DataFrame({"prompt": pd.Series([system], dtype=object), "answer": ["4"]}).to_parquet(
        tmp_path / "data/prepared/eval/test.parquet"
    )
    exclude = eval_prompts([Path("data/prepared/eval/test.parquet")])
    assert round_problems(Settings(), task, {}, 0, exclude, prompts_file=PREPARED_PROMPTS) == ([chat], ["4"])


def test_chat_prompts_train_on_assistant_messages_and_each_problem_pairs_alone(tmp_path):
    """Rows for TRL's conversational format: a sampled text becomes an assistant message; a
    prompt listed twice gives each listing its own pairs (not both problems' samples)."""
    import pandas as pd

    from rlhf.training.rounds import sft_rows

    chat = [{"role": "user", "content": "2+2?"}]
    right, wrong = [{"completion": "4", "kept": True}], [{"completion": "5", "kept": False}]
    assert kept_rows([chat], [right + wrong], 1) == [
        {"prompt": chat, "completion": [{"role": "assistant", "content": "4"}]}
    ]
    pairs = preference_pairs([chat, "p", "p"], [right + wrong, right + wrong, right], 1)
    assert pairs == [
        {
            "prompt": chat,
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        },
        {"prompt": "p", "chosen": "4", "rejected": "5"},
    ]
    conversation = chat + [{"role": "assistant", "content": "4"}]
    table = pd.DataFrame({"messages": pd.Series([conversation], dtype=object)})
    table.to_parquet(tmp_path / "sft.parquet")
    assert sft_rows(tmp_path / "sft.parquet").to_dict("records") == [{"prompt": chat, "completion": conversation[1:]}]


def test_a_task_without_answers_is_never_asked_for_correctness():
    from rlhf.tasks import TaskConfig, get_task

    task = get_task(TaskConfig(kind="none"))
    verdicts = judge_samples(Settings(checks=["vote"]), task, ["hi"], ["an answer"], [["hello", "hey"]], None)
    assert [row["correct"] for row in verdicts[0]] == [None, None]
