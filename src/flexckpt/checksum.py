"""Chunk checksums: xxh3-64 (the xxhash package), which runs at tens of GB/s, so verifying
every read never becomes the bottleneck."""
from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"


PIECE = 1 << 20  # hashed a piece at a time: xxhash holds the GIL for the whole of one call


def checksum_int(data: "bytes | memoryview") -> int:
    """xxh3-64 of ``data``. The xxhash package keeps the GIL during a call (measured: 15 ms
    for 50 MiB), so a large buffer is hashed in 1 MiB pieces (the same digest): a training
    thread waits at most one piece for a background thread's hash."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if len(view) <= PIECE:
        return xxhash.xxh3_64_intdigest(view)
    h = xxhash.xxh3_64()
    for i in range(0, len(view), PIECE):
        h.update(view[i : i + PIECE])
    return h.intdigest()


def checksum(data: "bytes | memoryview") -> str:
    return format(checksum_int(data), "016x")


digest = xxhash.xxh3_64_intdigest  # the checksum as an int: a load compares thousands of them


def digest_parts(parts: "list[memoryview]") -> int:
    """The digest of the concatenation of ``parts`` (a chunk read into several places)."""
    if len(parts) == 1:
        return digest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()
