"""Per-stage configuration, validated once at construction with errors that name the fix."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError
from .pack import ALGORITHMS
from .storage import IoOptions


def _positive_int(owner: str, name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{owner}({name}={value!r}): {name} must be a positive int")


@dataclass(frozen=True)
class TokenizeConfig:
    """``tokenizer_id``: "gpt2" (bundled), a ``tokenizer.json`` path, or a hub id. ``field``:
    the text field of JSON records. ``parallelism``: tokenizer worker threads (performance
    only). ``eos``: the end-of-document token (string or id); found by name when None."""

    tokenizer_id: str = "gpt2"
    field: str = "text"
    parallelism: int = 1
    eos: str | int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer_id, str) or not self.tokenizer_id:
            raise ConfigError(f"tokenize(tokenizer_id={self.tokenizer_id!r}): pass 'gpt2' or a tokenizer.json path")
        if not isinstance(self.field, str) or not self.field:
            raise ConfigError(f"tokenize(field={self.field!r}): field must name the text field of each record")
        _positive_int("tokenize", "parallelism", self.parallelism)


@dataclass(frozen=True)
class PackConfig:
    """Rows of ``max_length`` tokens, packed by ``algorithm`` ("wrap" or "best_fit").
    ``window`` is the packing window in rows when no shuffle is configured (a shuffle's
    ``buffer_size`` is the window otherwise)."""

    max_length: int
    algorithm: Literal["wrap", "best_fit"] = "wrap"
    window: int = 64

    def __post_init__(self) -> None:
        _positive_int("pack_flat", "max_length", self.max_length)
        _positive_int("pack_flat", "window", self.window)
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"pack_flat(algorithm={self.algorithm!r}) is not one of {list(ALGORITHMS)}")


@dataclass(frozen=True)
class ShuffleConfig:
    """Windowed shuffle: each lane permutes ``buffer_size`` rows at a time with an order
    fixed by (seed, lane, window). ``seed`` also fixes each source's order per epoch."""

    buffer_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_int("shuffle", "buffer_size", self.buffer_size)
        if type(self.seed) is not int or self.seed < 0:
            raise ConfigError(f"shuffle(seed={self.seed!r}): seed must be a non-negative int")


@dataclass(frozen=True)
class BatchConfig:
    """Microbatches of ``microbatch_size`` rows; ``global_batch_size`` rows per optimizer step
    across all data-parallel ranks (default: one microbatch per rank)."""

    microbatch_size: int
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        _positive_int("batch", "microbatch_size", self.microbatch_size)
        if self.global_batch_size is not None:
            _positive_int("batch", "global_batch_size", self.global_batch_size)


@dataclass(frozen=True)
class DataParallel:
    """This process's data-parallel ``rank`` in a group of ``size``."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        _positive_int("data_parallel", "size", self.size)
        if type(self.rank) is not int or not 0 <= self.rank < self.size:
            raise ConfigError(f"data_parallel(rank={self.rank!r}, size={self.size}): rank must be in [0, {self.size})")


@dataclass(frozen=True)
class Options:
    """``io``: how files are reached (see ``IoOptions``). ``bad_records``: "count" (skip,
    count, report) or "raise". ``data_phase``: names the data phase; a new name starts new
    document and shuffle orders. The rest is performance only: ``prefetch`` (steps prepared
    ahead), ``readahead_windows`` (tokenization ahead, in windows per lane), ``chunk_bytes``
    (text per tokenizer call)."""

    io: IoOptions = field(default_factory=IoOptions)
    bad_records: Literal["count", "raise"] = "count"
    data_phase: str = "main"
    prefetch: int = 2
    readahead_windows: float = 1.0
    chunk_bytes: int = 1 << 16

    def __post_init__(self) -> None:
        if self.bad_records not in ("count", "raise"):
            raise ConfigError(f"options(bad_records={self.bad_records!r}) must be 'count' or 'raise'")
        if not isinstance(self.data_phase, str) or not self.data_phase:
            raise ConfigError(f"options(data_phase={self.data_phase!r}) must be a non-empty string")
        _positive_int("options", "prefetch", self.prefetch)
        _positive_int("options", "chunk_bytes", self.chunk_bytes)
        if not isinstance(self.readahead_windows, (int, float)) or not (
            math.isfinite(self.readahead_windows) and self.readahead_windows >= 0
        ):
            raise ConfigError(f"options(readahead_windows={self.readahead_windows!r}) must be a number >= 0")
