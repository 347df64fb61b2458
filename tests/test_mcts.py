"""Step-level MCTS (rlhf.inference.strategies.mcts, mcts_batch) on the micro models of
test_inference: `mixed` samples right and wrong steps of 12+7-3, and a stand-in step scorer
(the task's exact checker, or its inverse) guides the search."""

from __future__ import annotations

from collections import Counter

import pytest

from rlhf.inference import strategies
from rlhf.inference.settings import MCTS
from rlhf.inference.strategies import Node, mcts, puct
from rlhf.models.generation import generate
from rlhf.tasks.arithmetic import check_steps
from tests import test_inference as shared
from tests.test_inference import BUDGET, GOOD, PROBLEM, exact_step_scorer, inverted_step_scorer

# test_inference's fixtures (pytest finds a fixture by the module attribute that holds it).
tokenizer, task, mixed = shared.tokenizer, shared.task, shared.mixed


def test_puct_adds_the_prior_weighted_exploration_bonus():
    """Parent visits 4 (sqrt 2). Child a: Q 0.5/1, P 0.5, N 1 -> 0.5 + c*0.5*2/2 = 0.5 + 0.5c;
    child b: unvisited, P 0.5 -> 0 + c*0.5*2/1 = c. c 1: a 1.0, b 1.0; c 2: a 1.5, b 2.0;
    c 0: a 0.5, b 0.0 (Q alone)."""
    parent = Node(steps=(), visits=4)
    a = Node(steps=("x",), prior=0.5, visits=1, total=0.5)
    b = Node(steps=("y",), prior=0.5)
    assert puct(parent, a, 1.0) == pytest.approx(1.0) and puct(parent, b, 1.0) == pytest.approx(1.0)
    assert puct(parent, a, 2.0) == pytest.approx(1.5) and puct(parent, b, 2.0) == pytest.approx(2.0)
    assert puct(parent, a, 0.0) == pytest.approx(0.5) and puct(parent, b, 0.0) == pytest.approx(0.0)


@pytest.mark.slow
def test_mcts_follows_the_step_scorer_to_a_terminal_answer(mixed, tokenizer, task):
    """The mixed model's greedy answer is wrong and it samples right and wrong steps. Guided
    by the exact step checker, MCTS returns the right solution step by step, ending in a
    terminal answer valued 1.0; guided by the inverted scorer it returns a path whose every
    step the checker rejects (the scorer rates it good), also terminal at 1.0."""
    options = MCTS()
    right = mcts(mixed, tokenizer, PROBLEM, task, exact_step_scorer, options, BUDGET)
    assert right.completion == GOOD
    assert right.extra["terminal"] is True and right.extra["value"] == 1.0
    assert right.samples % options.expand == 0 and right.extra["simulations"] == options.simulations
    assert right.tokens > 0
    wrong = mcts(mixed, tokenizer, PROBLEM, task, inverted_step_scorer, options, BUDGET)
    steps = task.split_steps(wrong.completion)
    assert task.is_final_step(steps[-1]) and not any(check_steps(PROBLEM, wrong.completion))
    assert wrong.extra["terminal"] is True and wrong.extra["value"] == 1.0


@pytest.mark.slow
def test_a_step_cut_off_by_max_step_tokens_is_not_a_step(mixed, tokenizer, task):
    """The first steps are "12+7=19" (or the mixed model's slip) and the separator, 9
    characters and tokens: at 16 tokens every sample reaches the separator, at 4 none does,
    and "12+7" is no step to score or build on."""
    ((whole, _, _),) = strategies.next_steps(mixed, tokenizer, [PROBLEM], task, [()], 4, 0.5, 16, seed=0)
    assert sum(whole.values()) == 4 and all(step.count("=") == 1 for step in whole)
    ((cut, _, tokens),) = strategies.next_steps(mixed, tokenizer, [PROBLEM], task, [()], 4, 0.5, 4, seed=0)
    assert not cut and tokens > 0, "the tokens were generated (and counted) all the same"


@pytest.mark.slow
def test_mcts_without_a_terminal_completes_the_most_visited_path_greedily(mixed, tokenizer, task):
    """max_depth 1: no path gets past its first step, so none reaches an answer. The most
    visited first step is the one the scorer rates good (12+7=19); the completion is that
    step, the separator, and the model's greedy continuation of it."""
    answer = mcts(mixed, tokenizer, PROBLEM, task, exact_step_scorer, MCTS(max_depth=1), BUDGET)
    rest = generate(mixed, tokenizer, [PROBLEM + "12+7=19; "], BUDGET)[0]
    assert answer.extra["terminal"] is False
    assert answer.completion == "12+7=19; " + rest


@pytest.mark.slow
def test_mcts_ends_a_path_where_the_model_ended_on_a_task_that_marks_no_final_step(mixed, tokenizer):
    """Task last_number marks no step as the final one: a path ends where the model's
    sample ended (its stop token, not the separator). MCTS returns the model's whole
    solution, a terminal path, not one padded with steps the model never meant to write;
    the whole solution's last step is scored as finished, the others as partial paths."""
    from rlhf.tasks import TaskConfig, get_task

    task = get_task(TaskConfig(kind="last_number", step_separator="; "))
    seen = []

    def exact(prompts, steps_lists, finished=None):
        seen.extend(zip([tuple(s) for s in steps_lists], finished))
        return exact_step_scorer(prompts, steps_lists)

    answer = mcts(mixed, tokenizer, PROBLEM, task, exact, MCTS(), BUDGET)
    assert answer.completion == GOOD and answer.extra["terminal"] is True
    assert dict(seen)[tuple(GOOD.split("; "))] is True and dict(seen)[tuple(GOOD.split("; ")[:2])] is False


@pytest.mark.slow
def test_a_node_no_sample_continues_is_a_dead_end_never_an_answer(mixed, tokenizer, task):
    """max_step_tokens 9: the first two steps fit with their separator ("12+7=19; ", 9
    tokens), the last does not ("answer 16" and its EOS, 10): the node after two steps has
    nothing to continue with. It is a dead end, not a finished path whose two steps would
    be the answer (as it was, valued 0.0): MCTS completes the most visited path greedily."""
    answer = mcts(mixed, tokenizer, PROBLEM, task, exact_step_scorer, MCTS(max_step_tokens=9), BUDGET)
    assert answer.extra["terminal"] is False and answer.completion != "12+7=19; 19-3=16"
    assert task.is_final_step(task.split_steps(answer.completion)[-1])


@pytest.mark.slow
def test_mcts_widens_a_node_whose_children_all_score_low(mixed, tokenizer, task, monkeypatch):
    """A scorer that rejects every step, 5 simulations, at most 3 expansions per node. With
    widen_below 0.5: simulation 0 expands the root (seed 0 + 0); after it every child
    scores 0.0 < 0.5 with 1 < 3 expansions, so simulations 1 and 2 expand it again (seeds
    1, 2); simulations 3 and 4 descend (3 < 3 is false) -> 3 root expansions, seeds
    [0, 1, 2], as extra["root_expansions"] reports. With widen_below 0.0 (0.0 < 0.0 is
    false) the root is expanded once, [0]. With the exact checker and widen_below 0.5, the
    first expansion already holds a good first step (1.0 >= 0.5) -> once, [0]. Every
    expansion's whole samples count towards the answer's tokens (the text after a step's
    separator is generated too), so the tokens are at least their sum."""
    expansions, generated = [], []
    real_next_steps = strategies.next_steps

    def recording(model, tokenizer, prompts, task, paths, k, temperature, max_step_tokens, seed):
        expansions.extend((steps, seed) for steps in paths)
        found = real_next_steps(model, tokenizer, prompts, task, paths, k, temperature, max_step_tokens, seed)
        generated.extend(tokens for _, _, tokens in found)
        return found

    monkeypatch.setattr(strategies, "next_steps", recording)

    def reject(prompts, steps_lists, finished=None):
        return [[0.0] * len(steps) for steps in steps_lists]

    def root_seeds(scorer, widen_below):
        expansions.clear()
        generated.clear()
        options = MCTS(simulations=5, expand=4, max_depth=2, widen_below=widen_below, max_expansions=3)
        answer = mcts(mixed, tokenizer, PROBLEM, task, scorer, options, BUDGET)
        seeds = [seed for steps, seed in expansions if steps == ()]
        assert answer.extra["root_expansions"] == len(seeds)
        assert answer.tokens >= sum(generated) >= 4 * len(expansions), "every sample has at least its end token"
        return seeds

    assert root_seeds(reject, 0.5) == [0, 1, 2]
    assert root_seeds(reject, 0.0) == [0]
    assert root_seeds(exact_step_scorer, 0.5) == [0]


@pytest.mark.slow
def test_mcts_searches_problems_in_lockstep_each_tree_on_its_own_problem(mixed, tokenizer, task, monkeypatch):
    """Three trees advanced together (the mixed model on the problem it learned, twice, and
    on 29-9, whose steps it does not know): each simulation samples every tree's expansion
    in one generation batch (a tree whose selection ends on a leaf it values needs none)
    and scores the new steps of all trees in one scorer call. The
    trees stay apart: both searches of the learned problem find the right solution (the
    exact checker guides them, as one search does alone), and the third tree's steps are
    checked against 29-9, which the learned solution fails, not against 12+7-3."""
    other = "29-9\n"
    batches, scored = [], []
    real_next_steps = strategies.next_steps

    def recording(model, tokenizer, prompts, *args, **kwargs):
        batches.append(list(prompts))
        return real_next_steps(model, tokenizer, prompts, *args, **kwargs)

    def exact(prompts, steps_lists, finished=None):
        scored.append(list(prompts))
        return exact_step_scorer(prompts, steps_lists)

    monkeypatch.setattr(strategies, "next_steps", recording)
    options = MCTS()
    answers = strategies.mcts_batch(mixed, tokenizer, [PROBLEM, PROBLEM, other], task, exact, options, BUDGET)
    assert len(batches) <= options.simulations and batches[0] == [PROBLEM, PROBLEM, other]
    assert len(scored) <= options.simulations and {other, PROBLEM} <= set(scored[0])
    for answer in answers[:2]:
        assert answer.completion == GOOD and answer.extra["terminal"] is True and answer.extra["value"] == 1.0
        assert answer.samples % options.expand == 0 and answer.tokens > 0
    assert answers[2].completion != GOOD and not all(check_steps(other, answers[2].completion))


def test_mcts_expands_a_node_at_most_max_expansions_times(task, monkeypatch):
    """A node whose every child turns out a dead end is widened again, up to
    `max_expansions` expansions in all (it had one more)."""
    from rlhf.models.generation import Generated

    calls = Counter()

    def next_steps(model, tokenizer, prompts, task, paths, k, temperature, max_step_tokens, seed):
        (steps,) = paths
        calls[steps] += 1
        if steps == ():  # a new first step at each expansion of the root, which nothing continues
            return [(Counter({f"1+{calls[steps]}={1 + calls[steps]}": k}), set(), 5)]
        return [(Counter(), set(), 5)]

    monkeypatch.setattr(strategies, "next_steps", next_steps)
    monkeypatch.setattr(strategies, "prefix_text", lambda *args: "")
    monkeypatch.setattr(strategies, "generate", lambda *args, **kwargs: Generated(["x"], [True], [1]))
    scorer = lambda prompts, steps, finished=None: [[0.9] * len(s) for s in steps]  # noqa: E731
    for most in (1, 2, 3):
        calls.clear()
        mcts(None, None, PROBLEM, task, scorer, MCTS(simulations=20, max_expansions=most), 8)
        assert calls[()] == most
