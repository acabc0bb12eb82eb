"""Chunk checksums: xxh3-64 (the xxhash package), cheap enough that every chunk of every
read is verified (a load's cost of it: bench/RESULTS.md)."""
from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"


def checksum_int(data: "bytes | memoryview") -> int:
    """xxh3-64 of ``data``, in one call; equal to the digest of the same bytes streamed in
    pieces (:func:`digest_parts`). python-xxhash (4.1.0, the version constraints.txt pins;
    bench/RESULTS.md) releases the GIL while it hashes a large input, so a background
    thread's hash does not hold up the training thread."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    return xxhash.xxh3_64_intdigest(view)


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
