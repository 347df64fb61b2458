"""Stage `rl@<method>`: online policy optimisation of the SFT model (`policy.online`: grpo,
rloo, ppo), one DVC stage per method.

In:  models/sft, data/prepared/prompts.parquet, and the reward models the method's rewards
     (and PPO's value_init) name: models/rm, models/prm.
Out: models/policy/<method>, metrics/policy/<method>.json, plots/policy/<method>/.

The job is stage policy's (stages/policy.py: the method's module in rlhf/training/methods
trains; the outputs and the tracking are the same). What differs is what the method reads,
and so the stage's DVC dependencies: prompts and rewards, never preference pairs.

    python -m stages.rl grpo           # any method listed in policy.online
"""

from __future__ import annotations

from stages.policy import main as policy_main


def main(argv: list[str] | None = None) -> None:
    policy_main(argv, family="online")


if __name__ == "__main__":
    main()
