"""Stage `sft`: supervised fine-tuning of the base model on demonstrations.

In:  models/base, data/prepared/sft.parquet (prompt/completion or messages).
Out: models/sft (a plain model: a LoRA adapter is merged on save), metrics/sft.json,
     plots/sft/loss.csv.

TRL's `SFTTrainer` with loss on the completion only (prompt-completion data) or on the
assistant turns only (conversational data, through the chat template's generation
markers), each batch run as length-sorted sub-batches (rlhf.training.bucketed_sft: the
same loss, less padding). Checkpoints go to checkpoints/sft/<fingerprint>/ every `save_steps`; a killed
run restarted with the same params and inputs (`dvc repro` again) resumes from the last one.

    python -m stages.sft
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import Field

from rlhf.artifacts import atomic_dir, write_csv, write_json
from rlhf.training.params import LoraParams, TrainingParams
from stages import CHECKPOINTS_DIR, DATA_DIR, MODELS_DIR, SFT_DIR, load_model_stage

BASE_DIR = MODELS_DIR / "base"
DATA = DATA_DIR / "sft.parquet"
OUT_DIR = SFT_DIR
METRICS = Path("metrics/sft.json")
PLOT = Path("plots/sft/loss.csv")
CURVE_KEYS = ("loss", "mean_token_accuracy", "learning_rate")


class Config(TrainingParams):
    max_steps: int = Field(1000, gt=0, description="optimizer steps")
    per_device_train_batch_size: int = Field(64, gt=0, description="examples per step per device")
    learning_rate: float = Field(3e-3, gt=0, lt=1, description="peak learning rate")
    max_length: int = Field(96, gt=0, description="tokens per example (longer ones are truncated)")
    loss_on: str = Field("completion", pattern="^(completion|all)$", description="completion only, or every token")
    length_buckets: int = Field(
        4, ge=1, description="run each batch as this many length-sorted sub-batches: same loss, less padding (1 = off)"
    )
    lora: LoraParams = Field(default_factory=LoraParams, description="optional LoRA adapter, merged on save")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")


def run(config: Config, base_dir: Path, data: Path, out_dir: Path, stage: str = "sft") -> tuple[dict, list[dict]]:
    """Fine-tune `base_dir`, save the model into `out_dir`; return metrics and the loss
    curve. `stage` names the checkpoint folder (stage `verifier` trains the same way)."""
    from datasets import Dataset
    from trl import SFTConfig

    from rlhf.data.contracts import read_prepared
    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model
    from rlhf.training.bucketed_sft import LengthBucketedSFTTrainer, tokenize_prompt_completion
    from rlhf.training.trainer_setup import (
        checkpoint_dir,
        discard_checkpoints,
        fingerprint,
        last_logged,
        log_history_rows,
        merged_model,
        train_resumable,
        trl_config,
    )

    tokenizer = load_tokenizer(base_dir, config.trust_remote_code)
    model = load_causal_lm(base_dir, config.trust_remote_code, what=str(base_dir), training=True)
    table = read_prepared(data, "sft")
    conversational = "messages" in table.columns
    if conversational or not isinstance(table["prompt"].iloc[0], str):
        dataset = Dataset.from_pandas(table, preserve_index=False)
    else:  # tokenised here in one batched call, to the ids TRL would make row by row
        dataset = tokenize_prompt_completion(tokenizer, table["prompt"].tolist(), table["completion"].tolist())
    only_target = config.loss_on == "completion"
    key = fingerprint(config, [base_dir, data])
    args = trl_config(
        SFTConfig,
        config,
        checkpoint_dir(CHECKPOINTS_DIR, stage, key),
        max_length=config.max_length,
        completion_only_loss=only_target and not conversational,
        assistant_only_loss=only_target and conversational,
        packing=False,
    )
    trainer = LengthBucketedSFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=config.lora.peft_config(),
        buckets=config.length_buckets,
    )
    start = time.perf_counter()
    resumed = train_resumable(trainer, stage, key)
    history = trainer.state.log_history
    save_model(merged_model(trainer.model), tokenizer, out_dir)
    discard_checkpoints(CHECKPOINTS_DIR, stage)
    metrics = {
        "train_loss": last_logged(history, "loss"),
        "mean_token_accuracy": last_logged(history, "mean_token_accuracy"),
        "steps": trainer.state.global_step,
        "train_seconds": time.perf_counter() - start,
        "resumed": bool(resumed),
    }
    return metrics, log_history_rows(history, CURVE_KEYS)


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

    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_model_stage()
    config = params[stage]  # the verifier stage runs this trainer with its own section
    with stage_run(stage, config):
        with atomic_dir(out_dir) as tmp:
            metrics, curve = run(config, init_dir, DATA, tmp, stage=stage)
        write_json(metrics_path, metrics)
        write_csv(plot, curve)
        mlflow.log_metrics(numeric_metrics(metrics))
        mlflow.log_artifact(str(plot))


if __name__ == "__main__":
    main()
