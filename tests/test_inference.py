"""Inference-time strategies on micro models built in the test.

Untrained micro models check what holds for any model (speculative decoding and logit
ensembles reproduce greedy decoding). Micro models trained for about a second on one
problem give answers the tests control: `good` greedily writes the right solution of
12+7-3, `bad` a wrong one (a slip carried forward), and `mixed` (trained on both) samples
a mix of their steps, so a search or a rerank that reads the steps can do better than
its greedy answer (a wrong one). Also checked: the `generate` command's and params.yaml's
defaults are the settings' defaults."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from rlhf.inference import strategies
from rlhf.inference.generate import main as generate_main
from rlhf.inference.generate import parse_args, settings_from
from rlhf.inference.settings import MCTS, BestOfN, SelfConsistency, Strategies
from rlhf.inference.strategies import (
    best_of_n,
    ensemble_logits,
    ensemble_vote,
    greedy,
    run_strategy,
    sample,
    self_consistency,
    speculative,
    vote_is_decided,
)
from rlhf.models.generation import generate
from rlhf.models.loading import build_tiny_model, build_tokenizer
from rlhf.tasks import get_task
from rlhf.tasks.arithmetic import ArithmeticTask, check_steps
from tests.conftest import fit_texts

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["12+7-3\n", "4+4+4+4\n", "29-9\n"]

PROBLEM = "12+7-3\n"
GOOD = "12+7=19; 19-3=16; answer 16"  # every step right
BAD = "12+7=18; 18-3=15; answer 15"  # a slip in the first step, carried forward
BUDGET = 40  # tokens: a whole solution (27 characters) and its end-of-sequence token


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def task():
    return ArithmeticTask()


@pytest.fixture(scope="module")
def models(tokenizer):
    """Two untrained micro models (seeds 0 and 1)."""
    return [build_tiny_model("micro", tokenizer, seed=seed).eval() for seed in (0, 1)]


def train_on(tokenizer, completions: list[str], steps: int = 150) -> torch.nn.Module:
    """A micro model trained (full batch, Adam) on PROBLEM followed by each completion."""
    model = build_tiny_model("micro", tokenizer, seed=0)
    fit_texts(model, tokenizer, [PROBLEM + c + tokenizer.eos_token for c in completions], steps, lr=1e-2)
    return model


@pytest.fixture(scope="module")
def good(tokenizer):
    model = train_on(tokenizer, [GOOD])
    assert greedy(model, tokenizer, [PROBLEM], BUDGET)[0].completion == GOOD
    return model


@pytest.fixture(scope="module")
def bad(tokenizer):
    model = train_on(tokenizer, [BAD])
    assert greedy(model, tokenizer, [PROBLEM], BUDGET)[0].completion == BAD
    return model


@pytest.fixture(scope="module")
def mixed(tokenizer):
    model = train_on(tokenizer, [GOOD, BAD])
    assert greedy(model, tokenizer, [PROBLEM], BUDGET)[0].completion != GOOD, "the greedy answer should be wrong"
    return model


def exact_step_scorer(prompts, steps_lists, finished=None):
    """A stand-in PRM: 1.0 for each step the task's exact checker labels good, else 0.0."""
    return [[float(label) for label in check_steps(p, "; ".join(s))] for p, s in zip(prompts, steps_lists)]


def inverted_step_scorer(prompts, steps_lists, finished=None):
    """Rates exactly the steps `exact_step_scorer` rejects."""
    return [[1.0 - score for score in row] for row in exact_step_scorer(prompts, steps_lists)]


# ----------------------------------------------------------------------------- greedy, speculative, logits


@pytest.mark.slow
def test_speculative_output_equals_the_targets_greedy_output(models, tokenizer):
    """Assisted generation with a different draft model changes only how the target's
    tokens are found: the text is the target's greedy text, within the 20-token budget."""
    target, draft = models
    plain = [generate(target, tokenizer, [p], max_new_tokens=20)[0] for p in PROMPTS]
    assisted = speculative(target, draft, tokenizer, PROMPTS, max_new_tokens=20, num_assistant_tokens=4)
    assert [a.completion for a in assisted] == plain
    assert all(0 < a.tokens <= 20 for a in assisted)


@pytest.mark.slow
def test_logit_ensemble_of_one_model_is_its_greedy_decoding(models, tokenizer):
    """One member: the mean of one log-softmax is that model's, so the ensemble decodes
    its greedy text; the same model twice averages to itself too (prompts of different
    lengths, so left padding is exercised)."""
    plain = generate(models[0], tokenizer, PROMPTS, max_new_tokens=20, details=True)
    alone = ensemble_logits(models[:1], tokenizer, PROMPTS, 20)
    assert [a.completion for a in alone] == plain.texts and [a.tokens for a in alone] == plain.tokens
    assert [a.completion for a in ensemble_logits([models[0], models[0]], tokenizer, PROMPTS, 20)] == plain.texts
    in_pairs = ensemble_logits(models[:1], tokenizer, PROMPTS, 20, batch_size=2)
    assert [(a.completion, a.tokens) for a in in_pairs] == [(a.completion, a.tokens) for a in alone]


@pytest.mark.slow
def test_logit_ensemble_follows_the_mean_log_probs_at_every_token(good, bad, tokenizer):
    """Two different members (the good and the bad solver): every token of the batched,
    cached ensemble equals the argmax of the mean of the two log-softmaxes recomputed from
    scratch for each prompt alone, up to the end-of-sequence token."""
    prompts = [PROBLEM, "4+4\n", "29-9+1\n"]
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)["input_ids"]
            new = []
            for _ in range(BUDGET):
                mean = sum(m(input_ids=ids).logits[0, -1].log_softmax(-1) for m in (good, bad)) / 2
                token = int(mean.argmax())
                new.append(token)
                if token == tokenizer.eos_token_id:
                    break
                ids = torch.cat([ids, torch.tensor([[token]])], 1)
            expected.append(tokenizer.decode(new, skip_special_tokens=True))
    assert [a.completion for a in ensemble_logits([good, bad], tokenizer, prompts, BUDGET)] == expected


# ----------------------------------------------------------------------------- ensemble vote


@pytest.mark.slow
def test_ensemble_vote_picks_the_majority_answer(good, bad, tokenizer, task):
    """Greedy answers: good -> 16, bad -> 15. Members [bad, good, good]: 16 has 2 votes,
    15 has 1 -> the good solution wins with 2 votes; 3 samples; tokens are the three
    greedy completions' tokens (27 characters + end-of-sequence = 28 each, 84)."""
    assert task.extract_answer(greedy(good, tokenizer, [PROBLEM], BUDGET)[0].completion) == "16"
    assert task.extract_answer(greedy(bad, tokenizer, [PROBLEM], BUDGET)[0].completion) == "15"
    (answer,) = ensemble_vote([bad, good, good], tokenizer, [PROBLEM], task, BUDGET)
    assert answer.completion == GOOD
    assert answer.extra["votes"] == 2 and answer.samples == 3 and answer.tokens == 3 * 28 == 84


@pytest.mark.slow
def test_ensemble_vote_breaks_ties_by_member_order(good, bad, tokenizer, task):
    """One vote each for 16 and 15: the earlier member's answer wins, so [bad, good]
    returns the bad solution and [good, bad] the good one, each with 1 vote."""
    (first_bad,) = ensemble_vote([bad, good], tokenizer, [PROBLEM], task, BUDGET)
    (first_good,) = ensemble_vote([good, bad], tokenizer, [PROBLEM], task, BUDGET)
    assert (first_bad.completion, first_bad.extra["votes"]) == (BAD, 1)
    assert (first_good.completion, first_good.extra["votes"]) == (GOOD, 1)


@pytest.mark.slow
def test_ensemble_vote_without_any_answer_returns_the_first_members_text(models, tokenizer, task):
    """Untrained members state no answer: no votes (0), and the completion is the first
    member's greedy text."""
    per_model = [greedy(m, tokenizer, PROMPTS, 8) for m in models]
    assert all(task.extract_answer(a.completion) is None for answers in per_model for a in answers)
    answers = ensemble_vote(models, tokenizer, PROMPTS, task, 8)
    assert [a.completion for a in answers] == [a.completion for a in per_model[0]]
    assert all(a.extra["votes"] == 0 and a.samples == 2 for a in answers)


# ----------------------------------------------------------------------------- self-consistency


def test_vote_is_decided_by_the_rule():
    """Leader 3, runner-up 1, 1 vote left: 3 > 1 + 1 -> decided (share 3/4 < 1.0 plays no
    part). Leader 2, runner-up 1, 2 left: 2 > 1 + 2 is false and share 2/3 < 0.9 -> not
    decided; with stop_share 0.6, 2/3 >= 0.6 -> decided. Leader 3, runner-up 1, 2 left:
    3 > 1 + 2 is false (a tie is still possible), share 3/4 < 0.8 -> not decided. A lone
    answer with 4 of 4 votes and 12 left: 4 > 0 + 12 is false, share 4/4 >= 0.75 ->
    decided. No votes: decided only when none are left."""
    assert vote_is_decided(Counter({"5": 3, "6": 1}), remaining=1, stop_share=1.0, taken=4)
    assert not vote_is_decided(Counter({"5": 2, "6": 1}), remaining=2, stop_share=0.9, taken=3)
    assert vote_is_decided(Counter({"5": 2, "6": 1}), remaining=2, stop_share=0.6, taken=3)
    assert not vote_is_decided(Counter({"5": 3, "6": 1}), remaining=2, stop_share=0.8, taken=4)
    assert vote_is_decided(Counter({"16": 4}), remaining=12, stop_share=0.75, taken=4)
    assert not vote_is_decided(Counter(), remaining=2, stop_share=0.5, taken=2)
    assert vote_is_decided(Counter(), remaining=0, stop_share=0.5, taken=2)


@pytest.mark.slow
def test_self_consistency_stops_early_when_the_vote_is_unanimous(good, tokenizer, task):
    """At temperature 1e-4 every sample of the good solver is its greedy solution: the
    first round of 4 votes 4 for 16; 4 > 0 + 12 is false but the share 4/4 >= 0.75 stops
    it after 4 samples. Without the early stop it takes all 16, and 16 votes for 16."""
    options = SelfConsistency(max_samples=16, round_size=4, stop_share=0.75, temperature=1e-4)
    (early,) = self_consistency(good, tokenizer, [PROBLEM], task, options, BUDGET)
    (full,) = self_consistency(good, tokenizer, [PROBLEM], task, options, BUDGET, early_stop=False)
    assert (early.samples, early.extra["votes"], early.extra["answer"], early.completion) == (4, 4, "16", GOOD)
    assert (full.samples, full.extra["votes"], full.extra["answer"], full.completion) == (16, 16, "16", GOOD)


@pytest.mark.slow
def test_self_consistency_returns_the_majority_of_its_samples(mixed, tokenizer, task):
    """Without the early stop, 2 rounds of 4 samples (seeds 0 and 1): the answer is the
    most common extracted answer over those 8 samples, with its count as votes, and the
    completion is the first sample that states it; tokens add up over all 8."""
    options = SelfConsistency(max_samples=8, round_size=4, temperature=1.0)
    (answer,) = self_consistency(mixed, tokenizer, [PROBLEM], task, options, BUDGET, early_stop=False)
    rounds = [sample(mixed, tokenizer, [PROBLEM], 4, BUDGET, 1.0, 64, seed, details=True) for seed in (0, 1)]
    drawn = [c for r in rounds for c in r.texts[0]]
    assert all(ended for r in rounds for ended in r.finished), "every sample ends within the budget: each votes"
    votes = Counter(task.extract_answer(c) for c in drawn if task.extract_answer(c) is not None)
    (winner, count), *rest = votes.most_common()
    assert rest and count > rest[0][1], "the samples should disagree, with one clear leader"
    assert (answer.extra["answer"], answer.extra["votes"], answer.samples) == (winner, count, 8)
    assert answer.completion == next(c for c in drawn if task.extract_answer(c) == winner)
    assert answer.tokens == sum(t for r in rounds for t in r.tokens[0]) and answer.extra["unfinished"] == 0


# ----------------------------------------------------------------------------- best-of-n


@pytest.mark.slow
def test_best_of_n_returns_the_best_scored_sample(mixed, tokenizer):
    """Scorer: the number of good steps (exact checker). The answer is the first of the
    same 8 samples (seed 0) with the highest score, which is not every sample's score,
    and tokens add up over all 8."""

    def good_steps(prompts, completions):
        return [sum(check_steps(p, c)) for p, c in zip(prompts, completions)]

    (answer,) = best_of_n(mixed, tokenizer, [PROBLEM], good_steps, BestOfN(n=8, temperature=1.0), BUDGET)
    drawn = sample(mixed, tokenizer, [PROBLEM], 8, BUDGET, 1.0, 64, 0, details=True)
    (group,) = drawn.texts
    scores = good_steps([PROBLEM] * 8, group)
    assert len(set(scores)) > 1, "the samples should differ in score"
    assert answer.completion == group[scores.index(max(scores))]
    assert answer.extra["score"] == max(scores) and answer.samples == 8
    assert answer.tokens == sum(drawn.tokens[0]) <= 8 * BUDGET


# ----------------------------------------------------------------------------- dispatch and the command


@pytest.mark.slow
def test_run_strategy_dispatches_with_the_settings(mixed, tokenizer, task):
    """greedy = greedy(max_new_tokens); best_of_n with a format reward = best_of_n with
    that scorer, the settings' options, budget and seed; mcts without a PRM, or an unknown
    name, is an error."""
    settings = Strategies(
        max_new_tokens=BUDGET, seed=3, best_of_n={"n": 4, "temperature": 1.0, "rewards": [{"name": "format"}]}
    )
    assert run_strategy("greedy", settings, mixed, tokenizer, [PROBLEM], task) == greedy(
        mixed, tokenizer, [PROBLEM], BUDGET
    )

    def formatted(prompts, completions):
        return [float(task.is_well_formatted(c)) for c in completions]

    expected = best_of_n(mixed, tokenizer, [PROBLEM], formatted, settings.best_of_n, BUDGET, seed=3)
    assert run_strategy("best_of_n", settings, mixed, tokenizer, [PROBLEM], task) == expected
    with pytest.raises(ValueError, match="process reward model"):
        run_strategy("mcts", settings, mixed, tokenizer, [PROBLEM], task)
    with pytest.raises(ValueError, match="unknown strategy"):
        run_strategy("beam", settings, mixed, tokenizer, [PROBLEM], task)


def test_generate_command_defaults_are_the_strategies_defaults():
    """No flags but --model: the settings are Strategies() (trust_remote_code is the flag's
    False, also the default). --trust-remote-code changes that one setting only."""
    settings = settings_from(parse_args(["--model", "m", "12+7-3"]))
    assert settings.model_dump() == Strategies().model_dump()
    trusted = settings_from(parse_args(["--model", "m", "--trust-remote-code", "12+7-3"]))
    assert trusted.model_dump() == Strategies(trust_remote_code=True).model_dump()


def test_generate_command_flags_land_in_their_settings():
    """Each flag sets its own setting; --temperature sets all three sampling strategies';
    --prm is both the MCTS PRM and the best-of-n scorer; everything else keeps its default."""
    args = parse_args(
        ["--model", "m", "--n", "3", "--samples", "5", "--stop-share", "0.6", "--simulations", "2",
         "--temperature", "0.7", "--prm", "p", "--max-new-tokens", "9", "--seed", "4"]
    )  # fmt: skip
    settings = settings_from(args)
    defaults = Strategies()
    assert (settings.max_new_tokens, settings.seed, settings.prm) == (9, 4, "p")
    assert (settings.best_of_n.n, settings.best_of_n.temperature) == (3, 0.7)
    assert [r.model_dump() for r in settings.best_of_n.rewards] == [
        {"name": "prm", "path": "p", "aggregate": "min", "weight": 1.0}
    ]
    assert settings.self_consistency == defaults.self_consistency.model_copy(
        update={"max_samples": 5, "stop_share": 0.6, "temperature": 0.7}
    )
    assert settings.mcts == defaults.mcts.model_copy(update={"simulations": 2, "temperature": 0.7})
    assert (settings.speculative, settings.ensemble) == (defaults.speculative, defaults.ensemble)


def test_params_yaml_infer_defaults_are_the_strategies_defaults():
    """params.yaml `infer`: max_new_tokens, seed and the best_of_n, self_consistency and
    mcts blocks, read as settings, equal Strategies() defaults."""
    infer = yaml.safe_load((REPO / "params.yaml").read_text())["infer"]
    defaults = Strategies()
    assert (infer["max_new_tokens"], infer["seed"]) == (defaults.max_new_tokens, defaults.seed)
    for name, kind in (("best_of_n", BestOfN), ("self_consistency", SelfConsistency), ("mcts", MCTS)):
        assert kind.model_validate(infer[name]).model_dump() == getattr(defaults, name).model_dump(), name


@pytest.mark.slow
def test_generate_command_prints_one_record_per_prompt(micro_dir, models, tokenizer, capsys):
    """The saved micro model (seed 0) answers greedily: the prompt gets its trailing newline
    from the task, the completion is models[0]'s greedy text for it, with 1 sample."""
    generate_main(["--model", str(micro_dir), "--max-new-tokens", "8", "12+7-3", "29-9"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = generate(models[0], tokenizer, ["12+7-3\n", "29-9\n"], 8)
    assert [r["prompt"] for r in records] == ["12+7-3", "29-9"]
    assert [r["completion"] for r in records] == expected
    task = get_task()
    assert all(r["samples"] == 1 and r["answer"] == task.extract_answer(r["completion"]) for r in records)


def test_what_a_strategy_reads_besides_the_candidate_is_checked_before_any_strategy(
    tmp_path, tokenizer, monkeypatch, capsys
):
    """The target verifies the draft's token ids, the ensemble adds its members' logits id
    by id, MCTS's PRM splits steps as the task does: a draft or member whose tokenizer
    differs (one token more), a PRM with another separator, a candidate or draft folder that
    is not there, each fails in stage infer naming its key, before any strategy runs (a
    failure after greedy and MCTS lost their results)."""
    import json

    import pandas as pd

    from rlhf.models.folders import ModelNotFoundError, UnusableModelError
    from rlhf.models.loading import save_model
    from rlhf.tasks import get_task
    from stages.infer import Config, run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/prepared/eval").mkdir(parents=True)
    pd.DataFrame({"prompt": [PROBLEM], "answer": ["16"]}).to_parquet(tmp_path / "data/prepared/eval/test.parquet")
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, tmp_path / "models/sft")
    save_model(build_tiny_model("micro", tokenizer, seed=1), tokenizer, tmp_path / "models/merged")
    extended = build_tokenizer()
    extended.add_tokens(["<tool>"])
    save_model(build_tiny_model("micro", extended, seed=0), extended, tmp_path / "models/other")
    prm = tmp_path / "models/prm"
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, prm)
    (prm / "prm.json").write_text(json.dumps({"kind": "likelihood", "step_separator": "\n\n", "weights": [0, 0]}))
    task = get_task()

    def fails(error, match, **settings):
        with pytest.raises(error, match=match):
            run(Config(**{"strategies": ["greedy"], **settings}), task, "test")
        assert "infer greedy:" not in capsys.readouterr().out, "no strategy ran before the failure"

    bad = "its tokenizer is not the candidate's"
    fails(UnusableModelError, rf"^infer.speculative.draft .*other: {bad}", strategies=["greedy", "speculative"],
          speculative={"draft": str(tmp_path / "models/other")})  # fmt: skip
    fails(ModelNotFoundError, r"^infer.speculative.draft directory .*missing does not exist",
          strategies=["speculative"], speculative={"draft": str(tmp_path / "missing")})  # fmt: skip
    fails(UnusableModelError, rf"^infer.ensemble.members\[1\] models/other: {bad}",
          strategies=["greedy", "ensemble"], ensemble={"members": ["sft", "other"]})  # fmt: skip
    fails(UnusableModelError, r"^infer.prm models/prm: the PRM splits steps on '\\n\\n' but the task on '; '",
          strategies=["greedy", "mcts"])  # fmt: skip
    fails(ModelNotFoundError, r"^infer.candidate policy/grpo directory models/policy/grpo does not exist",
          candidate="policy/grpo")  # fmt: skip
    report, _ = run(Config(strategies=["greedy", "ensemble"], ensemble={"members": ["sft", "merged"]}), task, "test")
    assert set(report["strategies"]) == {"greedy", "ensemble"}
    assert "infer greedy:" in capsys.readouterr().out  # what a strategy that ran prints


def test_a_prompt_that_leaves_no_room_to_generate_fails_with_what_to_change(tokenizer):
    from rlhf.models.generation import PromptTooLongError

    model = build_tiny_model("micro", tokenizer, seed=0, max_length=32)
    assert len(generate(model, tokenizer, ["1+2\n"], max_new_tokens=8)) == 1
    long = "1+2+3+4+5+6+7+8+9+10+11+12\n"  # 27 characters: 27 tokens of the built-in tokenizer
    with pytest.raises(PromptTooLongError, match=r"a prompt of 27 tokens plus max_new_tokens 8 exceeds the model's 32"):
        generate(model, tokenizer, ["1+2\n", long], max_new_tokens=8)
    # The logit ensemble checks every member's positions too (one with room, one without).
    roomy = build_tiny_model("micro", tokenizer, seed=0, max_length=64)
    with pytest.raises(PromptTooLongError, match=r"a prompt of 27 tokens plus max_new_tokens 8 exceeds the model's 32"):
        ensemble_logits([roomy, model], tokenizer, ["1+2\n", long], 8, batch_size=1)


def test_the_generate_command_takes_the_projects_task(tmp_path):
    """In a project, rlhf-generate reads answers as params.yaml's task does (here a regex
    task with its pattern); --task of another kind replaces it; a kind that needs settings
    it was not given says how to give them."""
    from rlhf.inference.generate import command_task

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"task": {"kind": "regex", "pattern": r"Final: (\S+)"}}))
    task = command_task(None, str(params))
    assert task.name == "regex" and task.extract_answer("work\nFinal: 42") == "42"
    assert command_task("gsm8k", str(params)).name == "gsm8k"
    assert command_task(None, str(tmp_path / "none.yaml")).name == "builtin"
    with pytest.raises(SystemExit, match=r"^--task regex: pattern: required by task kind 'regex'.*--params FILE"):
        command_task("regex", str(tmp_path / "none.yaml"))


# ----------------------------------------------------------------------------- a user's model and folders


@pytest.mark.slow
def test_speculative_text_is_greedys_with_a_sentencepiece_tokenizer():
    """With a Metaspace tokenizer (Llama 2, Mistral) the first generated token carries the
    word-boundary space: decoding the new tokens alone dropped it (' 8.' read '8.'), so
    speculative's text was not greedy's. Trained briefly so that the space is generated."""
    from tests.test_prm import sentencepiece_like_tokenizer

    tokenizer = sentencepiece_like_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model = build_tiny_model("micro", tokenizer, seed=0)
    fit_texts(model, tokenizer, [f"{a} plus {b} is {a + b}.</s>" for a in range(10) for b in range(5)], 80, lr=1e-2)
    prompts = ["3 plus 4 is", "2 plus 1 is"]
    plain = greedy(model, tokenizer, prompts, 8)
    assert all(a.completion.startswith(" ") for a in plain), "the test needs a first token with its space"
    assisted = speculative(model, build_tiny_model("micro", tokenizer, seed=1).eval(), tokenizer, prompts, 8)
    assert [(a.completion, a.tokens) for a in assisted] == [(a.completion, a.tokens) for a in plain]


@pytest.mark.slow
def test_greedy_and_sampling_ignore_a_repetition_penalty_in_the_models_generation_config(tokenizer):
    """Chat models often ship generation_config.json with a repetition penalty: greedy
    would not be greedy (the logit ensemble of the model alone, pure argmax, would differ)
    and samples would not come from the model's distribution. The project clears it."""
    from rlhf.models.generation import sample

    model = build_tiny_model("micro", tokenizer, seed=0).eval()
    plain = generate(model, tokenizer, PROMPTS, 20)
    drawn = sample(model, tokenizer, PROMPTS, 2, 20, 1.0, 8, seed=5)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 2
    batch = tokenizer(PROMPTS[:1], return_tensors="pt", add_special_tokens=False)
    raw = model.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    raw_text = tokenizer.decode(raw[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert raw_text != plain[0], "the penalty should change transformers' own greedy output"
    assert generate(model, tokenizer, PROMPTS, 20) == plain
    assert [a.completion for a in ensemble_logits([model], tokenizer, PROMPTS, 20)] == plain
    assert sample(model, tokenizer, PROMPTS, 2, 20, 1.0, 8, seed=5) == drawn


def test_generate_command_members_do_not_swallow_the_prompt():
    """The README's ensemble example: members comma-separated (or the flag repeated), the
    prompt after them stays a prompt."""
    args = parse_args(["--model", "m", "--strategy", "ensemble", "--members", "a,b", "12+7-3"])
    assert (args.members, args.prompts) == (["a", "b"], ["12+7-3"])
    args = parse_args(["--model", "m", "--members", "a", "--members", "b", "12+7-3"])
    assert (args.members, args.prompts) == (["a", "b"], ["12+7-3"])


def test_generate_command_names_the_flag_of_a_bad_value_or_folder_before_loading(tmp_path, micro_dir):
    """A value out of range names its flag (not `best_of_n.n` after the model loaded); a
    folder that is not there, or a member of another tokenizer, names its flag, as one
    line (SystemExit), not a traceback."""
    from rlhf.models.loading import save_model

    def fails(match, *argv):
        with pytest.raises(SystemExit, match=match):
            generate_main(["--model", str(micro_dir), *argv, "12+7-3"])

    fails(r"^--n: Input should be greater than or equal to 1", "--strategy", "best_of_n", "--prm", "p", "--n", "0")
    fails(r"^--samples: Input should be greater than or equal to 1", "--samples", "0")
    fails(r"^--temperature: Input should be greater than 0", "--temperature", "0")
    fails(r"^--max-new-tokens: Input should be greater than 0", "--max-new-tokens", "0")
    with pytest.raises(SystemExit, match=r"^--model directory .*absent does not exist"):
        generate_main(["--model", str(tmp_path / "absent"), "12+7-3"])
    absent = str(tmp_path / "absent")
    fails(r"^--prm .*absent does not exist", "--strategy", "mcts", "--prm", absent)
    fails(r"^--draft directory .*absent does not exist", "--strategy", "speculative", "--draft", absent)
    other = build_tokenizer()
    other.add_tokens(["<tool>"])
    save_model(build_tiny_model("micro", other, seed=0), other, tmp_path / "other")
    fails(r"^--members \(member 1\) .*other: its tokenizer is not the candidate's",
          "--strategy", "ensemble", "--members", f"{micro_dir},{tmp_path / 'other'}")  # fmt: skip


@pytest.mark.slow
def test_generate_command_chat_sends_the_prompt_through_the_chat_template(tmp_path, tokenizer, capsys):
    """--chat: a model trained on conversations reads the prompt as a user message through
    its chat template, as stage infer gives it a chat suite's prompt; without --chat, plain
    text after the task's normalising."""
    from rlhf.models.loading import save_model

    chat = build_tokenizer()
    chat.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    model = build_tiny_model("micro", chat, seed=0).eval()
    save_model(model, chat, tmp_path / "chat")
    generate_main(["--model", str(tmp_path / "chat"), "--max-new-tokens", "8", "--chat", "12+7-3"])
    generate_main(["--model", str(tmp_path / "chat"), "--max-new-tokens", "8", "12+7-3"])
    as_chat, as_text = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert as_chat["prompt"] == as_text["prompt"] == "12+7-3"
    assert as_chat["completion"] == generate(model, chat, [[{"role": "user", "content": "12+7-3"}]], 8)[0]
    assert as_text["completion"] == generate(model, chat, ["12+7-3\n"], 8)[0]


def test_the_batch_size_setting_reaches_each_batched_strategy(models, tokenizer, task):
    """`infer.batch_size` (`rlhf generate --batch-size`) is how many sequences go through the
    model at once: 5 prompts at batch size 2 are 3 calls of the model's generate, and the
    greedy answers are those of one batch."""
    model = models[0]
    prompts = [f"{a}+{b}\n" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 2))]
    calls = []
    original = model.generate

    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0] if "input_ids" in kwargs else args[0].shape[0])
        return original(*args, **kwargs)

    model.generate = counted
    try:
        settings = settings_from(parse_args(["--model", "m", "--batch-size", "2", "--max-new-tokens", "4"]))
        assert settings.batch_size == 2
        small = strategies.load_strategy("greedy", settings, task)(model, tokenizer, prompts)
        assert calls == [2, 2, 1]
        calls.clear()
        whole = strategies.load_strategy("greedy", Strategies(max_new_tokens=4), task)(model, tokenizer, prompts)
        assert calls == [5]
    finally:
        model.generate = original
    assert [a.completion for a in small] == [a.completion for a in whole]
