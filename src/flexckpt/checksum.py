"""Chunk checksums: xxh3-64 (the xxhash package), which runs at tens of GB/s and releases
the GIL, so verifying every read never becomes the bottleneck."""
from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"


def checksum(data: "bytes | memoryview") -> str:
    return format(xxhash.xxh3_64_intdigest(data), "016x")


def checksum_parts(parts: "list[memoryview]") -> str:
    """The checksum of the concatenation of ``parts`` (a chunk read into several places)."""
    return format(digest_parts(parts), "016x")


digest = xxhash.xxh3_64_intdigest  # the checksum as an int: a load compares thousands of them


def digest_parts(parts: "list[memoryview]") -> int:
    if len(parts) == 1:
        return digest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()
