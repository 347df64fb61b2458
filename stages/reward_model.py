"""Stage `rm`: an ensemble of K outcome reward models.

In:  models/sft (or models/base), data/prepared/prefs.parquet, data/prepared/prefs_eval.parquet.
Out: models/rm/member_<i> (sequence classifiers with one output), metrics/rm.json
     (held-out pairwise accuracy per member and for the ensemble mean), plots/rm/loss.csv.

Each member is TRL's `RewardTrainer` (Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected))
from the same initial model with a different seed: the seed changes the new score head and
the data order, which is what makes the members disagree where the data is thin. The
ensemble mean is the reward; the spread is an uncertainty estimate (rlhf.reward_ensemble).

Members are trained one after another to bound memory. A finished member is kept under
checkpoints/rm/<fingerprint>/ until the stage completes, so a killed run resumes at the
member (and the checkpoint) it had reached.

    python -m stages.reward_model
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Literal

import mlflow
import pandas as pd
from datasets import Dataset
from pydantic import Field
from trl import RewardConfig, RewardTrainer

from rlhf.artifacts import atomic_dir, write_csv, write_json
from rlhf.data import read_prepared
from rlhf.modeling import load_tokenizer, resolve_model_dir, save_model
from rlhf.reward_ensemble import MEMBER_PREFIX, RewardEnsemble, pairwise_accuracy
from rlhf.task import classify_flaw
from rlhf.tracking import nested_run, numeric_metrics, stage_run
from rlhf.training import (
    LoraParams,
    TrainingParams,
    checkpoint_dir,
    discard_checkpoints,
    fingerprint,
    last_logged,
    log_history_rows,
    merged_model,
    train_resumable,
    trl_config,
)
from stages import load_config

DATA = Path("data/prepared/prefs.parquet")
EVAL_DATA = Path("data/prepared/prefs_eval.parquet")
OUT_DIR = Path("models/rm")
METRICS = Path("metrics/rm.json")
PLOT = Path("plots/rm/loss.csv")


class Config(TrainingParams):
    init: Literal["sft", "base"] = Field("sft", description="model the members start from")
    num_members: int = Field(3, ge=1, le=16, description="K, reward models in the ensemble")
    max_steps: int = Field(250, gt=0, description="optimizer steps per member")
    per_device_train_batch_size: int = Field(32, gt=0, description="pairs per step")
    learning_rate: float = Field(1e-3, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per prompt+response (longer pairs are dropped)")
    center_rewards_coefficient: float | None = Field(0.01, ge=0, description="pull rewards towards 0 (TRL)")
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")


def init_dir(config: Config) -> Path:
    return Path("models") / config.init


def train_member(config: Config, index: int, init: Path, train: Dataset, tokenizer, root: Path) -> list[dict]:
    """Train member `index` into root/member_<index>/final (skipped when already there)."""
    member_root = root / f"{MEMBER_PREFIX}{index}"
    final = member_root / "final"
    if (final / "config.json").exists():
        print(f"rm: member {index} already trained in {final}, reusing it")
        return []
    seed = config.seed + index
    args = trl_config(
        RewardConfig,
        config.model_copy(update={"seed": seed}),
        member_root,
        max_length=config.max_length,
        center_rewards_coefficient=config.center_rewards_coefficient,
        run_name=f"rm-member-{index}",
    )
    trainer = RewardTrainer(
        model=str(resolve_model_dir(init)),
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=config.lora.peft_config("SEQ_CLS"),
    )
    # Each member logs its curves to a run nested in the stage's run (the members' training
    # arguments differ, and MLflow params of one run cannot change).
    with nested_run(f"rm-member-{index}"):
        train_resumable(trainer, f"rm member {index}", str(member_root))
    save_model(merged_model(trainer.model), tokenizer, final)
    return [{**row, "member": index} for row in log_history_rows(trainer.state.log_history, ("loss", "accuracy"))]


def accuracy_by_flaw(pairs: pd.DataFrame, chosen, rejected) -> dict[str, float]:
    """Ensemble accuracy per kind of flaw in the rejected response, for built-in task pairs
    (empty for user data): which mistakes the reward model can and cannot see."""
    try:
        kinds = [classify_flaw(p, r) for p, r in zip(pairs["prompt"], pairs["rejected"])]
    except ValueError:
        return {}
    result = {}
    for kind in sorted({k for k in kinds if k}):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        result[kind] = pairwise_accuracy(chosen[rows], rejected[rows])
    return result


def run(config: Config, init: Path, data: Path, eval_data: Path, out_dir: Path) -> tuple[dict, list[dict]]:
    stage = "rm"
    tokenizer = load_tokenizer(init, config.trust_remote_code)
    train = Dataset.from_pandas(read_prepared(data, "rm"), preserve_index=False)
    root = checkpoint_dir(stage, fingerprint(config, [init, data]))
    start = time.perf_counter()
    curve: list[dict] = []
    for index in range(config.num_members):
        curve += train_member(config, index, init, train, tokenizer, root)
    for index in range(config.num_members):
        shutil.copytree(root / f"{MEMBER_PREFIX}{index}" / "final", out_dir / f"{MEMBER_PREFIX}{index}")
    train_seconds = time.perf_counter() - start

    held_out = read_prepared(eval_data, "rm")
    ensemble = RewardEnsemble.load(out_dir, config.trust_remote_code)
    chosen = ensemble.score(held_out["prompt"].tolist(), held_out["chosen"].tolist())
    rejected = ensemble.score(held_out["prompt"].tolist(), held_out["rejected"].tolist())
    metrics = {
        "ensemble_accuracy": pairwise_accuracy(chosen.mean, rejected.mean),
        "members": {
            f"{MEMBER_PREFIX}{i}": {
                "accuracy": pairwise_accuracy(chosen.members[i], rejected.members[i]),
                "train_loss": last_logged([r for r in curve if r["member"] == i], "loss"),
            }
            for i in range(config.num_members)
        },
        "accuracy_by_flaw": accuracy_by_flaw(held_out, chosen.mean, rejected.mean),
        "mean_margin": float((chosen.mean - rejected.mean).mean()),
        "mean_std": float(((chosen.std + rejected.std) / 2).mean()),
        "eval_pairs": len(held_out),
        "train_seconds": train_seconds,
    }
    discard_checkpoints(stage)
    return metrics, curve


def main() -> None:
    config = load_config("rm")
    with stage_run("rm", config):
        with atomic_dir(OUT_DIR) as tmp:
            metrics, curve = run(config, init_dir(config), DATA, EVAL_DATA, tmp)
        write_json(METRICS, metrics)
        write_csv(PLOT, curve)
        mlflow.log_metrics(numeric_metrics(metrics))
        mlflow.log_artifact(str(PLOT))
        print(f"rm: ensemble held-out pairwise accuracy {metrics['ensemble_accuracy']:.3f}")


if __name__ == "__main__":
    main()
