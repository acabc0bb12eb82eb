"""Chunk checksums: xxh3-64 (the xxhash package), which runs at tens of GB/s and releases
the GIL, so verifying every read never becomes the bottleneck."""
from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"


def checksum(data: "bytes | memoryview") -> str:
    return format(xxhash.xxh3_64_intdigest(data), "016x")


def checksum_parts(parts: "list[memoryview]") -> str:
    """The checksum of the concatenation of ``parts`` (a chunk read into several places)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return format(h.intdigest(), "016x")
