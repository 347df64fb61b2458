"""A self-improvement round (stage improve@<name>, stages/improve.py): its settings (the
`improve.defaults` block, and each round's own keys over them), its problems, the checks
that keep a sample, and the training rows (kept samples for fine-tuning, preference pairs
for RPO, SFT rows for replay), in the training format of the prompts (text or chat). The
stage names the files (the prompts table, the eval suites, the SFT table)."""

from __future__ import annotations

from collections.abc import Callable
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


def round_seed(seed: int, name: str) -> int:
    """A round's seed: `seed` plus a number from the round's name, so that rounds draw
    different problems and samples, and a round's draw does not depend on the others."""
    import zlib

    return seed + zlib.crc32(name.encode()) % 100_000


def merged(base: dict, own: dict) -> dict:
    out = dict(base)
    for key, value in own.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def nothing_kept_reason(data: dict, settings: Settings) -> str:
    """Why a round stops with no kept sample, with the likely cause when every sample was
    cut at max_new_tokens (never kept): too few tokens, or a model that does not end its
    reply with the EOS token generation stops at."""
    reason = "no sample passed the checks: nothing to train on"
    if data["samples"] and data["unfinished_samples"] == data["samples"]:
        reason += (
            f" (every one of the {data['samples']} samples was cut at max_new_tokens {settings.max_new_tokens} before "
            "it ended: raise max_new_tokens, or check that the model ends its reply with its tokenizer's EOS token, "
            "e.g. a chat model's end-of-turn token)"
        )
    return reason


def training_table(settings: Settings, prompts, verdicts, kept, earlier, sft_data: Path, seed: int):
    """(the candidate's training table, its replayed rows): for rpo, pairs of this round's
    samples and no replay (the reference anchors); for sft, the `kept` rows plus a `replay`
    share drawn from the SFT table and the `earlier` rounds' kept rows."""
    import pandas as pd

    if settings.method == "rpo":
        pairs = preference_pairs(prompts, verdicts, settings.keep_per_prompt)
        return pd.DataFrame(pairs, columns=["prompt", "chosen", "rejected"]), 0
    pool = pd.concat([sft_rows(sft_data), earlier], ignore_index=True)
    replay_rows = min(len(pool), round(len(kept) * settings.replay / (1 - settings.replay)))
    return pd.concat([kept, pool.sample(n=replay_rows, random_state=seed)], ignore_index=True), replay_rows


def data_report(settings: Settings, prompts, verdicts, train, kept, replay_rows: int, repair) -> dict:
    """What the round drew, kept and trains on (its report's `data`): the model's own
    samples (repairs are counted under `repair`)."""
    flat = [row for group in verdicts for row in group if row.get("source") != "refined"]
    report = {
        "problems": len(prompts),
        "samples": len(flat),
        "kept_samples": sum(row["kept"] for row in flat),
        # cut at max_new_tokens before they ended: never kept
        "unfinished_samples": sum(not row["finished"] for row in flat),
        "kept_share": mean_of([row["kept"] for row in flat]),
        "problems_with_a_kept_sample": mean_of([any(r["kept"] for r in g) for g in verdicts]),
        "sample_accuracy": mean_of([row["correct"] for row in flat if row["correct"] is not None]),
        "kept_accuracy": mean_of([row["correct"] for row in flat if row["kept"] and row["correct"] is not None]),
    }
    if settings.prefer:
        report["kept_preferred_samples"] = sum(row["kept"] and row["preferred"] for row in flat)
        report["problems_with_a_preferred_sample"] = mean_of(
            [any(r["kept"] and r["preferred"] for r in g) for g in verdicts]
        )
    return report | {"training_rows": len(train), "new_rows": len(kept), "replay_rows": replay_rows, "repair": repair}


def train_candidate(
    settings: Settings,
    key_of: Callable[[str], str],
    start: Path,
    table: Path,
    out_dir: Path,
    stage: str,
    previous_data: Path,
    *,
    trust_remote_code: bool,
    checkpoints: Path,
    sft_data: Path,
    ref_cache: Path,
    model=None,
) -> tuple[dict, list[dict]]:
    """The round's candidate, `start` trained on `table` by `settings.method` into `out_dir`
    (checkpoints under `checkpoints`/<stage>): sft on kept rows (EWC, when on, with the Fisher
    information of `previous_data`), or rpo on pairs with `start` as the reference (the NLL
    term's rows from `sft_data`, the reference log-probs cached under `ref_cache`; custom
    modelling code as `trust_remote_code` says). `key_of(field)`: the params key that sets
    the round's `field` (train, rpo), for messages. `model`: params `model` (the global
    section), which the trained block's own `model:` keys go over, once, into the job."""
    import rlhf.training.methods.dpo as dpo
    import rlhf.training.methods.sft as sft
    from rlhf.training.trl_training import TrainingJob

    rpo = settings.method == "rpo"
    consolidating = not rpo and settings.ewc.strength > 0
    job = TrainingJob(
        stage=stage,
        key=key_of("rpo" if rpo else "train"),
        start=start,
        data=table,
        checkpoints=checkpoints,
        trust_remote_code=trust_remote_code if rpo else settings.trust_remote_code or settings.train.trust_remote_code,
        sft_data=sft_data if rpo else previous_data if consolidating else None,
        ref_cache=ref_cache if rpo else None,
        ewc=settings.ewc if consolidating else None,
        model=model.merged((settings.rpo if rpo else settings.train).model) if model is not None else None,
    )
    if rpo:
        return dpo.train(job, settings.rpo, out_dir)
    train = settings.train.model_copy(update={"trust_remote_code": job.trust_remote_code})
    return sft.train(job, train, out_dir)


def repair_rejected(settings: Settings, task, model, tokenizer, prm, prompts, answers, verdicts, seed) -> dict | None:
    """With `refine`: each rejected sample repaired from its first bad step; a repair that
    passes the checks is kept (source `refined`). Returns the repair report."""
    if not settings.refine:
        return None
    from rlhf.inference.refine import refine, repair_report

    rejected = [(i, j) for i, group in enumerate(verdicts) for j, row in enumerate(group) if not row["kept"]]
    if not rejected:
        return {"flagged": 0, "repaired": 0}
    results = refine(
        model, tokenizer, prm, task,
        [prompts[i] for i, _ in rejected], [verdicts[i][j]["completion"] for i, j in rejected],
        threshold=settings.prm_threshold, attempts=settings.refine_attempts,
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
        batch_size=settings.batch_size, seed=seed, answers=[answers[i] for i, _ in rejected],
    )  # fmt: skip
    repaired = [(i, r.refined) for (i, _), r in zip(rejected, results) if r.status == "repaired"]
    if repaired:
        own = [[row["completion"] for row in verdicts[i] if row.get("source") != "refined"] for i, _ in repaired]
        rechecked = judge_samples(
            settings, task, [prompts[i] for i, _ in repaired], [answers[i] for i, _ in repaired],
            [[text] for _, text in repaired], prm, votes=[majority(task, group) for group in own],
        )  # fmt: skip
        for (i, _), [row] in zip(repaired, rechecked):
            verdicts[i].append({**row, "source": "refined"})
    report = repair_report(results, [answers[i] for i, _ in rejected], task)
    report["kept_after_repair"] = sum(row.get("source") == "refined" and row["kept"] for g in verdicts for row in g)
    return report


def mean_of(values) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None
