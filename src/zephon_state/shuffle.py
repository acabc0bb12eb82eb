"""Deterministic orders: each source's document order per epoch and each lane's row order per
shuffle window.

Every order is a function of a few integers (seed, purpose, source or lane, epoch or window)
and nothing else, so a lane's state needs no RNG state: the window index is enough. The keys
come from PCG64 seeded through SeedSequence, whose raw streams NumPy keeps stable across
versions (unlike ``Generator`` methods), and a stable argsort turns them into a permutation.
"""
from __future__ import annotations

import hashlib

import numpy as np

EPOCH = 1
WINDOW = 2
CALIBRATION = 3


def phase_key(phase: str) -> int:
    """A data phase name as a 63-bit integer that can seed orders."""
    return int.from_bytes(hashlib.sha256(phase.encode("utf-8")).digest()[:8], "little") >> 1


def permutation(n: int, *words: int) -> np.ndarray:
    """A permutation of ``range(n)`` (int64) determined by ``words`` alone."""
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    keys = np.random.PCG64(np.random.SeedSequence([int(w) for w in words])).random_raw(n)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def epoch_order(seed: int, phase: int, source: int, epoch: int, n: int) -> np.ndarray:
    """The order in which a source's ``n`` documents are dealt to lanes in ``epoch``."""
    return permutation(n, seed, phase, EPOCH, source, epoch)


def window_order(seed: int, phase: int, lane: int, window: int, n: int) -> np.ndarray:
    """The order in which ``lane`` emits the ``n`` rows of shuffle window ``window``."""
    return permutation(n, seed, phase, WINDOW, lane, window)


def calibration_order(n: int) -> np.ndarray:
    """The order in which calibration samples a source: fixed, so calibration is a property
    of the data and the tokenizer only."""
    return permutation(n, CALIBRATION)
