"""Chunk checksums: xxh3-64 (the xxhash package), which runs at tens of GB/s, so verifying
every read never becomes the bottleneck."""
from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"


def checksum_int(data: "bytes | memoryview") -> int:
    """xxh3-64 of ``data``, in one call: python-xxhash (4.1.0 measured) lets go of the GIL
    while it hashes a large input (measured: a second thread keeps running through a 64 MiB
    hash), so a training thread is not held up by a background thread's hash. The digest
    equals one streamed in pieces (what earlier versions computed)."""
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
