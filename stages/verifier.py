"""Stage `verifier`: the language model the likelihood PRM reads, trained further than the policy.

In:  models/sft, data/prepared/sft.parquet.
Out: models/verifier (a causal LM), metrics/verifier.json, plots/verifier/loss.csv.

A verifier only helps inference-time search and reranking when it catches the policy's own
mistakes, and a PRM that reads the policy's own log-probs (stage prm, `kind: likelihood`,
`init: sft`) cannot: the mistakes a model makes are the ones it is confident in. This stage
continues supervised fine-tuning of the SFT model on the same demonstrations (the sft
stage's trainer, its own params section) to give the PRM a stronger reader, as verifiers
in the literature are trained apart from the policy. The policy stages never read it. Its
loss falls where SFT's did (`sft.loss_on`) unless `verifier.loss_on` says otherwise: a user
who set `sft.loss_on: all` for a chat template TRL cannot mask need not set it twice.

    python -m stages.verifier
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from stages import MODELS_DIR, SFT_DIR
from stages.sft import Config as SFTConfig
from stages.sft import main as train_with_section

INIT_DIR = SFT_DIR
OUT_DIR = MODELS_DIR / "verifier"
METRICS = Path("metrics/verifier.json")
PLOT = Path("plots/verifier/loss.csv")


class Config(SFTConfig):
    max_steps: int = Field(400, gt=0, description="optimizer steps beyond the SFT model's")
    learning_rate: float = Field(1e-3, gt=0, lt=1, description="peak learning rate")
    loss_on: str | None = Field(
        None, pattern="^(completion|all)$", description="completion only, or every token; null: as sft.loss_on"
    )


def main() -> None:
    train_with_section("verifier", INIT_DIR, OUT_DIR, METRICS, PLOT)


if __name__ == "__main__":
    main()
