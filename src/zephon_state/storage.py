"""Reading source files through fsspec: local paths, ``s3://`` and any other protocol, with an
optional local cache for remote files and decompression chosen by suffix (``.gz``, ``.zst``)."""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import fsspec
import zstandard
from fsspec.utils import get_protocol

from .errors import ConfigError, SourceError

_LOCAL_PROTOCOLS = ("file", "local")
_GLOB_CHARS = ("*", "?", "[")
_FEED_BYTES = 1 << 16  # compressed bytes fed per step: a damage report is this precise


def default_cache_dir() -> str:
    """``$ZEPHON_CACHE_DIR``, else ``~/.cache/zephon_state/files``."""
    env = os.environ.get("ZEPHON_CACHE_DIR")
    return env if env else str(Path.home() / ".cache" / "zephon_state" / "files")


@dataclass(frozen=True)
class CacheOptions:
    """Keep copies of remote files in a local folder (fsspec's ``filecache``); local paths are
    read in place. ``check_remote`` re-validates a cached copy against the remote file."""

    enabled: bool = False
    dir: str | None = None
    check_remote: bool = False


@dataclass(frozen=True)
class IoOptions:
    """How source files are reached. ``storage_options`` go to the fsspec filesystem (for s3:
    ``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``)."""

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache: CacheOptions = field(default_factory=CacheOptions)

    @classmethod
    def from_value(cls, value: "IoOptions | Mapping[str, Any] | None") -> "IoOptions":
        """Accept an ``IoOptions`` or the plain dict form ``{"cache": {...}, "storage_options": {...}}``."""
        if value is None:
            return cls()
        if isinstance(value, IoOptions):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"io_options must be a dict or IoOptions, got {type(value).__name__}")
        unknown = set(value) - {"cache", "storage_options"}
        if unknown:
            raise ConfigError(
                f"io_options has unknown keys {sorted(unknown)}; the known keys are 'cache' and 'storage_options'"
            )
        cache = value.get("cache") or {}
        if isinstance(cache, Mapping):
            bad = set(cache) - {"enabled", "dir", "check_remote"}
            if bad:
                raise ConfigError(
                    f"io_options['cache'] has unknown keys {sorted(bad)}; the known keys are "
                    "'enabled', 'dir' and 'check_remote'"
                )
            cache = CacheOptions(**cache)
        elif not isinstance(cache, CacheOptions):
            raise ConfigError(f"io_options['cache'] must be a dict, got {type(cache).__name__}")
        return cls(storage_options=dict(value.get("storage_options") or {}), cache=cache)


def _filesystem(url: str, io: IoOptions) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return _open_filesystem(url, io)
    except ImportError as exc:  # fsspec's backend for the scheme is not installed
        raise ConfigError(f"source {url!r}: {exc} (s3://: pip install 'flexckpt[s3]')") from exc


def _open_filesystem(url: str, io: IoOptions) -> tuple[fsspec.AbstractFileSystem, str]:
    protocol = get_protocol(url)
    if io.cache.enabled and protocol not in _LOCAL_PROTOCOLS:
        fs = fsspec.filesystem(
            "filecache",
            target_protocol=protocol,
            target_options=dict(io.storage_options),
            cache_storage=io.cache.dir or default_cache_dir(),
            check_files=io.cache.check_remote,
        )
        return fs, url
    fs, path = fsspec.core.url_to_fs(url, **dict(io.storage_options))
    return fs, path


def expand(url: str, io: IoOptions) -> list[str]:
    """The files a path or glob pattern names, sorted (their order is part of the data plan)."""
    fs, path = _filesystem(url, io)
    if any(c in url for c in _GLOB_CHARS):
        found = sorted(fs.glob(path))
        if not found:
            raise ConfigError(f"no file matches {url!r}; check the pattern and the storage options")
        protocol = get_protocol(url)
        prefix = "" if protocol in _LOCAL_PROTOCOLS else f"{protocol}://"
        return [p if "://" in p or not prefix else prefix + p for p in found]
    return [url]


def read_bytes(url: str, io: IoOptions) -> bytes:
    """The whole file, decompressed when its name ends in ``.gz`` or ``.zst``/``.zstd``."""
    fs, path = _filesystem(url, io)
    try:
        with fs.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise ConfigError(f"source file {url!r} does not exist; check the path and the storage options") from e
    if url.endswith(".gz"):
        return decompress(raw, url, "gzip", lambda: zlib.decompressobj(wbits=31), zlib.error)
    if url.endswith((".zst", ".zstd")):
        dctx = zstandard.ZstdDecompressor()
        return decompress(raw, url, "zstd", dctx.decompressobj, zstandard.ZstdError)
    return raw


def decompress(raw: bytes, url: str, codec: str, new_stream: Callable[[], Any], error: type) -> bytes:
    """Every frame (gzip member, zstd frame) of ``raw``, one after another. A frame that is
    damaged or cut short raises ``SourceError`` naming the file and the byte offsets: a
    truncated file must never pass for a shorter one."""
    out: list[bytes] = []
    start = 0
    while start < len(raw):
        stream, pos = new_stream(), start
        while not stream.eof and pos < len(raw):
            chunk = raw[pos : pos + _FEED_BYTES]
            try:
                out.append(stream.decompress(chunk))
            except error as e:
                raise SourceError(
                    f"source file {url!r} is damaged: its {codec} frame starting at byte {start} fails between "
                    f"bytes {pos} and {pos + len(chunk)} of {len(raw)} ({e}); replace the file"
                ) from None
            pos += len(chunk)
        if not stream.eof:
            raise SourceError(
                f"source file {url!r} is truncated: its {codec} frame starting at byte {start} is cut off at "
                f"byte {len(raw)}, the end of the file; replace the file (a partial copy or download?)"
            )
        start = pos - len(stream.unused_data)
    return b"".join(out)
