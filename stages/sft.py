"""Stage `sft`: supervised fine-tuning of the base model on demonstrations.

In:  models/base, data/prepared/sft.parquet (prompt/completion or messages).
Out: models/sft (a plain model: a LoRA adapter is merged on save), metrics/sft.json,
     plots/sft/loss.csv.

The training is rlhf.training.methods.sft (TRL's `SFTTrainer`, loss on the completion or the
assistant turns, length-sorted sub-batches). Checkpoints go to checkpoints/sft/<fingerprint>/
every `save_steps`; a killed run restarted with the same params and inputs (`dvc repro`
again) resumes from the last one.

    python -m stages.sft
"""

from __future__ import annotations

from pathlib import Path

from rlhf.atomic import atomic_dir, write_csv, write_json
from rlhf.training.methods.sft import SFTParams
from stages import CHECKPOINTS_DIR, DATA_DIR, MODELS_DIR, SFT_DIR, load_model_stage

BASE_DIR = MODELS_DIR / "base"
DATA = DATA_DIR / "sft.parquet"
OUT_DIR = SFT_DIR
METRICS = Path("metrics/sft.json")
PLOT = Path("plots/sft/loss.csv")


class Config(SFTParams):
    """params `sft` (every key: rlhf.training.methods.sft.Params)."""

    def cross_problems(self, run, section: str) -> list[str]:
        return run.adapter_problems(section, self)


def run(
    config: Config, base_dir: Path, data: Path, out_dir: Path, stage: str = "sft", model=None
) -> tuple[dict, list[dict]]:
    """Fine-tune `base_dir` on `data` into `out_dir` (rlhf.training.methods.sft.train), with
    checkpoints under checkpoints/<stage>/; metrics and the loss curve. `model`: how the
    model loads (params `model` with the section's own keys), resolved once."""
    import rlhf.training.methods.sft as sft
    from rlhf.training.trl_training import TrainingJob

    job = TrainingJob(
        stage=stage,
        key=stage,
        start=base_dir,
        data=data,
        checkpoints=CHECKPOINTS_DIR,
        trust_remote_code=config.trust_remote_code,
        model=model,
    )
    return sft.train(job, config, out_dir)


def main(
    stage: str = "sft",
    init_dir: Path = BASE_DIR,
    out_dir: Path = OUT_DIR,
    metrics_path: Path = METRICS,
    plot: Path = PLOT,
) -> None:
    """Train the model in `init_dir` with params section `stage` (stage `verifier` reuses
    this with its own section and paths)."""
    import mlflow

    from rlhf.models.compute import is_main
    from rlhf.tracking.runs import log_table, numeric_metrics, stage_run, tracked
    from rlhf.training.trainer_setup import discard_checkpoints

    params = load_model_stage(override=lambda p: p[stage].model, key=stage)
    config = params[stage]  # the verifier stage runs this trainer with its own section
    if config.loss_on is None:  # the verifier's default: where SFT's loss fell
        config = config.model_copy(update={"loss_on": params["sft"].loss_on})
    with stage_run(stage, config) as active:
        with atomic_dir(out_dir) as tmp:
            metrics, curve = run(config, init_dir, DATA, tmp, stage, params["model"].merged(config.model))
        if is_main():  # published: the checkpoints are no longer needed to resume
            discard_checkpoints(CHECKPOINTS_DIR, stage)
        if active is None:  # not rank 0 of a multi-process launch: rank 0 publishes
            return
        write_json(metrics_path, metrics)
        write_csv(plot, curve)
        with tracked("the metrics and the loss curve"):
            mlflow.log_metrics(numeric_metrics(metrics))
            mlflow.log_artifact(str(plot))
        log_table(DATA, "training")


if __name__ == "__main__":
    main()
