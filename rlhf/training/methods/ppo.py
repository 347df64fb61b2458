"""PPO (Schulman et al. 2017; Ouyang et al. 2022) with a value model and GAE: ours
(rlhf/training/ppo.py), as TRL 1.16 has no PPO trainer. Each iteration samples a rollout
batch from the policy, scores it with the weighted rewards of params (as GRPO's) minus a
per-token KL penalty to the frozen reference (the SFT model), estimates advantages with
GAE from the value model, and takes clipped policy and value steps over mini-batches.
The value model starts from SFT or from the first RM member (`value_init`).

Data: prompts (prompt, answer), data/prepared/prompts.parquet.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf.params import reject_unused
from rlhf.rewards.functions import RewardSpec
from rlhf.training.online import REWARDS_FIELD
from rlhf.training.params import KEYED_SAMPLING, EwcParams, LoraParams, Scheduler, TrainingParams

NAME = "ppo"
KIND = "online"
DATA = "prompts"
LOGGED = ("score", "kl", "kl_coef", "value_loss", "clipfrac", "approx_kl", "entropy", "response_length")


class Params(TrainingParams):
    """PPO with a KL penalty to the reference (Ouyang et al. 2022). `max_steps` counts PPO
    iterations and `max_length` bounds prompt + response (the stage leaves out a prompt longer
    than max_length - max_new_tokens, and counts it).
    Inherited keys not used: per_device_train_batch_size and gradient_accumulation_steps
    (rollout_batch_size and mini_batch_size set the batches), and `trl` (no TRL config)."""

    TRL_CONFIG: ClassVar[str | None] = None  # our own loop

    max_steps: int = Field(60, gt=0, description="PPO iterations (one rollout batch and its updates each)")
    learning_rate: float = Field(1e-5, gt=0, lt=1, description="policy learning rate")
    lr_scheduler_type: Scheduler = Field("constant", description="transformers scheduler name, over all updates")
    rollout_batch_size: int = Field(64, gt=0, description="prompts sampled per PPO iteration")
    mini_batch_size: int = Field(16, gt=0, description="responses per optimizer step")
    ppo_epochs: int = Field(2, gt=0, description="passes over each rollout batch")
    max_new_tokens: int = Field(64, gt=0, description="longest sampled response")
    temperature: float = Field(0.7, gt=0, description="sampling temperature (log-probs use the same)")
    keyed_sampling: bool = Field(False, description=KEYED_SAMPLING)
    kl_coef: float = Field(0.05, ge=0, description="beta: KL penalty per token (initial value if adaptive)")
    adaptive_kl: bool = Field(False, description="adapt beta towards target_kl (Ziegler et al. 2019)")
    target_kl: float = Field(6.0, gt=0, description="adaptive: target KL per response, in nats")
    kl_horizon: int = Field(10000, gt=0, description="adaptive: responses over which beta adapts")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (1 = Monte Carlo returns)")
    cliprange: float = Field(0.2, gt=0, lt=1, description="policy ratio clip epsilon")
    cliprange_value: float = Field(0.2, gt=0, description="value clip around the rollout's values")
    value_learning_rate: float | None = Field(None, gt=0, lt=1, description="value model lr; null = learning_rate")
    whiten_advantages: bool = Field(True, description="normalise advantages to mean 0, variance 1 per batch")
    value_init: Literal["sft", "rm"] = Field(
        "sft", description="value model init (the caller loads it): SFT model or reward model"
    )
    lora: LoraParams = Field(
        default_factory=LoraParams,
        description="optional LoRA on the policy and on the value model (its head trained in full), merged at the end",
    )
    rewards: list[RewardSpec] = REWARDS_FIELD
    ewc: EwcParams = Field(
        default_factory=EwcParams, description="elastic weight consolidation towards SFT, Fisher on the SFT data"
    )

    @model_validator(mode="after")
    def _check_batches(self):
        reject_unused(
            self,
            ("per_device_train_batch_size", "gradient_accumulation_steps"),
            "by PPO (rollout_batch_size and mini_batch_size set its batches)",
        )
        problems = []
        if self.rollout_batch_size % self.mini_batch_size:
            problems.append(
                f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of mini_batch_size "
                f"({self.mini_batch_size})"
            )
        if self.max_new_tokens >= self.max_length:
            problems.append(
                f"max_new_tokens ({self.max_new_tokens}) must be less than max_length ({self.max_length}), "
                "which bounds prompt + response"
            )
        if self.ewc.strength and self.lora.enabled:
            problems.append("ewc.strength with lora.enabled: PPO's EWC pulls the full weights; turn one of them off")
        if self.model is not None and self.model.quantization:
            problems.append(
                "model.quantization: PPO (ours) trains its value model in full, which quantized weights cannot; "
                "set model.quantization: false here"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def train(job, params: Params, out_dir: Path) -> tuple[dict, list[dict]]:
    """The reference is a frozen copy of the SFT model (loaded for inference: the compute
    dtype), or under LoRA the policy with its adapters disabled; the policy and the value
    model load for training."""
    import mlflow

    from rlhf.data.contracts import plain_messages
    from rlhf.data.prepared import prepared_dataset
    from rlhf.models.compute import is_main, world_size
    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
    from rlhf.rewards.ensemble import member_dirs
    from rlhf.rewards.functions import build_rewards, model_paths, weighted_sum
    from rlhf.tracking.runs import log_metrics, numeric_metrics
    from rlhf.training.ppo import latest_checkpoint, load_value_model, train_ppo
    from rlhf.training.trainer_setup import checkpoint_dir, fingerprint
    from rlhf.training.trl_training import consolidate_on_sft, fitting_rows, sft_ewc_examples

    trust, start, key = job.trust_remote_code, job.start, job.key
    tokenizer = load_tokenizer(start, trust)
    # A prompt must leave max_new_tokens of max_length: the rollouts would cut its start.
    prompts, counts = fitting_rows(prepared_dataset(job.data, job.stage), tokenizer, params.max_length,
                                   f"{key}.max_length", job.data, room=params.max_new_tokens)  # fmt: skip
    table = plain_messages(prompts.to_pandas())  # the rollouts' prompts: our loop reads a frame
    ewc_data = sft_ewc_examples(tokenizer, params, f"{key}.max_length", job.sft_data)
    what = start.as_posix()
    policy = load_causal_lm(start, trust, what=what, training=True, adapters=params.lora.enabled)
    # Under LoRA the policy with its adapters disabled is the reference: no second copy.
    reference = None if params.lora.enabled else load_causal_lm(start, trust, what=what)
    value_init = start if params.value_init == "sft" else member_dirs(job.reward_dirs["reward_model"])[0]
    # Under LoRA from SFT: a value adapter and head on the policy's own weights (no second copy).
    shared = params.lora.enabled and params.value_init == "sft"
    value_model = None if shared else load_value_model(value_init, trust, adapters=params.lora.enabled)
    functions, weights = build_rewards(params.rewards, job.task, job.reward_dirs, trust)
    ewc = consolidate_on_sft(policy, ewc_data, params)
    inputs = [start, job.data, value_init, *model_paths(params.rewards, job.reward_dirs)]
    context = {"task": job.task.identity(), "trust": trust}
    run_key = fingerprint(params, inputs + ([job.sft_data] if params.ewc.strength else []), context)

    def log(metrics: dict, step: int) -> None:
        if mlflow.active_run() is not None:
            log_metrics(numeric_metrics(metrics), step=step)

    checkpoints = checkpoint_dir(job.checkpoints, job.stage, run_key)
    resumed = latest_checkpoint(checkpoints) is not None  # train_ppo resumes from it
    history = train_ppo(
        policy,
        reference,
        value_model,
        tokenizer,
        table["prompt"].tolist(),
        {column: table[column].tolist() for column in table.columns if column != "prompt"},
        weighted_sum(functions, weights),
        params,
        checkpoints,
        log_fn=log,
    )
    if is_main():  # every process holds the whole policy (data-parallel): rank 0 writes it
        save_model(policy, tokenizer, out_dir)
    first, last = history[0], history[-1]
    window = history[-max(1, len(history) // 10) :]
    metrics = {
        "train_loss": last["policy_loss"],
        "value_loss": last["value_loss"],
        "score_first": first["score"],
        "score_last_10pct": sum(row["score"] for row in window) / len(window),
        "kl": last["kl"],
        "steps": len(history),
        "processes": world_size(),
        "resumed": resumed,
        **counts,
    }
    if ewc is not None:
        metrics["ewc_penalty"] = ewc.penalty()
    curve = [{"step": row["step"], "loss": row["policy_loss"], **{k: row[k] for k in LOGGED}} for row in history]
    return metrics, curve
