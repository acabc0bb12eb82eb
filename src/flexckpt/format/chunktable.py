"""A rank's table file (format version 2): what a load cannot recompute about that rank's
data file, in compact binary, next to it in the save attempt's folder.

Layout (little-endian)::

    magic  b"FXCKTBL1"        8 bytes
    rank   u32, codec u32 (0 none, 1 zstd), chunks u64, per_rank_len u64, attempt_len u32
    attempt                   attempt_len bytes (ASCII): binds the table to its save attempt
    stored_length[chunks]     u64 each: bytes of chunk i in the data file
    checksum[chunks]          u64 each: xxh3-64 of the stored bytes of chunk i
    per_rank                  per_rank_len bytes (0 as written now: per-rank values have a
                              file of their own, see ``names.values_name``)

Raw chunk boundaries are not stored: the plan recomputes them. The manifest holds each
table file's xxh3-64 and length, so a table is verified before it is parsed, and the
table, in turn, verifies every chunk of the data file.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import orjson

from flexckpt.errors import ManifestError

MAGIC = b"FXCKTBL1"
_HEADER = struct.Struct("<8sIIQQI")
CODEC_IDS = {"none": 0, "zstd": 1}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
MAX_TABLE_BYTES = 64 << 20


@dataclass(frozen=True)
class ChunkTable:
    rank: int
    codec: str
    attempt: str
    stored_lengths: np.ndarray  # uint64, one per chunk
    checksums: np.ndarray  # uint64, one per chunk
    per_rank: bytes  # JSON object of this rank's per-rank values

    def to_bytes(self) -> bytes:
        attempt = self.attempt.encode("ascii")
        n = len(self.stored_lengths)
        header = _HEADER.pack(MAGIC, self.rank, CODEC_IDS[self.codec], n, len(self.per_rank), len(attempt))
        return b"".join((
            header, attempt,
            np.asarray(self.stored_lengths, dtype="<u8").tobytes(),
            np.asarray(self.checksums, dtype="<u8").tobytes(),
            self.per_rank,
        ))

    def per_rank_values(self, where: str) -> dict:
        try:
            doc = orjson.loads(self.per_rank) if self.per_rank else {}
        except orjson.JSONDecodeError as e:
            raise ManifestError(f"{where}: per-rank values are not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: per-rank values must be a JSON object")
        return doc


def parse_table(data: bytes, where: str, *, rank: int, attempt: str, chunks: int) -> ChunkTable:
    """A table read back (already checked against the manifest's checksum): its header
    must name this rank, this attempt and the number of chunks the plan gives."""
    if len(data) < _HEADER.size:
        raise ManifestError(f"{where}: {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, got_rank, codec, n, per_len, att_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ManifestError(f"{where}: not a flexckpt chunk table (magic {magic!r})")
    if got_rank != rank or codec not in CODEC_NAMES or n != chunks:
        raise ManifestError(
            f"{where}: table of rank {got_rank} with {n} chunks (codec {codec}); expected rank {rank} with {chunks} "
            f"chunks as the plan gives"
        )
    want = _HEADER.size + att_len + 16 * n + per_len
    if len(data) != want:
        raise ManifestError(f"{where}: {len(data)} bytes, the header describes {want}")
    pos = _HEADER.size
    got_attempt = data[pos : pos + att_len].decode("ascii", errors="replace")
    if got_attempt != attempt:
        raise ManifestError(f"{where}: written by save attempt {got_attempt!r}, the manifest names {attempt!r}")
    pos += att_len
    lengths = np.frombuffer(data, dtype="<u8", count=n, offset=pos)
    checks = np.frombuffer(data, dtype="<u8", count=n, offset=pos + 8 * n)
    return ChunkTable(rank, CODEC_NAMES[codec], got_attempt, lengths, checks, bytes(data[pos + 16 * n :]))
