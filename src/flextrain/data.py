"""The zephon pipelines of a run, built from its configuration: the training side and the
held-out side of the same deterministic document split."""
from __future__ import annotations

from zephon_state import JsonLines, Mix, Pipeline, TextFiles

from flextrain.config import DataConfig


def _source(path: str):
    stripped = path.removesuffix(".zst").removesuffix(".gz")
    return JsonLines(path) if stripped.endswith((".jsonl", ".json")) else TextFiles(path)


def build_pipeline(d: DataConfig, seed: int, rank: int, world: int, side: str = "train",
                   global_batch: int | None = None, calibration: dict[str, float] | None = None) -> Pipeline:
    """The pipeline of ``side`` ("train" or "heldout") for data-parallel ``rank`` of ``world``.
    ``calibration`` (tokens per byte per source, e.g. a checkpoint's) skips measuring it: it
    sizes the readahead only and decides no batch."""
    mix = Mix({n: _source(p) for n, p in d.sources.items()}, shares=dict(d.shares), calibration=calibration)
    g = global_batch or d.global_batch
    micro = min(d.micro_batch, g // world)
    return (
        Pipeline(mix)
        .holdout(d.heldout_fraction, seed=seed, side=side)
        .tokenize(tokenizer_id=d.tokenizer, field="text", parallelism=d.workers)
        .pack_flat(max_length=d.max_length, algorithm=d.packing)
        .shuffle(buffer_size=d.shuffle_buffer, seed=seed)
        .batch(microbatch_size=micro, global_batch_size=g)
        .lanes(d.lanes)
        .data_parallel(rank=rank, size=world)
    )


def heldout_pipeline(d: DataConfig, seed: int, rank: int, world: int,
                     calibration: dict[str, float] | None = None) -> Pipeline:
    """The held-out side: as many lanes as training, one row per lane per batch, so every
    evaluation sees the same ``eval_batches * lanes`` rows at any world size."""
    return build_pipeline(d, seed, rank, world, side="heldout", global_batch=d.lanes, calibration=calibration)
