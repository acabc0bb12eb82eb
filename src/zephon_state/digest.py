"""The global batch digest, computable without moving data.

Each lane's contribution to a step (its ``G/L`` rows of input ids) is hashed on the rank that
hosts it: SHA-256 over the token ids as little-endian int32, row after row. The global digest
is SHA-256 over those 32-byte digests concatenated in lane order, so ranks only exchange
32 bytes per lane to compare a global batch across runs or data-parallel sizes.
"""
from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import numpy as np
import torch

from .errors import ConfigError


def lane_digest(input_ids: "np.ndarray | torch.Tensor") -> bytes:
    """SHA-256 of one lane's contribution: its rows of token ids as little-endian int32."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().cpu().numpy()
    data = np.ascontiguousarray(input_ids, dtype="<i4")
    return hashlib.sha256(data.tobytes()).digest()


def global_batch_digest(lane_digests: "Mapping[int, bytes] | Sequence[bytes]") -> str:
    """Hex SHA-256 over the per-lane digests in lane order. A mapping must hold lanes
    ``0 .. L-1`` exactly (the union of every rank's ``Batch.lane_digests``)."""
    if isinstance(lane_digests, Mapping):
        lanes = sorted(lane_digests)
        if lanes != list(range(len(lanes))):
            raise ConfigError(
                f"global_batch_digest needs the digests of lanes 0..L-1, got lanes {lanes}; "
                "gather Batch.lane_digests from every rank first"
            )
        ordered = [lane_digests[k] for k in lanes]
    else:
        ordered = list(lane_digests)
    for d in ordered:
        if not isinstance(d, (bytes, bytearray)) or len(d) != 32:
            raise ConfigError(f"a lane digest must be 32 bytes (SHA-256), got {d!r}")
    return hashlib.sha256(b"".join(ordered)).hexdigest()
