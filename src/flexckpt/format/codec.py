"""Per-chunk compression: none, or zstd at a chosen level."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import zstandard

from flexckpt.errors import ChecksumError


@dataclass(frozen=True)
class Compression:
    codec: str = "none"  # "none" or "zstd"
    level: int = 3


def parse_compression(value: "str | Compression | None") -> Compression:
    """``None`` / ``"none"``, ``"zstd"`` or ``"zstd:LEVEL"`` (1..22)."""
    if value is None or value == "none":
        return Compression()
    if isinstance(value, Compression):
        return value
    if isinstance(value, str) and value.split(":")[0] == "zstd":
        parts = value.split(":")
        try:
            level = int(parts[1]) if len(parts) == 2 else 3
        except ValueError:
            level = -1
        if len(parts) <= 2 and 1 <= level <= 22:
            return Compression("zstd", level)
    raise ValueError(f"compression must be None, 'zstd' or 'zstd:LEVEL' with LEVEL in 1..22, got {value!r}")


_local = threading.local()


def compress(data: memoryview, compression: Compression) -> "bytes | memoryview":
    if compression.codec == "none":
        return data
    key = ("c", compression.level)
    cctx = getattr(_local, "cctx", {}).get(key)
    if cctx is None:
        cctx = zstandard.ZstdCompressor(level=compression.level, write_content_size=True)
        _local.__dict__.setdefault("cctx", {})[key] = cctx
    return cctx.compress(data)


def decompress_into(codec: str, stored: memoryview, raw_length: int, where: str) -> "bytes | memoryview":
    """Raw bytes of a verified chunk; refuses output longer than ``raw_length``."""
    if codec == "none":
        return stored
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        raw = dctx.decompress(stored, max_output_size=raw_length)
    except zstandard.ZstdError as e:
        raise ChecksumError(f"{where}: zstd frame does not decompress ({e})") from None
    if len(raw) != raw_length:
        raise ChecksumError(f"{where}: decompressed to {len(raw)} bytes, the manifest says {raw_length}")
    return raw
