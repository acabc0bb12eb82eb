"""A deterministic held-out split of every source's documents.

Each document is kept or held out by a hash of (seed, source name, document index), so the
split is the same whatever the number of ranks, lanes or workers. One pipeline reads the
training side, another the held-out side, and no training batch contains a held-out
document. The split is part of the data fingerprint (when set).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from .errors import ConfigError
from .source import Documents

SIDES = ("train", "heldout")


@dataclass(frozen=True)
class HoldoutConfig:
    """Hold out about ``fraction`` of each source's documents, chosen by ``seed``;
    ``side`` says which part this pipeline reads."""

    fraction: float
    seed: int = 0
    side: Literal["train", "heldout"] = "train"

    def __post_init__(self) -> None:
        if not isinstance(self.fraction, (int, float)) or not 0 < self.fraction < 1:
            raise ConfigError(f"holdout(fraction={self.fraction!r}): fraction must be in (0, 1), e.g. 0.01")
        if type(self.seed) is not int or self.seed < 0:
            raise ConfigError(f"holdout(seed={self.seed!r}): seed must be a non-negative int")
        if self.side not in SIDES:
            raise ConfigError(f"holdout(side={self.side!r}) must be one of {SIDES}")

    def fields(self) -> dict:
        """What enters the fingerprint."""
        return {"fraction": float(self.fraction), "seed": self.seed, "side": self.side}


def held_out(source: str, count: int, cfg: HoldoutConfig) -> np.ndarray:
    """Boolean mask over ``count`` documents: True where the document is held out."""
    limit = int(cfg.fraction * 2**64)
    prefix = f"zephon-holdout/{cfg.seed}/{source}/".encode()
    draws = np.fromiter(
        (int.from_bytes(hashlib.blake2b(prefix + str(i).encode(), digest_size=8).digest(), "little") for i in range(count)),
        dtype=np.uint64, count=count,
    )
    return draws < np.uint64(limit)


def split(docs: Documents, cfg: HoldoutConfig) -> Documents:
    """The documents of ``cfg.side``, in their original order."""
    mask = held_out(docs.name, len(docs), cfg)
    keep = np.flatnonzero(mask if cfg.side == "heldout" else ~mask)
    if keep.size == 0:
        raise ConfigError(
            f"source {docs.name!r}: the {cfg.side!r} side of holdout(fraction={cfg.fraction}) has no documents "
            f"out of {len(docs)}; change the fraction"
        )
    texts = [docs.texts[i] for i in keep]
    return replace(docs, texts=texts, nbytes=docs.nbytes[keep])
