"""Settings of the inference-time strategies: the one place their defaults live.

params.yaml `infer` (stage infer's Config extends `Strategies`) and the `generate`
command both start from these defaults. Plain pydantic, no torch: params validate in a
second.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf.params import StageConfig
from rlhf.rewards.functions import RewardSpec

STRATEGIES = ("greedy", "best_of_n", "self_consistency", "mcts", "speculative", "ensemble")


class BestOfN(StageConfig):
    n: int = Field(8, ge=1, description="samples per problem")
    temperature: float = Field(
        0.5, gt=0, description="sampling temperature (at 1.0 the tiny model's samples are too noisy)"
    )
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [{"name": "prm", "aggregate": "min"}],
        validate_default=True,
        min_length=1,
        description="scorer: weighted rewards that need no reference answer (rlhf.rewards.functions)",
    )


class SelfConsistency(StageConfig):
    max_samples: int = Field(16, ge=1, description="largest vote per problem (the full vote's size)")
    round_size: int = Field(4, ge=1, description="samples drawn per round before checking the vote")
    stop_share: float = Field(0.75, gt=0, le=1, description="stop once the leader holds this share of the votes")
    temperature: float = Field(0.5, gt=0, description="sampling temperature")


class MCTS(StageConfig):
    simulations: int = Field(16, ge=1, description="selection-expansion-backup rounds per problem")
    expand: int = Field(4, ge=1, description="next steps sampled per expansion")
    c_puct: float = Field(1.0, ge=0, description="exploration weight of PUCT")
    temperature: float = Field(0.5, gt=0, description="sampling temperature of expansions")
    max_depth: int = Field(8, ge=1, description="most steps in a path")
    widen_below: float = Field(0.5, ge=0, le=1, description="re-expand a node whose children all score below this")
    max_expansions: int = Field(2, ge=1, description="expansions per node (progressive widening)")
    max_step_tokens: int = Field(
        64, ge=1, description="most tokens of one step; a sample that reaches it without the separator is cut off"
    )
    problems_per_batch: int = Field(
        1, ge=1, description="problems searched in lockstep, their expansions sampled in one generation batch of "
        "problems_per_batch x expand rows and scored in one PRM call: raise it on a GPU (8-32); the draws, hence the "
        "answers, depend on which problems share a batch"
    )  # fmt: skip


class Speculative(StageConfig):
    draft: str | None = Field(None, description="draft model directory (smaller, same tokenizer)")
    num_assistant_tokens: int = Field(5, ge=1, description="tokens the draft proposes per verification")


class Ensemble(StageConfig):
    members: list[str] = Field(default_factory=list, description="model directories of the members")
    mode: Literal["logits", "vote"] = Field("logits", description="average log-probs, or vote on answers")


class Strategies(StageConfig):
    """Every strategy's settings (params.yaml `infer`, or the `generate` command's flags)."""

    max_new_tokens: int = Field(64, gt=0, description="generation budget per completion")
    batch_size: int = Field(
        64, gt=0, description="sequences generated at once (greedy, best_of_n, self_consistency, ensemble): lower it "
        "for a large model"
    )  # fmt: skip
    seed: int = Field(0, description="sampling seed")
    best_of_n: BestOfN = Field(default_factory=BestOfN, description="best-of-n settings")
    self_consistency: SelfConsistency = Field(default_factory=SelfConsistency, description="self-consistency")
    mcts: MCTS = Field(default_factory=MCTS, description="tree-search settings")
    speculative: Speculative = Field(default_factory=Speculative, description="speculative decoding settings")
    ensemble: Ensemble = Field(default_factory=Ensemble, description="ensemble settings")
    prm: str | None = Field(
        None,
        description="process reward model directory: mcts's, and best_of_n's prm reward's where it names no path; "
        "null = the caller's default (the stage's: models/prm)",
    )
    trust_remote_code: bool = Field(False, description="allow custom modelling code")
