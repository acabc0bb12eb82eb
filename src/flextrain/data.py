"""The zephon pipelines of a run, built from its configuration: the training side and the
held-out side of the same deterministic document split."""
from __future__ import annotations

import glob
from pathlib import Path

from zephon_state import Mix, Pipeline, Source, ZephonError, load_tokenizer
from zephon_state.source import as_source

from flextrain.config import ConfigError, DataConfig, eval_micro_batch


def source(name: str, path: str) -> Source:
    """``data.sources[name]``, read as zephon_state reads a path (JSON Lines by its suffix,
    else text files); a path it cannot take is refused naming the field."""
    try:
        return as_source(path)
    except ZephonError as e:
        raise ConfigError(f"data.sources[{name!r}]={path!r} is not allowed: {e}") from None


def build_pipeline(d: DataConfig, seed: int, rank: int, world: int, side: str = "train",
                   global_batch: int | None = None, calibration: dict[str, float] | None = None,
                   micro_batch: int | None = None) -> Pipeline:
    """The pipeline of ``side`` ("train" or "heldout") for data-parallel ``rank`` of ``world``.
    ``calibration`` (tokens per byte per source, e.g. a checkpoint's) skips measuring it: it
    sizes the readahead only and decides no batch."""
    mix = Mix({n: source(n, p) for n, p in d.sources.items()}, shares=dict(d.shares), calibration=calibration)
    g = global_batch or d.global_batch
    micro = micro_batch or min(d.micro_batch, g // world)
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
    evaluation sees the same ``eval_batches * lanes`` rows at any world size, in forward passes
    of a micro batch that divides this rank's rows."""
    return build_pipeline(d, seed, rank, world, side="heldout", global_batch=d.lanes, calibration=calibration,
                          micro_batch=eval_micro_batch(d.micro_batch, d.lanes, world))


def check_inputs(d: DataConfig, vocab_size: int) -> None:
    """The files and the tokenizer a run reads exist, before anything is built: one line
    naming the field otherwise (a URL is left to the storage layer)."""
    for name, path in d.sources.items():
        if "://" in path:
            continue
        if not (glob.glob(str(Path(path).expanduser())) if glob.has_magic(path) else Path(path).expanduser().exists()):
            raise ConfigError(f"data.sources[{name!r}]={path!r} is not allowed: no such file; give an existing "
                              "file, a glob matching files, or a URL")
    try:
        tok = load_tokenizer(d.tokenizer)
    except (ZephonError, OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is not allowed: {e}") from None
    size = tok.tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < size:
        raise ConfigError(f"model.vocab_size={vocab_size} is not allowed: tokenizer {d.tokenizer!r} has {size} "
                          f"tokens; set model.vocab_size={size} or more")
