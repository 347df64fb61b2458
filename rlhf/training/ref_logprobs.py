"""A persistent, content-keyed cache of reference log-probs for DPO and KTO.

With `precompute_ref_log_probs=True`, TRL's `DPOTrainer` and `KTOTrainer` run the frozen
reference model once over the training data before training (`_precompute_ref_logps`)
instead of once per step. TRL keeps the result only in the datasets cache of the current
dataset object, so every new run, and every point of a sweep over beta or the learning
rate, computes it again. `with_reference_cache(DPOTrainer)` returns a subclass that keys
the result by content and keeps it on disk:

    key = sha256(reference weights, tokenised data, trainer, split, tokenisation settings)

so a run whose reference model and data are unchanged loads the columns
(`ref_chosen_logps`/`ref_rejected_logps`, KTO: `ref_logps`/`ref_KL_logps`) instead of
computing them. Hyperparameters that do not change the reference log-probs (beta, loss
type, learning rate, steps) are not part of the key: that is the point of the cache.
Entries are written atomically; deleting the folder only costs recomputation.

Why TRL's own cache does not serve: TRL 1.16 keeps the result in the datasets cache under
the dataset's fingerprint, and the prepared tables are memory-mapped (rlhf.data.prepared),
so their fingerprints hold across runs; but DPO's filter of over-long prompts
(`truncation_mode: keep_start`, its default) is a lambda over the whole config, so the
fingerprint, and with it TRL's cache entry, changes with beta, the learning rate or any
other option. The digest here is streamed over the rows (`table_digest`): a table of any
size is hashed without being copied.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset, concatenate_datasets

from rlhf.atomic import atomic_file

CACHE_DIR_ENV = "RLHF_REF_LOGPS_CACHE"  # overrides the caller's cache folder (tests, a shared cache)
# Training arguments that change how a row is tokenised or truncated, hence its log-prob.
_TOKENISATION_ARGS = ("max_length", "max_prompt_length", "max_completion_length", "truncation_mode", "padding_free")


class _HashSink(io.RawIOBase):
    """A write-only file that hashes what is written to it."""

    def __init__(self):
        self.hash = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.hash.update(data)
        return len(data)


def table_digest(dataset: Dataset, batch_rows: int = 10_000) -> str:
    """sha256 of a dataset's rows (their Arrow IPC serialisation), as the dataset reads them
    (an indices mapping applied), streamed a batch at a time: the table is never copied."""
    sink = _HashSink()
    with pa.ipc.new_stream(sink, dataset.features.arrow_schema) as writer:
        for batch in dataset.with_format("arrow").iter(batch_size=batch_rows):
            writer.write_table(batch.cast(dataset.features.arrow_schema))
    return sink.hash.hexdigest()


def cache_key(model_hash: str, dataset: Dataset, trainer: str, split: str, args) -> str:
    settings = {name: getattr(args, name, None) for name in _TOKENISATION_ARGS}
    parts = [str(model_hash), table_digest(dataset), trainer, split, json.dumps(settings, sort_keys=True)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


class ReferenceCacheMixin:
    """Put in front of a TRL trainer that precomputes reference log-probs; `ref_cache_dir`
    is the folder that holds them (set by `with_reference_cache`)."""

    ref_cache_dir: Path

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        key = cache_key(self._precompute_model_hash, dataset, type(self).__name__, name, self.args)
        path = Path(os.environ.get(CACHE_DIR_ENV) or self.ref_cache_dir) / f"{key}.parquet"
        if path.is_file():
            print(f"reference log-probs for the {name} data: reusing {path}")
            self.ref_cache_hit = True
            cached = Dataset(pq.read_table(path))
            return concatenate_datasets([dataset, cached], axis=1)
        result = super()._precompute_ref_logps(dataset, name, batch_size)
        added = [column for column in result.column_names if column not in dataset.column_names]
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            pq.write_table(result.select_columns(added).data.table, tmp)
        self.ref_cache_hit = False
        return result


def with_reference_cache(trainer_cls: type, cache_dir: str | Path) -> type:
    """`trainer_cls` (DPOTrainer, KTOTrainer) with its precomputed reference log-probs cached
    in `cache_dir` (the environment variable RLHF_REF_LOGPS_CACHE, when set, wins)."""
    return type(f"Cached{trainer_cls.__name__}", (ReferenceCacheMixin, trainer_cls), {"ref_cache_dir": Path(cache_dir)})


def reference_trainer(trainer_cls, params, job):
    """The trainer class of a method with a reference model (DPO, KTO): where it precomputes
    reference log-probs (`rlhf.training.params.precompute_reference`) it keeps them in the content-keyed cache
    `job.ref_cache` (rlhf.training.ref_logprobs)."""
    if params.precompute_ref_log_probs is not False and job.ref_cache is not None:
        return with_reference_cache(trainer_cls, job.ref_cache)
    return trainer_cls
