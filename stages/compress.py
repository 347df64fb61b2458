"""Stage `compress`: context compressors for long prompts, trained for the model they serve.

In:  models/<compress.serve> (the model read with compressed contexts: sft by default),
     data/prepared/compress.parquet (context, prompt, completion: long-context rows).
Out: models/compressor/k<tokens>/ for each of `compress.tokens` (rlhf.models.compressor:
     `ContextCompressor.from_pretrained(folder, model)`), metrics/compress.json,
     plots/compress/loss.csv.

Off by default (`compress.enabled: false`): the stage then writes models/compressor with
`absent.json` only, in a second (no torch import, no MLflow run), and evaluate and infer
read no compressor. On, each
compressor reads a context in chunks of at most `chunk_tokens` tokens (every
`chunk_tokens`, or whole sentences with `chunk_by: sentences`), `tokens` slots each (the
nominal compression is their ratio; with sentences a chunk holds fewer), and is trained with the served model frozen, so it is saved
as a small adapter next to that model and refuses any other (its fingerprint is recorded).
Checkpoints go to checkpoints/compress/k<tokens>/<fingerprint>/; a killed run resumes.

    python -m stages.compress
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from rlhf.atomic import atomic_dir, write_csv, write_json
from rlhf.training.params import TrainingParams
from stages import (
    CHECKPOINTS_DIR,
    COMPRESSOR_DIR,
    DATA_DIR,
    MODELS_DIR,
    drop_out,
    has_rows,
    load_all,
    load_model_stage,
)

DATA = DATA_DIR / "compress.parquet"
OUT_DIR = COMPRESSOR_DIR
METRICS = Path("metrics/compress.json")
PLOT = Path("plots/compress/loss.csv")


class Config(TrainingParams):
    """params `compress`: what to train, and how (rlhf.training.compress trains)."""

    TRL_CONFIG: ClassVar[str | None] = "TrainingArguments"

    enabled: bool = Field(False, description="train compressors (off: the stage writes an empty folder)")
    serve: str = Field("sft", description="the model the compressors serve: a folder under models/ (sft, merged, ...)")
    tokens: list[int] = Field(
        default_factory=lambda: [32], min_length=1, description="memory slots per chunk; one compressor for each"
    )
    chunk_tokens: int = Field(128, gt=0, description="context tokens per chunk (compression: chunk_tokens / tokens)")
    chunk_by: Literal["tokens", "sentences"] = Field(
        "tokens",
        description="where a context is cut into chunks: every chunk_tokens tokens, or between sentences (as many "
        "whole sentences as fit; needs a fast tokenizer)",
    )
    query_aware: bool = Field(
        True, description="the encoder reads each chunk with the question after it (which facts to keep)"
    )
    adapter_reads: bool = Field(
        True,
        description="the adapter is on while the model reads the slots too (AutoCompressors, gisting); off: the "
        "served model reads them as it is (ICAE)",
    )
    slot_positions: Literal["parallel", "sequential"] = Field(
        "parallel",
        description="where the model reads the slots: parallel (each chunk's slots at positions 0..tokens-1, the "
        "prompt right after: any context length fits the window) or sequential (one after another)",
    )
    recite: float = Field(
        0.0,
        ge=0,
        description="weight of a second training target: the context's relevant sentences (the table's `relevant` "
        "column), written from the slots; 0: the answer alone",
    )
    crops: list[int] = Field(
        default_factory=list,
        description="train on each row again as crops of its context: its relevant sentences (the table's "
        "`relevant` column) and N sentences around them, one crop for each N; []: whole contexts only",
    )
    select: int = Field(
        0,
        ge=0,
        description="chunks the model reads per context: the best by a relevance head trained on which chunks hold "
        "the table's `relevant` sentences; 0: every chunk",
    )
    lora_r: int = Field(16, gt=0, description="rank of the encoder's LoRA adapter")
    lora_alpha: int = Field(32, gt=0, description="its scaling numerator")
    max_steps: int | None = Field(600, gt=0, description="optimizer steps per compressor")
    per_device_train_batch_size: int = Field(16, gt=0, description="rows per step per device")
    learning_rate: float = Field(1e-3, gt=0, lt=1, description="peak learning rate")
    save_steps: int = Field(100, gt=0, description="checkpoint every N steps (a killed run resumes from the last)")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")

    def cross_problems(self, run, section: str) -> list[str]:
        if not self.enabled:
            return []
        problems = []
        if "compress" not in run.params["prepare"].available():
            problems.append(
                f"{section}.enabled: no compress table to train on; generate one (prepare.source word_problems with "
                "prepare.word_problems.context_chars) or give prepare.files.compress (context, prompt, completion)"
            )
        for tokens in self.tokens:
            if tokens >= self.chunk_tokens:
                problems.append(
                    f"{section}.tokens: {tokens} slots for a chunk of {section}.chunk_tokens {self.chunk_tokens} "
                    "context tokens is no compression; give fewer slots than chunk tokens"
                )
        return problems


def window_of(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def run(config: Config, serve_dir: Path, data: Path, out_dir: Path) -> tuple[dict, list[dict]]:
    """Train one compressor per `config.tokens` for the model in `serve_dir` on `data` into
    `out_dir`/k<tokens>; (metrics, the loss curve)."""
    from rlhf.data.prepared import read_prepared
    from rlhf.models.compressor import check_settings
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.training.trainer_setup import checkpoint_dir, fingerprint, log_history_rows

    rows = read_prepared(data, "compress", ["context", "prompt", "completion", "relevant"])
    if "relevant" not in rows:
        wants = (("crops", config.crops), ("recite", config.recite > 0), ("select", config.select > 0))
        asks = [f"compress.{key}" for key, on in wants if on]
        if asks:
            from rlhf.models.compressor import CompressorError

            raise CompressorError(
                f"{' and '.join(asks)} read each row's relevant sentences, and {data} has no `relevant` column: add "
                "one (the part of the context the prompt needs), or set compress.crops: [], compress.recite: 0 and "
                "compress.select: 0"
            )
    tokenizer = load_tokenizer(serve_dir, config.trust_remote_code)
    wants = [key for key, on in (("compress.chunk_by: sentences", config.chunk_by == "sentences"),
                                 ("compress.select", config.select > 0)) if on]  # fmt: skip
    if wants and not tokenizer.is_fast:
        from rlhf.models.compressor import CompressorError

        raise CompressorError(
            f"{' and '.join(wants)} read where each token sits in the text, which the tokenizer of {serve_dir} (not a "
            "fast one) does not say: give the model a fast tokenizer (tokenizer.json), or set compress.chunk_by: "
            "tokens and compress.select: 0"
        )
    metrics: dict = {"serve": str(serve_dir), "rows": len(rows), "compressors": {}}
    curve: list[dict] = []
    for tokens in config.tokens:
        model = load_causal_lm(serve_dir, config.trust_remote_code, what=str(serve_dir))
        window = window_of(model)
        check_settings(tokens, config.chunk_tokens, window)
        key = fingerprint(config, [serve_dir, data], context={"tokens": tokens})
        checkpoints = checkpoint_dir(CHECKPOINTS_DIR, f"compress/k{tokens}", key)
        from rlhf.training.compress import train_compressor

        start = time.perf_counter()
        compressor, history = train_compressor(config, model, tokenizer, rows, tokens, serve_dir, checkpoints, window)
        seconds = time.perf_counter() - start
        compressor.save_pretrained(out_dir / f"k{tokens}")
        losses = [h["loss"] for h in history if "loss" in h]
        metrics["compressors"][f"k{tokens}"] = {
            "tokens": tokens,
            "chunk_tokens": config.chunk_tokens,
            "ratio": config.chunk_tokens / tokens,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "train_seconds": seconds,
            "trained_parameters": sum(p.numel() for p in compressor.parameters() if p.requires_grad),
        }
        curve += [{**row, "compressor": f"k{tokens}"} for row in log_history_rows(history, ("loss",))]
        del compressor, model
    return metrics, curve


def main() -> None:
    if not load_all()["compress"].enabled:  # in a second: no torch, no MLflow run (as check_params)
        with atomic_dir(OUT_DIR) as tmp:
            drop_out("compress", tmp, "compress.enabled is false", METRICS, PLOT)
        return
    import mlflow

    from rlhf.tracking.runs import numeric_metrics, stage_run
    from rlhf.training.trainer_setup import discard_checkpoints

    params = load_model_stage(override=lambda p: p["compress"].model, key="compress")
    config = params["compress"]
    with stage_run("compress", config):
        with atomic_dir(OUT_DIR) as tmp:
            if not has_rows(DATA):
                drop_out("compress", tmp, f"{DATA} has no rows", METRICS, PLOT)
                return
            metrics, curve = run(config, MODELS_DIR / config.serve, DATA, tmp)
        discard_checkpoints(CHECKPOINTS_DIR, "compress")
        write_json(METRICS, metrics)
        write_csv(PLOT, curve)
        mlflow.log_metrics(numeric_metrics(metrics["compressors"]))
        mlflow.log_artifact(str(PLOT))


if __name__ == "__main__":
    main()
