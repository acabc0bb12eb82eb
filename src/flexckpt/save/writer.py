"""Writing one rank's staged stream: cut into chunks, compress each (optionally),
checksum what is stored, and write the rank's data file, then its chunk table and
per-rank values (:func:`write_rank_files`, which makes the rank's record line). Both
tiers write through these functions."""
from __future__ import annotations

import base64
import threading
from typing import Any, Iterator, NamedTuple

import numpy as np
import orjson
import torch

from flexckpt.format.checksum import checksum
import flexckpt.format.checksum as checksums  # the chunk table's and values' checksums (``checksum``: the chunks')
from flexckpt.format.chunktable import ChunkTable
from flexckpt.format.codec import Compression, compress
from flexckpt.format.manifest import StoredChunk
from flexckpt.format.names import table_name, values_name
from flexckpt.format.write_plan import Chunk
from flexckpt.state.dtypes import dtype_name
from flexckpt.storage import DIRECT_ALIGN, Storage


class RawSums:
    """The chunk checksums of one staged stream, computed once for the two writers that read
    it uncompressed (a persistent save and the fast-tier save sharing its buffer): the first
    caller hashes, the other waits for its result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: list[str] | None = None

    def __call__(self, stream: memoryview, chunks: tuple[Chunk, ...]) -> list[str]:
        with self._lock:
            if self._sums is None:
                self._sums = [checksum(stream[c.offset : c.offset + c.length]) for c in chunks]
            return self._sums


def raw_chunks(stream: memoryview, chunks: tuple[Chunk, ...], sums: RawSums | None = None) -> list[StoredChunk]:
    """``chunks`` of an uncompressed stream as stored, checksummed (by ``sums`` where given)."""
    return [StoredChunk(c.offset, c.length, c.offset, c.length, "none", h)
            for c, h in zip(chunks, (sums or RawSums())(stream, chunks))]


def write_data_file(
    storage: Storage,
    rel: str,
    buffer: memoryview,
    nbytes: int,
    chunks: tuple[Chunk, ...],
    compression: Compression,
    fsync: bool,
    direct: bool = True,
    sums: RawSums | None = None,
) -> list[StoredChunk]:
    """Write the first ``nbytes`` of ``buffer`` (a staging buffer, aligned and padded for
    O_DIRECT) as one data file; returns the stored chunks, checksummed (uncompressed: by
    ``sums`` where given, shared with another writer of the same stream)."""
    stream = buffer[:nbytes]
    if compression.codec == "none":
        # stored bytes are the raw stream: checksum each chunk, then write the whole file at
        # once, straight from the staging buffer to the device where the filesystem allows
        stored = raw_chunks(stream, chunks, sums)
        write_raw(storage, rel, buffer, nbytes, fsync, direct)
        return stored
    stored = []

    def parts() -> Iterator["bytes | memoryview"]:
        pos = 0
        for c in chunks:
            data = compress(stream[c.offset : c.offset + c.length], compression)
            n = len(data)
            stored.append(StoredChunk(c.offset, c.length, pos, n, compression.codec, checksum(data)))
            pos += n
            yield data

    storage.write_stream(rel, parts(), fsync=fsync)
    return stored


def write_raw(storage: Storage, rel: str, buffer: memoryview, nbytes: int, fsync: bool, direct: bool = True) -> None:
    """Write the first ``nbytes`` of ``buffer`` as they are, as one data file: with
    ``direct``, straight from the buffer (aligned and padded for O_DIRECT) to the device
    where the filesystem allows."""
    padded = buffer[: -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN]
    if not (direct and padded.nbytes <= buffer.nbytes and storage.write_direct(rel, padded, nbytes, fsync=fsync)):
        storage.write_stream(rel, [buffer[:nbytes]], fsync=fsync)


class RankFiles(NamedTuple):
    """What :func:`write_rank_files` wrote: the rank's record line and the two files' bytes."""

    line: list  # [fingerprint, table checksum, table bytes, stored bytes, values checksum ("" without values), values bytes]
    table: bytes
    values: bytes  # empty: the rank has no per-rank values (no file written)


def write_rank_files(
    storage: Storage, folder: str, *, rank: int, attempt: str, fingerprint: str, codec: str,
    chunks: list[StoredChunk], per_rank: dict[str, bytes], fsync: bool,
) -> RankFiles:
    """After the rank's data file (whose stored ``chunks`` are given): its chunk table, then
    its per-rank values file (none when it has no values), into step folder ``folder``.
    The returned line is the rank's entry in its record and in the manifest."""
    table = table_bytes(rank=rank, attempt=attempt, codec=codec, chunks=chunks)
    storage.put_atomic(f"{folder}/{table_name(attempt, rank)}", table, fsync=fsync)
    values = values_bytes(per_rank)
    if values:  # this rank's own values: a file that only this rank reads back
        storage.put_atomic(f"{folder}/{values_name(attempt, rank)}", values, fsync=fsync)
    line = [fingerprint, checksums.checksum(table), len(table), sum(c.length for c in chunks),
            checksums.checksum(values) if values else "", len(values)]
    return RankFiles(line, table, values)


def encode_per_rank(value: Any) -> Any:
    """A per-rank value as JSON: itself, or a small tensor as dtype, shape and base64 bytes
    (:func:`flexckpt.load.pending.decode_per_rank` reads it back)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {
            "$tensor": {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode(),
            }
        }
    return value


def values_bytes(per_rank: dict[str, bytes]) -> bytes:
    """A rank's per-rank values file: one JSON object (values already encoded, spliced in);
    empty when the rank has none (then no file is written)."""
    return orjson.dumps({k: orjson.Fragment(v) for k, v in per_rank.items()}) if per_rank else b""


def table_bytes(*, rank: int, attempt: str, codec: str, chunks: list[StoredChunk]) -> bytes:
    """The rank's table file: stored length and checksum of every chunk of its data file."""
    return ChunkTable(
        rank, codec, attempt,
        np.fromiter((c.length for c in chunks), dtype=np.uint64, count=len(chunks)),
        np.fromiter((int(c.checksum, 16) for c in chunks), dtype=np.uint64, count=len(chunks)),
        b"",
    ).to_bytes()
