"""What the online policy methods (GRPO, RLOO, and PPO's rewards) share: sampling settings,
the weighted rewards they are trained on, and (GRPO, RLOO) their road through TRL
(`train_online`: TRL samples, the rewards score, rlhf.training.trl_training trains).

Apart from rlhf/training/params.py because the rewards' params come from
rlhf.rewards.functions, whose model-based rewards reach the training code (the PRM's
trainer) that imports those blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator

from rlhf.rewards.functions import DEFAULT_REWARDS, RewardSpec
from rlhf.training.params import KEYED_SAMPLING, EwcParams, LoraParams, TrainingParams

REWARDS_FIELD = Field(
    default_factory=lambda: list(DEFAULT_REWARDS),
    validate_default=True,
    min_length=1,
    description="weighted rewards (rlhf.rewards.functions)",
)


class OnlineParams(TrainingParams):
    """What the online methods (GRPO, RLOO) share: sampling, the rewards, the KL strength, LoRA."""

    TRL_DEFAULTS: ClassVar[dict[str, Any]] = {
        **TrainingParams.TRL_DEFAULTS,
        # Rollouts from the model's own distribution, as the pipeline samples everywhere.
        "top_p": 1.0,
        "top_k": 0,
        "disable_dropout": True,
        "log_completions": False,
    }
    TRL_NAMES: ClassVar[dict[str, str]] = {**TrainingParams.TRL_NAMES, "reward_weights": "rewards"}

    max_steps: int | None = Field(100, gt=0, description="optimizer steps (null: trl.num_train_epochs)")
    per_device_train_batch_size: int = Field(64, gt=0, description="completions per step (prompts x num_generations)")
    learning_rate: float = Field(3e-5, gt=0, lt=1, description="peak learning rate")
    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(64, gt=0, description="new tokens per completion")
    max_length: int = Field(
        128, gt=0, description="EWC only: tokens per SFT row for its Fisher information (TRL feeds prompts whole)"
    )
    temperature: float = Field(0.7, gt=0, description="sampling temperature (below 1: rollouts closer to greedy)")
    keyed_sampling: bool = Field(False, description=KEYED_SAMPLING)
    beta: float = Field(0.0, ge=0, description="KL coefficient to the SFT reference (0 = no reference model)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="PPO-style clipping of the importance ratio")
    num_iterations: int = Field(1, gt=0, description="optimisation passes per generated batch (mu)")
    rewards: list[RewardSpec] = REWARDS_FIELD
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    ewc: EwcParams = Field(
        default_factory=EwcParams, description="elastic weight consolidation towards SFT, Fisher on the SFT data"
    )

    @model_validator(mode="after")
    def _groups_fit(self):
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if batch % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size x gradient_accumulation_steps ({batch}) must be a multiple of "
                f"num_generations ({self.num_generations}): each step holds whole groups"
            )
        return self

    def trl_args(self) -> dict[str, Any]:
        """The shared keys; `reward_weights` are the rewards' weights (the functions are
        built by the stage, rlhf.rewards.functions.build_rewards)."""
        return {
            **super().trl_args(),
            "num_generations": self.num_generations,
            "max_completion_length": self.max_completion_length,
            "temperature": self.temperature,
            "beta": self.beta,
            "epsilon": self.epsilon,
            "num_iterations": self.num_iterations,
            "reward_weights": [reward.weight for reward in self.rewards],
        }


def train_online(job, params, trl_classes: tuple, trl_args: dict, out_dir: Path):
    """GRPO and RLOO: TRL samples `num_generations` completions per prompt of the prompts
    table and scores them with the configured rewards (the task reads answers); the prompt
    table's other columns (e.g. `answer`) reach the reward functions."""
    from rlhf.rewards.functions import build_rewards, model_paths
    from rlhf.training.trl_training import train_trl

    functions, weights = build_rewards(params.rewards, job.task, job.reward_dirs, job.trust_remote_code)
    logged = ("loss", "reward", "reward_std", "kl", "completions/mean_length")

    def keyed(trainer) -> None:
        from rlhf.models.compute import rank
        from rlhf.models.generation import keyed_generate

        # TRL hands each process a contiguous slice of the step's rows, in rank order.
        keyed_generate(
            trainer.model, params.seed, lambda: trainer.state.global_step, lambda rows: rank() * rows,
            params.temperature,
        )  # fmt: skip

    return train_trl(
        job,
        params,
        trl_classes,
        {**trl_args, "reward_weights": weights},
        out_dir,
        logged=logged + tuple(f"rewards/{f.__name__}/mean" for f in functions),
        inputs=tuple(model_paths(params.rewards, job.reward_dirs)),
        on_trainer=keyed if params.keyed_sampling else None,
        fit_rows=False,
        context={"task": job.task.identity()},
        reward_funcs=functions,
    )
