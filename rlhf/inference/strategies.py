"""Inference-time compute: spending more generation on a prompt to get a better answer.

Strategies, each a function from prompts to `Answer`s (the chosen completion, the tokens
generated for it and how many completions were sampled):

* `greedy` — the baseline every other strategy is measured against.
* `best_of_n` — sample N, return the one a scorer (RM ensemble, PRM, any reward of
  rlhf.rewards.functions that needs no reference answer) rates highest.
* `self_consistency` — majority vote over sampled answers (Wang et al. 2023), sampled in
  rounds with a per-prompt early stop: a prompt stops once its leading answer cannot be
  overtaken by the samples left, or holds `stop_share` of the votes. Prompts the model is
  sure of stop after one round; unsure ones get up to `max_samples` (adaptive compute).
* `mcts` — step-level tree search (PUCT selection, expansion by sampling next steps from
  the policy, evaluation of each new step by the PRM, backup), returning the best path.
* `speculative` — a small draft model proposes tokens that the target verifies, through
  transformers' assisted generation; greedy output is the target's own greedy output.
* `ensemble_logits` / `ensemble_vote` — several candidates with one tokenizer decoding
  together by averaging their next-token log-probs, or voting on their greedy answers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rlhf.inference.settings import MCTS, STRATEGIES, BestOfN, SelfConsistency, Strategies
from rlhf.models.generation import (
    PLAIN_DECODING,
    check_fits,
    decode_continuations,
    ends,
    format_prompt,
    generate,
    sample,
    stop_token_ids,
)
from rlhf.models.loading import load_causal_lm
from rlhf.rewards.functions import ModelDirs, build_rewards, weighted_sum
from rlhf.rewards.prm import load_prm
from rlhf.tasks.base import Task

Scorer = Callable[[Sequence, Sequence[str]], Sequence[float]]  # (prompts, completions) -> scores


@dataclass
class Answer:
    completion: str
    tokens: int  # tokens generated for this prompt, over every sample it took
    samples: int = 1
    extra: dict = field(default_factory=dict)


def compressed_runner(compressor, contexts: Sequence[str], max_new_tokens: int, batch_size: int = 64):
    """Greedy answers, each prompt read after its context's slots (rlhf.models.compressor):
    a runner(model, tokenizer, prompts) whose model is the one `compressor` serves."""

    def run(model, tokenizer, prompts: Sequence) -> list[Answer]:
        texts = compressor.generate(tokenizer, list(contexts), list(prompts), max_new_tokens, batch_size)
        return [Answer(t, len(tokenizer(t, add_special_tokens=False)["input_ids"])) for t in texts]

    return run


def greedy(model, tokenizer, prompts: Sequence, max_new_tokens: int, batch_size: int = 64) -> list[Answer]:
    drawn = generate(model, tokenizer, prompts, max_new_tokens, batch_size, details=True)
    return [Answer(c, t) for c, t in zip(drawn.texts, drawn.tokens)]


def best_of_n(
    model,
    tokenizer,
    prompts: Sequence,
    scorer: Scorer,
    options: BestOfN,
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 64,
) -> list[Answer]:
    """`options.n` samples per prompt at `options.temperature`; the one `scorer` rates highest."""
    n, temperature = options.n, options.temperature
    drawn = sample(model, tokenizer, prompts, n, max_new_tokens, temperature, batch_size, seed, details=True)
    flat_prompts = [p for p in prompts for _ in range(n)]
    scores = list(scorer(flat_prompts, [c for group in drawn.texts for c in group]))
    answers = []
    for i, (group, taken) in enumerate(zip(drawn.texts, drawn.tokens)):
        group_scores = scores[i * n : (i + 1) * n]
        best = max(range(n), key=lambda j: group_scores[j])
        answers.append(Answer(group[best], sum(taken), n, {"score": group_scores[best]}))
    return answers


def vote_is_decided(counts: Counter, remaining: int, stop_share: float, taken: int) -> bool:
    """Stop when the leader cannot be overtaken by `remaining` more votes, or already holds
    `stop_share` of the `taken` votes."""
    if not counts:
        return remaining == 0
    ranked = counts.most_common(2)
    leader = ranked[0][1]
    runner_up = ranked[1][1] if len(ranked) > 1 else 0
    return leader > runner_up + remaining or leader / taken >= stop_share


def self_consistency(
    model,
    tokenizer,
    prompts: Sequence,
    task: Task,
    options: SelfConsistency,
    max_new_tokens: int,
    early_stop: bool = True,
    seed: int = 0,
    batch_size: int = 64,
) -> list[Answer]:
    """Majority vote over up to `max_samples` sampled answers per prompt (the task's
    extracted answers), `round_size` at a time. With `early_stop`, a prompt stops sampling
    once its vote is decided (`vote_is_decided`); without it, every prompt takes
    `max_samples`. The returned completion is the first sample carrying the winning answer.
    A sample cut by `max_new_tokens` does not vote (its last number is not an answer it
    gave); `unfinished` counts them."""
    max_samples, round_size, stop_share = options.max_samples, options.round_size, options.stop_share
    temperature = options.temperature
    votes = [Counter() for _ in prompts]
    kept: list[dict[str, str]] = [{} for _ in prompts]
    tokens = [0] * len(prompts)
    taken = [0] * len(prompts)
    unfinished = [0] * len(prompts)
    active = list(range(len(prompts)))
    round_index = 0
    while active:
        n = min(round_size, max_samples - taken[active[0]])
        drawn = sample(
            model, tokenizer, [prompts[i] for i in active], n, max_new_tokens, temperature, batch_size,
            seed + round_index, details=True,
        )  # fmt: skip
        for i, group, ended, used in zip(active, drawn.texts, drawn.finished, drawn.tokens):
            taken[i] += n
            tokens[i] += sum(used)
            unfinished[i] += n - sum(ended)
            for completion, done in zip(group, ended):
                if not done:  # cut by max_new_tokens: its last number is not its answer
                    continue
                key = task.extract_answer(completion)
                if key is not None:
                    votes[i][key] += 1
                    kept[i].setdefault(key, completion)
        active = [
            i
            for i in active
            if taken[i] < max_samples
            and not (early_stop and vote_is_decided(votes[i], max_samples - taken[i], stop_share, taken[i]))
        ]
        round_index += 1
    answers = []
    for i in range(len(prompts)):
        if votes[i]:
            key, count = votes[i].most_common(1)[0]
            extra = {"votes": count, "answer": key, "unfinished": unfinished[i]}
            answers.append(Answer(kept[i][key], tokens[i], taken[i], extra))
        else:
            answers.append(Answer("", tokens[i], taken[i], {"votes": 0, "unfinished": unfinished[i]}))
    return answers


# ----------------------------------------------------------------------------- MCTS


@dataclass
class Node:
    steps: tuple[str, ...]
    prior: float = 1.0
    value: float = 0.0  # the PRM's P(good) of this node's last step
    visits: int = 0
    total: float = 0.0
    terminal: bool = False
    exhausted: bool = False  # expanded, but no sample gave a next step: never descended into
    expansions: int = 0
    children: list[Node] = field(default_factory=list)

    @property
    def q(self) -> float:
        return self.total / self.visits if self.visits else 0.0


def puct(parent: Node, child: Node, c_puct: float) -> float:
    """AlphaZero's PUCT: Q(s,a) + c * P(s,a) * sqrt(N(s)) / (1 + N(s,a))."""
    return child.q + c_puct * child.prior * math.sqrt(parent.visits) / (1 + child.visits)


def prefix_text(tokenizer, prompt, steps: Sequence[str], separator: str) -> str:
    """The text a model continues a partial solution from: the prompt as the model sees it
    (`format_prompt`), then each step exactly as written (a leading space stays) followed by
    the separator. MCTS expands from it; PRM-guided refinement regenerates from it."""
    return format_prompt(tokenizer, prompt) + "".join(s + separator for s in steps)


def join_continuation(steps: Sequence[str], rest: str, separator: str) -> str:
    """The completion a continuation `rest` of `prefix_text(..., steps, ...)` makes: the
    steps, each followed by the separator, then `rest` as generated."""
    return "".join(s + separator for s in steps) + rest


def next_steps(
    model,
    tokenizer,
    prompts: Sequence,
    task: Task,
    paths: Sequence[tuple[str, ...]],
    k: int,
    temperature: float,
    max_step_tokens: int,
    seed,
) -> list[tuple[Counter, set[str], int]]:
    """Sample `k` continuations of each partial solution (`paths[i]`, the steps written so
    far for `prompts[i]`), all in one batch of len(prompts) x k rows, each stopped at the
    task's step separator. Per partial solution: the distinct next steps with how often
    each was sampled, the steps that end the solution (their samples ended on a stop
    token, not on the separator), and the tokens generated. A sample that used all
    `max_step_tokens` without reaching the separator or a stop token holds a step cut off
    mid-way, not a step; an empty one holds none: both are dropped."""
    separator = task.step_separator
    prefixes = [prefix_text(tokenizer, prompt, steps, separator) for prompt, steps in zip(prompts, paths)]
    drawn = generate(
        model, tokenizer, prefixes, max_step_tokens, len(prefixes), True, temperature, k, seed=seed,
        stop_strings=[separator], formatted=True, details=True,
    )  # fmt: skip
    found = []
    for i in range(len(prefixes)):
        rows = slice(i * k, (i + 1) * k)
        counted: Counter = Counter()
        ended: Counter = Counter()
        for text, finished in zip(drawn.texts[rows], drawn.finished[rows]):
            if separator not in text and not finished:
                continue
            # Exactly as written (a leading space stays), so that the next prefix is the text
            # the model produced; only what follows the step's end is dropped.
            step = text.split(separator)[0].rstrip()
            if step.strip():
                counted[step] += 1
                ended[step] += separator not in text
        final = {step for step in counted if task.is_final_step(step) or 2 * ended[step] >= counted[step] > 0}
        found.append((counted, final, sum(drawn.tokens[rows])))
    return found


@dataclass
class Search:
    """One problem's tree search, advanced a simulation at a time (`mcts_batch`)."""

    prompt: object
    root: Node = field(default_factory=lambda: Node(steps=(), visits=1))
    tokens: int = 0
    drawn: int = 0
    path: list[Node] = field(default_factory=list)  # this simulation's selected path

    def select(self, options: MCTS) -> Node:
        """Descend by PUCT from the root to the node this simulation expands or values
        (kept in `path`). A node whose children all score below `widen_below` is where the
        descent stops while it may still widen."""
        self.path, node = [self.root], self.root
        while not node.terminal:
            open_children = [c for c in node.children if not c.exhausted]
            if not open_children:
                break
            if max(c.value for c in open_children) < options.widen_below and node.expansions < options.max_expansions:
                break
            node = max(open_children, key=lambda child, parent=node: puct(parent, child, options.c_puct))
            self.path.append(node)
        return node

    def backup(self, value: float) -> None:
        for visited in self.path:
            visited.visits += 1
            visited.total += value


def expandable(node: Node, options: MCTS) -> bool:
    return not node.terminal and len(node.steps) < options.max_depth and node.expansions < options.max_expansions


def mcts(
    model,
    tokenizer,
    prompt,
    task: Task,
    step_scorer,
    options: MCTS,
    max_new_tokens: int,
    seed: int = 0,
) -> Answer:
    """Step-level MCTS for one prompt (`mcts_batch` of that prompt alone)."""
    return mcts_batch(model, tokenizer, [prompt], task, step_scorer, options, max_new_tokens, seed)[0]


def mcts_batch(
    model,
    tokenizer,
    prompts: Sequence,
    task: Task,
    step_scorer,
    options: MCTS,
    max_new_tokens: int,
    seed: int = 0,
) -> list[Answer]:
    """Step-level MCTS over the task's steps (a step the task calls final ends a path), one
    tree per prompt, the trees advanced in lockstep: each simulation selects a node in every
    tree, samples the next steps of all of them in one generation batch (seeded `seed +
    simulation`) and scores every new step in one `step_scorer` call. One prompt alone makes
    the calls a search of that prompt alone always made.

    `step_scorer(prompts, steps_lists, finished=...)` returns P(good) per step (a PRM's
    `score_steps`, rlhf.rewards.prm); a node's value is the score of its last step, which
    under Math-Shepherd labels estimates P(the chain so far leads to the right answer). The
    answer is the highest-valued terminal path (ties: most visited); without one, the most
    visited path, completed greedily (those completions, too, in one batch).

    Progressive widening: a node whose children all score below `widen_below` is expanded
    again (new samples, new seed), up to `max_expansions` times, instead of descending into
    a child the scorer already rejects: the policy's confident mistakes repeat in every
    sample of one expansion."""
    separator = task.step_separator
    searches = [Search(prompt) for prompt in prompts]
    for simulation in range(options.simulations):
        values: dict[int, float] = {}
        growing: list[tuple[int, Node]] = []  # (which search, the node it expands)
        for i, search in enumerate(searches):
            node = search.select(options)
            if expandable(node, options):
                growing.append((i, node))
            elif not node.terminal and node.children and all(c.exhausted for c in node.children):
                node.exhausted, values[i] = True, 0.0  # every way on is a dead end, and it may not widen again
            else:
                values[i] = node.value
        if growing:
            drawn = next_steps(
                model, tokenizer, [searches[i].prompt for i, _ in growing], task, [n.steps for _, n in growing],
                options.expand, options.temperature, options.max_step_tokens, seed + simulation,
            )  # fmt: skip
            new: list[tuple[object, Node, tuple[str, ...], float, bool]] = []  # (prompt, parent, steps, prior, ends)
            for (i, node), (counted, final, generated) in zip(growing, drawn):
                search = searches[i]
                node.expansions += 1
                search.tokens += generated
                search.drawn += options.expand
                known = {child.steps[-1] for child in node.children}
                for step in counted:
                    if step not in known:
                        prior = counted[step] / options.expand
                        new.append((search.prompt, node, node.steps + (step,), prior, step in final))
            if new:
                # A path that goes on is scored as one (its last step followed by the
                # separator), one that ends as a whole solution.
                scores = step_scorer(
                    [prompt for prompt, *_ in new], [list(steps) for _, _, steps, *_ in new],
                    finished=[end for *_, end in new],
                )  # fmt: skip
                for (_, node, steps, prior, end), step_scores in zip(new, scores):
                    child = Node(steps=steps, prior=prior, value=float(step_scores[-1]), terminal=end)
                    child.visits, child.total = 1, child.value
                    node.children.append(child)
            for i, node in growing:
                open_children = [c for c in node.children if not c.exhausted]
                if open_children:
                    values[i] = max(child.value for child in open_children)
                else:  # nothing to continue with: a dead end, never an answer
                    node.exhausted, values[i] = True, 0.0
        for i, search in enumerate(searches):
            search.backup(values[i])
    answers: list[Answer | None] = [None] * len(searches)
    unfinished: list[tuple[int, Node]] = []
    for i, search in enumerate(searches):
        best = _best_terminal(search.root)
        if best is None:
            node = search.root
            while node.children:
                node = max(node.children, key=lambda child: child.visits)
            unfinished.append((i, node))
        else:
            extra = {"terminal": True, "value": best.value, "root_expansions": search.root.expansions}
            extra["simulations"] = options.simulations
            answers[i] = Answer(separator.join(best.steps), search.tokens, search.drawn, extra)
    if unfinished:
        prefixes = [prefix_text(tokenizer, searches[i].prompt, node.steps, separator) for i, node in unfinished]
        rest = generate(model, tokenizer, prefixes, max_new_tokens, len(prefixes), formatted=True, details=True)
        for (i, node), text, taken in zip(unfinished, rest.texts, rest.tokens):
            search = searches[i]
            completion = join_continuation(node.steps, text, separator)
            extra = {"terminal": False, "root_expansions": search.root.expansions, "simulations": options.simulations}
            answers[i] = Answer(completion, search.tokens + taken, search.drawn + 1, extra)
    return answers


def _best_terminal(root: Node) -> Node | None:
    best, stack = None, [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if (
            node.terminal
            and node.steps
            and not node.exhausted
            and (best is None or (node.value, node.visits) > (best.value, best.visits))
        ):
            best = node
    return best


# ----------------------------------------------------------------------------- speculative


@torch.inference_mode()
def speculative(
    target, draft, tokenizer, prompts: Sequence, max_new_tokens: int, num_assistant_tokens: int | None = None
) -> list[Answer]:
    """Greedy decoding of `target` with `draft` proposing tokens (transformers' assisted
    generation, one prompt at a time as it requires). The output equals the target's greedy
    output; only the number of target forward passes changes."""
    if num_assistant_tokens is not None:
        draft.generation_config.num_assistant_tokens = num_assistant_tokens
        draft.generation_config.num_assistant_tokens_schedule = "constant"
    target.eval()
    draft.eval()
    answers = []
    for prompt in prompts:
        batch = tokenizer([format_prompt(tokenizer, prompt)], return_tensors="pt", add_special_tokens=False).to(
            target.device
        )
        output = target.generate(
            **batch,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop_token_ids(target, tokenizer),
            **PLAIN_DECODING,
        )
        length = batch["input_ids"].shape[1]
        # Decoded as greedy decodes (a word-boundary space of the first token stays).
        answers.append(Answer(decode_continuations(tokenizer, output, length)[0], output.shape[1] - length))
    return answers


# ----------------------------------------------------------------------------- ensembles


@torch.inference_mode()
def ensemble_logits(
    models: Sequence, tokenizer, prompts: Sequence, max_new_tokens: int, batch_size: int = 64
) -> list[Answer]:
    """Greedy decoding from the mean of the models' next-token log-probs (one tokenizer,
    one vocabulary), `batch_size` prompts at a time. Each model keeps its own KV cache. A
    prompt that leaves no room for `max_new_tokens` in a member's positions fails naming it."""
    for model in models:
        model.eval()
    tokenizer.padding_side = "left"
    texts = [format_prompt(tokenizer, p) for p in prompts]
    answers: list[Answer] = []
    for start in range(0, len(texts), batch_size):
        answers.extend(_ensemble_batch(models, tokenizer, texts[start : start + batch_size], max_new_tokens))
    return answers


def _ensemble_batch(models: Sequence, tokenizer, texts: list[str], max_new_tokens: int) -> list[Answer]:
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    device = models[0].device
    input_ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    longest = int(mask.sum(dim=1).argmax())
    for model in models:
        check_fits(model, int(mask[longest].sum()), max_new_tokens, texts[longest])
    caches = [None] * len(models)
    step_ids = input_ids
    finished = torch.zeros(len(texts), dtype=torch.bool, device=device)
    stops = torch.tensor(stop_token_ids(models[0], tokenizer), device=device)
    generated = []
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        log_probs = 0
        for index, model in enumerate(models):
            out = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=caches[index],
                use_cache=True,
            )
            caches[index] = out.past_key_values
            log_probs = log_probs + out.logits[:, -1].float().log_softmax(-1)
        next_ids = (log_probs / len(models)).argmax(-1)
        # Finished rows keep emitting padding, which the attention mask then hides.
        next_ids = torch.where(finished, torch.full_like(next_ids, tokenizer.pad_token_id), next_ids)
        generated.append(next_ids)
        mask = torch.cat([mask, (~finished).long()[:, None]], 1)
        finished = finished | torch.isin(next_ids, stops)
        if finished.all():
            break
        step_ids = next_ids[:, None]
    tokens = torch.stack(generated, 1)
    completions = decode_continuations(tokenizer, torch.cat([input_ids, tokens], 1), input_ids.shape[1])
    _, taken = ends(tokens, stop_token_ids(models[0], tokenizer), tokenizer.pad_token_id, max_new_tokens)
    return [Answer(c, t) for c, t in zip(completions, taken)]


def ensemble_vote(
    models: Sequence, tokenizer, prompts: Sequence, task: Task, max_new_tokens: int, batch_size: int = 64
) -> list[Answer]:
    """Each model answers greedily; the most common answer (the task's extracted answer)
    wins (ties: the earlier model)."""
    per_model = [greedy(model, tokenizer, prompts, max_new_tokens, batch_size) for model in models]
    answers = []
    for i in range(len(prompts)):
        candidates = [answers_of[i] for answers_of in per_model]
        keys = [task.extract_answer(a.completion) for a in candidates]
        counts = Counter(k for k in keys if k is not None)
        winner = max(counts, key=lambda k: (counts[k], -keys.index(k))) if counts else None
        chosen = candidates[keys.index(winner)] if winner is not None else candidates[0]
        answers.append(
            Answer(
                chosen.completion,
                sum(a.tokens for a in candidates),
                len(models),
                {"votes": counts[winner] if winner else 0},
            )
        )
    return answers


# ----------------------------------------------------------------------------- settings and dispatch


Runner = Callable[..., list[Answer]]  # (model, tokenizer, prompts, early_stop=True) -> answers


def load_strategy(name: str, settings: Strategies, task: Task, model_dirs: ModelDirs | None = None) -> Runner:
    """Strategy `name`, with the models it reads besides the candidate loaded (its scorers,
    the draft, the ensemble members): a function of (model, tokenizer, prompts,
    early_stop=True) that runs it, so that a strategy's time is its decoding, not its
    loading. Ensemble members are model directories; `model_dirs` gives the scorers'
    folders when the settings name none ({"prm": ..., "reward_model": ...}). A PRM must
    split steps on the task's separator (`rlhf.rewards.prm.check_prm`)."""
    budget, seed, trust, batch = settings.max_new_tokens, settings.seed, settings.trust_remote_code, settings.batch_size
    model_dirs = model_dirs or {}
    if name == "greedy":
        return lambda model, tokenizer, prompts, early_stop=True: greedy(model, tokenizer, prompts, budget, batch)
    if name == "best_of_n":
        scorer = weighted_sum(*build_rewards(settings.best_of_n.rewards, task, model_dirs, trust))
        return lambda model, tokenizer, prompts, early_stop=True: best_of_n(
            model, tokenizer, prompts, scorer, settings.best_of_n, budget, seed, batch
        )
    if name == "self_consistency":
        return lambda model, tokenizer, prompts, early_stop=True: self_consistency(
            model, tokenizer, prompts, task, settings.self_consistency, budget, early_stop, seed, batch
        )
    if name == "mcts":
        prm_dir = settings.prm or model_dirs.get("prm")
        if prm_dir is None:
            raise ValueError("strategy mcts needs a process reward model: set `prm` (the pipeline writes models/prm)")
        prm = load_prm(prm_dir, trust, task.step_separator, key="mcts prm")
        group = settings.mcts.problems_per_batch
        return lambda model, tokenizer, prompts, early_stop=True: [
            answer
            for start in range(0, len(prompts), group)
            for answer in mcts_batch(
                model,
                tokenizer,
                prompts[start : start + group],
                task,
                prm.score_steps,
                settings.mcts,
                budget,
                seed + start,
            )
        ]
    if name == "speculative":
        draft = load_causal_lm(settings.speculative.draft, trust, what="speculative draft")
        tokens = settings.speculative.num_assistant_tokens
        return lambda model, tokenizer, prompts, early_stop=True: speculative(
            model, draft, tokenizer, prompts, budget, tokens
        )
    if name == "ensemble":
        members = [load_causal_lm(path, trust, what=f"ensemble member {path}") for path in settings.ensemble.members]
        if settings.ensemble.mode == "logits":
            return lambda model, tokenizer, prompts, early_stop=True: ensemble_logits(
                members, tokenizer, prompts, budget, batch
            )
        return lambda model, tokenizer, prompts, early_stop=True: ensemble_vote(
            members, tokenizer, prompts, task, budget, batch
        )
    raise ValueError(f"unknown strategy {name!r}; expected one of {STRATEGIES}")


def run_strategy(
    name: str,
    settings: Strategies,
    model,
    tokenizer,
    prompts: list,
    task: Task,
    model_dirs: ModelDirs | None = None,
    early_stop: bool = True,
) -> list[Answer]:
    """Run strategy `name` on `prompts` (`load_strategy`, then the run)."""
    return load_strategy(name, settings, task, model_dirs)(model, tokenizer, prompts, early_stop)
