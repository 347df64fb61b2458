"""A self-improvement round (stage improve@<name>, stages/improve.py): its settings (the
`improve.defaults` block, and each round's own keys over them), its problems, the checks
that keep a sample, and the training rows (kept samples for fine-tuning, preference pairs
for RPO, SFT rows for replay), in the training format of the prompts (text or chat). The
stage names the files (the prompts table, the eval suites, the SFT table)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf.evaluation.gate import CapabilityTest, DifficultyLabels
from rlhf.params import StageConfig
from rlhf.training.methods.dpo import Params as DPOParams
from rlhf.training.methods.sft import SFTParams as TrainingConfig
from rlhf.training.params import EwcParams


def round_training() -> TrainingConfig:
    return TrainingConfig(max_steps=200, learning_rate=1e-3, max_length=128, save_steps=50)


def round_rpo() -> DPOParams:
    """Pang et al.'s loss (DPO at beta 0.1, NLL weight 1) at the rounds' budget and lengths."""
    return DPOParams(sft_weight=1.0, max_steps=200, learning_rate=1e-4, max_length=128, save_steps=50)


class Settings(StageConfig):
    """One round's settings: `improve.defaults`, with the round's own keys replacing them."""

    prompts: int = Field(512, gt=0, description="problems per round")
    operands: tuple[int, int] | None = Field(
        None, description="built-in task: [fewest, most] numbers of the round's problems; null: prompts.parquet"
    )
    samples: int = Field(8, gt=0, description="completions sampled per problem")
    temperature: float = Field(0.7, gt=0, description="sampling temperature")
    max_new_tokens: int = Field(96, gt=0, description="new tokens per sample (one cut here is never kept)")
    batch_size: int = Field(256, gt=0, description="sequences per generation batch")
    checks: list[Literal["answer", "steps", "vote", "prm"]] = Field(
        ["answer"], min_length=1, description="what a kept sample passes: answer | steps | vote | prm (all listed)"
    )
    min_vote_share: float = Field(0.5, gt=0, le=1, description="vote: the majority's least share of the samples")
    prm_threshold: float = Field(0.5, gt=0, lt=1, description="prm: least P(good) of every step")
    prefer: list[Literal["steps"]] = Field(
        [],
        description="among a problem's kept samples, those that pass these checks too are trained on first "
        "(steps: every step right and in the problem's order); unlike `checks`, none is left out",
    )
    refine: bool = Field(False, description="repair rejected samples from their first bad step (PRM-guided)")
    refine_attempts: int = Field(4, gt=0, description="continuations sampled per repair")
    keep_per_prompt: int = Field(1, gt=0, description="most distinct kept samples per problem")
    method: Literal["sft", "rpo"] = Field(
        "sft",
        description="how the candidate trains: sft (on kept samples) | rpo (DPO + NLL on kept-over-rejected pairs)",
    )
    replay: float = Field(0.5, ge=0, lt=1, description="sft: share of the training rows drawn from earlier data")
    train: TrainingConfig = Field(default_factory=round_training, description="sft: the fine-tuning (sft's keys)")
    ewc: EwcParams = Field(default_factory=EwcParams, description="sft: EWC towards the start, Fisher on earlier data")
    rpo: DPOParams = Field(default_factory=round_rpo, description="rpo: policy.dpo's keys; reference: the start")
    suites: list[str] | None = Field(None, min_length=1, description="eval suites of the round; null: every one")
    progress_suite: str | None = Field(None, description="the gain the default tests ask for; null: dev_long or dev")
    progress_difficulty: DifficultyLabels = Field(
        None,
        description="the gain is asked on the progress suite's problems of this difficulty (or these: a list) only, "
        "by its `difficulty` column: a round of the curriculum, its own length and longer; null: every problem",
    )
    retention_suite: str | None = Field(None, description="what must not be lost; null: the decision suite (dev)")
    retention_margin: float = Field(0.02, ge=0, lt=1, description="most accuracy the retention suite may lose vs SFT")
    tests: list[CapabilityTest] | None = Field(None, description="the round's gate; null: progress and retention")
    confidence: float = Field(0.95, gt=0, lt=1, description="level of the paired bootstrap intervals")
    bootstrap_samples: int = Field(2000, ge=100, description="resamples per paired test")
    seed: int = Field(0, description="problem and sampling seed (each round adds a number from its name)")
    trust_remote_code: bool = Field(
        False, description="allow custom modelling code: sampling, the PRM, training and evaluation in the round"
    )

    @model_validator(mode="after")
    def _check(self):
        if self.operands and not 2 <= self.operands[0] <= self.operands[1] <= 12:
            raise ValueError(f"operands {list(self.operands)}: want [fewest, most] with 2 <= fewest <= most <= 12")
        if self.method == "rpo" and self.ewc.strength:
            raise ValueError("ewc applies to method sft; with method rpo set rpo.ewc (Fisher on the SFT data)")
        return self


def operands_problem(task) -> str | None:
    """Why a round's `operands` cannot apply to `task` (None when it can: the built-in task)."""
    if task.name == "builtin":
        return None
    return (
        f"generates built-in problems, but task.kind is {task.name!r}, whose problems come from "
        "data/prepared/prompts.parquet: set it to null"
    )


# ----------------------------------------------------------------------------- problems


def eval_prompts(suite_files: list[Path]) -> set[str]:
    """The `prompt_key` of every prompt of the eval suites in `suite_files`."""
    import pandas as pd

    from rlhf.data.contracts import prompt_key

    tables = (pd.read_parquet(path, columns=["prompt"]) for path in suite_files)
    return {prompt_key(p) for table in tables for p in table["prompt"]}


def round_problems(
    settings: Settings,
    task,
    params: dict,
    seed: int,
    exclude: set[str],
    key: str = "improve",
    prompts_file: Path | None = None,
):
    """(prompts, answers) of a round: generated by the built-in task when `operands` is set,
    else drawn from `prompts_file` (answers None where the table has none): distinct
    prompts, none whose `prompt_key` is in `exclude` (the eval suites'), and with the answer
    check only answered ones. Conversational prompts come back as lists of messages."""
    import random

    import pandas as pd

    from rlhf.data.contracts import plain_messages, prompt_key
    from rlhf.data.prepared import prepared_columns

    if settings.operands is not None:
        if operands_problem(task):
            raise ValueError(f"{key}.operands: {operands_problem(task)}")
        from rlhf.tasks.arithmetic import TaskSpec, sample_problem

        low, high = settings.operands
        spec = TaskSpec(min_operands=low, max_operands=high, max_value=params["prepare"].builtin.max_value)
        rng, problems, seen = random.Random(seed), [], set(exclude)
        for _ in range(100 * settings.prompts):
            problem = sample_problem(rng, spec)
            if problem.prompt not in seen:
                seen.add(problem.prompt)
                problems.append(problem)
            if len(problems) == settings.prompts:
                break
        return [p.prompt for p in problems], [str(p.answer) for p in problems]
    if prompts_file is None:
        raise ValueError(f"{key}: a round without operands draws its problems from a prompts table: name it")
    columns = [c for c in prepared_columns(prompts_file) if c in ("prompt", "answer")]
    table = plain_messages(pd.read_parquet(prompts_file, columns=columns))
    if "answer" not in table:
        table["answer"] = None
    table["answer"] = [a if isinstance(a, str) and a else None for a in table["answer"]]
    text = pd.Series([prompt_key(p) for p in table["prompt"]], index=table.index)
    in_eval = text.isin(exclude)
    usable = ~in_eval & ~text.duplicated()
    unanswered = table["answer"].isna()
    if "answer" in settings.checks:
        usable &= ~unanswered
    table = table[usable]
    if table.empty:
        need = ""
        if "answer" in settings.checks:
            need = f", {int(unanswered.sum())} without an answer (the answer check needs one)"
        raise ValueError(
            f"{key}: no problem to sample: {prompts_file} has {len(text)} prompts, {int(in_eval.sum())} of them in an "
            f"eval suite{need}. Give prepare.files.prompts (prompt, answer) with prompts the eval suites do not hold"
        )
    if len(table) > settings.prompts:
        table = table.sample(n=settings.prompts, random_state=seed)
    return table["prompt"].tolist(), table["answer"].tolist()


# ----------------------------------------------------------------------------- checks


def majority(task, completions: list[str]) -> tuple[str | None, float]:
    """The most stated answer among `completions` and its share of them (None, 0.0 when
    none states one)."""
    from collections import Counter

    stated = Counter(a for a in (task.extract_answer(c) for c in completions) if a is not None)
    if not stated:
        return None, 0.0
    answer, count = stated.most_common(1)[0]
    return answer, count / len(completions)


def judge_samples(
    settings: Settings, task, prompts, answers, samples, prm, votes=None, finished=None
) -> list[list[dict]]:
    """Per problem, per sample: whether each of `settings.checks` passes, and `kept`. The
    vote check compares with the majority of each problem's `samples`, or with `votes` (per
    problem, `majority`'s answer and share) when given: a repair is judged against its
    problem's own samples, not as a group of one. A sample `finished` marks False (cut at
    max_new_tokens before it ended) is never kept: training on it would teach to stop there."""
    scores = None
    if "prm" in settings.checks:
        flat_prompts = [p for p, group in zip(prompts, samples) for _ in group]
        flat = prm.score_completions(flat_prompts, [c for group in samples for c in group], how="min")
        scores, start = [], 0
        for group in samples:
            scores.append(flat[start : start + len(group)])
            start += len(group)
    verdicts = []
    for i, (answer, group) in enumerate(zip(answers, samples)):
        top, share = (votes[i] if votes else majority(task, group)) if "vote" in settings.checks else (None, 0.0)
        rows = []
        for j, completion in enumerate(group):
            checkable = answer is not None and task.checks_answers
            row = {"completion": completion, "correct": task.is_correct(completion, answer) if checkable else None}
            if "answer" in settings.checks:
                row["answer_check"] = bool(row["correct"])
            if "steps" in settings.checks or "steps" in settings.prefer:  # every step good, the last one final
                labels, steps = task.check_steps(prompts[i], completion), task.split_steps(completion)
                row["steps_check"] = bool(labels and steps) and all(labels) and task.is_final_step(steps[-1])
            if "vote" in settings.checks:
                row["vote_check"] = share >= settings.min_vote_share and task.extract_answer(completion) == top
            if "prm" in settings.checks:
                row["prm_score"] = scores[i][j]
                row["prm_check"] = scores[i][j] >= settings.prm_threshold
            row["finished"] = finished[i][j] if finished else True
            row["kept"] = row["finished"] and all(row[f"{check}_check"] for check in settings.checks)
            row["preferred"] = all(row[f"{check}_check"] for check in settings.prefer)
            rows.append(row)
        verdicts.append(rows)
    return verdicts


def kept_rows(prompts, verdicts, keep_per_prompt: int) -> list[dict]:
    """At most `keep_per_prompt` distinct kept completions per problem: those passing the
    round's `prefer` checks first, the model's own samples before repairs, and among those
    the most often sampled first (a check on the answer also passes a chain with a slip that
    happens to land on it; the sound chain is the one the model writes most often), ties in
    sample order."""
    return [
        {"prompt": prompt, "completion": as_completion(prompt, text)}
        for prompt, group in zip(prompts, verdicts)
        for text in ranked_kept(group)[:keep_per_prompt]
    ]


def ranked_kept(group: list[dict]) -> list[str]:
    """One problem's distinct kept completions, as `kept_rows` ranks them."""
    from collections import Counter

    kept = [row for row in group if row["kept"]]
    counts = Counter(row["completion"] for row in kept)  # in order of first sampling
    refined = {row["completion"] for row in kept if row.get("source") == "refined"}
    other = {row["completion"] for row in kept if not row.get("preferred", True)}
    return sorted(counts, key=lambda text: (text in other, text in refined, -counts[text]))  # stable: ties as sampled


def as_completion(prompt, text: str):
    """A sampled `text` as the training row's completion: text for a text prompt, an
    assistant message for a conversational one (TRL's conversational prompt-completion)."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def sft_rows(path: Path):
    """The SFT table as prompt/completion rows (a `messages` conversation: its last turn the
    completion), for replay beside the rounds' rows."""
    import pandas as pd

    table = pd.read_parquet(path)
    if "messages" not in table:
        return table[["prompt", "completion"]]
    from rlhf.data.contracts import plain_messages

    conversations = plain_messages(table)["messages"].tolist()
    return pd.DataFrame(
        {
            "prompt": pd.Series([c[:-1] for c in conversations], dtype=object),
            "completion": pd.Series([c[-1:] for c in conversations], dtype=object),
        }
    )


def preference_pairs(prompts, verdicts, pairs_per_prompt: int) -> list[dict]:
    """Iterative RPO's pairs: per problem, its kept samples (ranked as `kept_rows` ranks them)
    each chosen over a distinct rejected one of the model's own samples, the most often
    sampled first (the mistake the model makes most), at most `pairs_per_prompt` pairs."""
    from collections import Counter

    pairs = []
    for prompt, group in zip(prompts, verdicts):
        chosen = ranked_kept(group)[:pairs_per_prompt]
        wrong = Counter(row["completion"] for row in group if not row["kept"] and row.get("source") != "refined")
        rejected = [text for text, _ in wrong.most_common()]  # ties in sampling order
        pairs += [
            {"prompt": prompt, "chosen": as_completion(prompt, c), "rejected": as_completion(prompt, r)}
            for c, r in zip(chosen, rejected)
        ]
    return pairs
