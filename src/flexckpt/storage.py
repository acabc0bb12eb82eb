"""Where checkpoint bytes live: one fsspec filesystem under one root (``file://``,
``memory://``, ``s3://`` ...), with the few operations a checkpoint needs.

Local filesystems get the exact commit protocol (temporary name, fsync, ``os.replace``,
fsync of the folder) and positional reads straight into caller memory; object stores get
one PUT per small object and ranged GETs.

Every call is bounded by the stall timeout (see ``storage_stall.py``): no progress for that long and
it raises ``StorageStalled``. Local data files are opened only inside the root: a symbolic
link that leads out of it is refused (the root itself may be a link).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import time
import uuid
from typing import Any, Callable, Iterable, Iterator, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from flexckpt.errors import CheckpointError, MissingFile, StorageError, TooLarge, TruncatedFile
from flexckpt.storage_stall import StorageStalled, bounded, progress, watched

DIRECT_ALIGN = 4096  # O_DIRECT wants buffer address, offsets and lengths on this boundary
DIRECT_WRITE_BYTES = 64 << 20
IOV_MAX = 1024  # buffers per preadv (Linux's UIO_MAXIOV)
DEFAULT_STALL_TIMEOUT = 300.0  # a local fsync of a large file is one call with no progress to report
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

F = TypeVar("F", bound=Callable[..., Any])


class OutsideRoot(CheckpointError, PermissionError):
    """A checkpoint file resolves (through a symbolic link) to a place outside the root."""


def _watched(method: F) -> F:
    """Run the storage call under the stall timeout of its ``Storage``: handed to a helper
    thread and watched, or, made inside a watched call (a load's reads under its fetch
    loop's watch), run directly (see ``storage_stall.bounded``)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if watched():
                return method(self, *args, **kwargs)
            stall = _storage(self).stall_timeout
            if stall is None:
                return method(self, *args, **kwargs)
            what = f"{method.__name__}({args[0]!r})" if args and isinstance(args[0], str) else method.__name__
            return bounded(stall, f"{what} on {_storage(self).url}", lambda: method(self, *args, **kwargs))
        except (CheckpointError, FileNotFoundError, StorageStalled):
            raise
        except Exception as exc:
            storage = _storage(self)
            if storage.local:
                raise  # a local disk's OSError keeps its errno (ENOSPC) and says what it is
            raise store_error(storage.url, exc) from exc

    return call  # type: ignore[return-value]


def _storage(obj: Any) -> "Storage":
    """The ``Storage`` of a storage call's object (a ``Storage``, or a ``RangeReader``)."""
    return obj if isinstance(obj, Storage) else obj.storage


def store_error(url: str, exc: BaseException) -> StorageError:
    """A store's failure as one line naming ``url`` and the cause: no credentials, refused
    credentials, no such bucket, an endpoint that does not answer (the backend's exception
    classes are recognised by name: flexckpt imports no backend)."""
    names = {c.__name__ for c in type(exc).__mro__}
    text = " ".join(str(exc).split())[:300]
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        cause = ("no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
                 "storage_options={'key': ..., 'secret': ...}")
    elif names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ConnectionError"}:
        cause = ("the endpoint does not answer: set AWS_ENDPOINT_URL, or pass storage_options={'client_kwargs': "
                 "{'endpoint_url': ...}}")
    elif "PermissionError" in names or any(k in text for k in ("InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                                "AccessDenied", "Access Denied", "Forbidden")):
        cause = "the credentials were refused: check the key and secret, and that they may list and write there"
    elif "NoSuchBucket" in text or "bucket does not exist" in text:
        cause = "the bucket does not exist: create it, or fix the URL"
    else:
        cause = "the store failed"
    return StorageError(f"{url}: {cause} ({type(exc).__name__}: {text})")


STORAGE_OPTIONS_ENV = "FLEXCKPT_STORAGE_OPTIONS"
_cli_options: dict[str, Any] | None = None  # a command's --storage-options (see using_storage_options)


def parse_storage_options(text: str, where: str) -> dict[str, Any]:
    """fsspec options from JSON text (an object); ``where`` names the text's source."""
    try:
        value = json.loads(text)
    except ValueError as e:
        value = e
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object of fsspec options, e.g. "
                         f"'{{\"client_kwargs\": {{\"endpoint_url\": \"http://host:9000\"}}}}', got {text[:100]!r}")
    return value


def default_storage_options() -> dict[str, Any] | None:
    """The options of an object store's URL given no ``storage_options``: a command's
    ``--storage-options``, else the JSON of ``FLEXCKPT_STORAGE_OPTIONS`` (the standard
    ``AWS_*`` variables, ``AWS_ENDPOINT_URL`` included, reach S3 without either)."""
    if _cli_options is not None:
        return _cli_options
    text = os.environ.get(STORAGE_OPTIONS_ENV)
    return parse_storage_options(text, STORAGE_OPTIONS_ENV) if text else None


@contextlib.contextmanager
def using_storage_options(options: dict[str, Any] | None) -> Iterator[None]:
    """Object-store URLs opened meanwhile without ``storage_options`` take ``options`` (a
    command line's ``--storage-options``)."""
    global _cli_options
    was, _cli_options = _cli_options, options
    try:
        yield
    finally:
        _cli_options = was


class Storage:
    """``stall_timeout``: seconds a call may go without progress before it is given up
    (None: never)."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"checkpoint location must be a URL or path string, got {url!r}")
        if stall_timeout is not None and not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
            raise ValueError(f"stall_timeout must be None or a positive number of seconds, got {stall_timeout!r}")
        self.stall_timeout = None if stall_timeout is None else float(stall_timeout)
        if storage_options is None and "://" in url and not url.startswith(("file://", "memory://")):
            storage_options = default_storage_options()
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as exc:  # fsspec's backend for the scheme is not installed
            raise ImportError(f"checkpoint location {url!r}: {exc} (s3://: pip install 'flexckpt[s3]')") from exc
        except ValueError as exc:
            if "Protocol not known" not in str(exc):
                raise
            scheme = url.split("://", 1)[0]
            raise ValueError(f"checkpoint location {url!r}: no storage knows the scheme {scheme!r}; use a local path, "
                             f"file://, memory:// or s3:// (pip install 'flexckpt[s3]'), or a scheme of an installed "
                             f"fsspec backend") from None
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.local = isinstance(fs, LocalFileSystem)
        if self.local:
            self.root = os.path.abspath(self.root)
        self.parallel_reads = not self.local  # small reads pay per request: issue them at once
        self._real_root: str | None = None  # the root's real location, found at the first check_inside

    def __getstate__(self) -> dict:
        raise TypeError("Storage is not picklable; pass the URL instead")

    def probe(self) -> None:
        """Check with one listing that an object store can be used, and raise
        ``StorageError`` naming the URL and the cause if not (no credentials, refused
        credentials, no bucket, no endpoint). Where the listing finds nothing (a new run)
        the bucket is checked too. A local or in-memory root is not probed: it needs no
        credentials, and its first save creates it; but a local file given for the root is
        refused, before anything lists or removes under it."""
        if self.local and os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StorageError(f"{self.url} is a file, not a folder: a checkpoint is a folder; pass the path of a "
                               f"folder (new or holding checkpoints)")
        if self.local or self.fs.protocol in ("memory", ("memory",)):
            return
        try:
            self._list_root()
        except FileNotFoundError:
            bucket = self.root.split("/", 1)[0]  # a missing prefix is a new run; a missing bucket is not
            if bucket == self.root or not self._exists_uncached(bucket):
                raise StorageError(f"{self.url}: the bucket {bucket!r} does not exist (or these credentials cannot "
                                   f"see it): create it, or fix the URL") from None

    @_watched
    def _list_root(self) -> None:
        self.fs.invalidate_cache(self.root)
        self.fs.ls(self.root, detail=False, refresh=True)

    @_watched
    def _exists_uncached(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if self.root != "/" else "/" + "/".join(parts)

    def check_inside(self, path: str) -> None:
        """Refuse a local file whose real location is outside the root's real location. The
        root's real location is found once (the root may be a link; what lies below it is
        looked at on every call): a path of plain names below the root, none of them a link,
        is inside; any other path is resolved in full."""
        if not self.local:
            return
        root = self._real_root
        if root is None:
            root = self._real_root = os.path.realpath(self.root)
        here = self.root.rstrip("/")
        if path.startswith(here + "/"):
            for name in path[len(here) + 1 :].split("/"):
                here += "/" + name
                if name in ("", ".", "..") or os.path.islink(here):
                    break
            else:
                return
        real = os.path.realpath(path)
        if os.path.commonpath([real, root]) != root:
            raise OutsideRoot(
                f"{path} is a symbolic link to {real}, outside the checkpoint root {root}; flexckpt does not "
                "follow links out of a checkpoint (copy the file into the checkpoint, or fix the link)"
            )

    # -- writing ---------------------------------------------------------------------------
    @_watched
    def makedirs(self, rel: str) -> None:
        if self.local:
            os.makedirs(self.path(rel), exist_ok=True)
        else:
            self.fs.makedirs(self.path(rel), exist_ok=True)

    @_watched
    def write_stream(self, rel: str, parts: Iterable[memoryview], fsync: bool = True) -> int:
        """Write ``parts`` one after the other to a new file; returns the bytes written."""
        total = 0
        if self.local:
            fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644)
            try:
                for part in parts:
                    view = memoryview(part)
                    while view.nbytes:
                        n = os.write(fd, view)
                        total += n
                        view = view[n:]
                        progress()
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return total
        with self.fs.open(self.path(rel), "wb") as f:
            for part in parts:
                f.write(part)
                total += memoryview(part).nbytes
                progress()
        return total

    @_watched
    def write_direct(self, rel: str, data: memoryview, nbytes: int, fsync: bool = True) -> bool:
        """Write ``data[:nbytes]`` to a new local file with O_DIRECT: the device reads the
        caller's memory, with no copy into the page cache (far less CPU taken from
        training). ``data`` must start on a DIRECT_ALIGN boundary and be a multiple of
        DIRECT_ALIGN long; the file is cut back to ``nbytes``. Returns False, having written
        nothing, where the filesystem refuses O_DIRECT."""
        if not self.local or not hasattr(os, "O_DIRECT"):
            return False
        try:
            fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | _NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        try:
            view = data
            while view.nbytes:
                try:
                    n = os.write(fd, view[:DIRECT_WRITE_BYTES])
                except OSError as e:
                    if e.errno == errno.EINVAL and view is data:
                        return False  # alignment this filesystem will not take; nothing written
                    raise
                if n % DIRECT_ALIGN and n != view.nbytes:
                    raise OSError(errno.EIO, f"short O_DIRECT write to {self.path(rel)}")
                view = view[n:]
                progress()
            os.ftruncate(fd, nbytes)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return True

    @_watched
    def put_atomic(self, rel: str, data: bytes, fsync: bool = True) -> None:
        """Make ``data`` appear under ``rel`` all at once: on a local filesystem a temporary
        name, fsync, ``os.replace`` and an fsync of the folder; elsewhere one PUT."""
        if not self.local:
            self.fs.pipe_file(self.path(rel), data)
            return
        final = self.path(rel)
        folder = os.path.dirname(final)
        tmp = os.path.join(folder, f".{os.path.basename(final)}.{uuid.uuid4().hex[:12]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                view = memoryview(data)
                while view.nbytes:
                    view = view[os.write(fd, view) :]
                    progress()
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk must not keep the half-written copy
                os.remove(tmp)
            raise
        if fsync:
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    # -- reading ---------------------------------------------------------------------------
    @_watched
    def read_bytes(self, rel: str, limit: int | None = None) -> bytes:
        """A whole small object; ``limit`` refuses bigger ones before reading them."""
        path = self.path(rel)
        if limit is not None:
            size = self.size(rel)
            if size > limit:
                raise TooLarge(f"{path} is {size} bytes, more than the {limit} allowed for it")
        try:
            if self.local:
                self.check_inside(path)
                with open(path, "rb") as f:
                    return f.read()
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise MissingFile(f"{path} is missing") from None

    @_watched
    def size(self, rel: str) -> int:
        path = self.path(rel)
        try:
            if self.local:
                return os.stat(path).st_size
            return int(self.fs.size(path))
        except FileNotFoundError:
            raise MissingFile(f"{path} is missing") from None

    @_watched
    def open_reader(self, rel: str) -> "RangeReader":
        return RangeReader(self, rel)

    def from_peer(self, rel: str) -> bool:
        """Whether ``rel``'s bytes come from ranges a peer sent rather than from this storage:
        never here (a fast tier's recovery view, :class:`flexckpt.tier.view.StepView`, says yes
        for the files it routes to a peer's ranges)."""
        return False

    # -- listing and removal ----------------------------------------------------------------
    @_watched
    def list_names(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (fresh, never from a listing cache); [] if absent."""
        path = self.path(rel) if rel else self.root
        if self.local:
            try:
                return sorted(os.listdir(path))
            except FileNotFoundError:
                return []
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    @_watched
    def glob(self, pattern: str) -> list[str]:
        """Paths (with the root) matching ``pattern`` under the root, never from a listing cache."""
        self.fs.invalidate_cache(self.root)
        return list(self.fs.glob(self.path(pattern)))

    @_watched
    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(self.path(rel))
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    @_watched
    def age(self, rel: str) -> float | None:
        """Seconds since ``rel``, or the newest object directly under it, was last written;
        None if there is nothing there."""
        path = self.path(rel)
        if self.local:
            try:
                times = [os.stat(path).st_mtime]
                if os.path.isdir(path):
                    times += [e.stat().st_mtime for e in os.scandir(path)]
            except FileNotFoundError:
                return None
            return max(0.0, time.time() - max(times))
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return None
        stamps = []
        for e in entries:
            t = e.get("LastModified") or e.get("mtime") or e.get("created")
            if hasattr(t, "timestamp"):
                stamps.append(t.timestamp())
            elif isinstance(t, (int, float)):
                stamps.append(float(t))
        if not stamps:
            return None if not entries else 0.0
        return max(0.0, time.time() - max(stamps))

    @_watched
    def remove(self, rel: str) -> None:
        try:
            if self.local:
                os.remove(self.path(rel))
            else:
                self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass

    @_watched
    def remove_tree(self, rel: str) -> None:
        path = self.path(rel)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        if not self.local:
            self.fs.invalidate_cache(path)


def makedirs(storage: Storage, rel: str) -> None:
    """``storage.makedirs`` that survives another process removing an empty parent meanwhile
    (fast-tier folders are removed while other ranks create theirs beside them)."""
    for _ in range(10):
        try:
            storage.makedirs(rel)
            return
        except FileNotFoundError:
            continue
    storage.makedirs(rel)


class RangeReader:
    """Byte ranges of one file, read into caller memory where the backend allows."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self.storage = storage
        self.path = storage.path(rel)
        storage.check_inside(self.path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY) if storage.local else None
        except FileNotFoundError:
            raise MissingFile(f"{self.path} is missing") from None

    @property
    def local(self) -> bool:
        """A local file: a load reads its fetches in groups of chunks (a store's: one request a fetch)."""
        return self.storage.local

    @_watched
    def read_into(self, offset: int, out: memoryview) -> None:
        n = out.nbytes
        if self._fd is not None:
            got = 0
            while got < n:
                k = os.preadv(self._fd, [out[got:]], offset + got)
                if k == 0:
                    raise TruncatedFile(f"{self.path} ends at byte {offset + got}, expected {offset + n}")
                got += k
                progress()
            return
        data = self._cat(offset, n)
        if len(data) != n:
            raise TruncatedFile(f"{self.path}: asked for {n} bytes at {offset}, got {len(data)}")
        out[:] = data

    @_watched
    def read_scatter(self, offset: int, outs: list[memoryview]) -> int:
        """Bytes from ``offset`` on, filling ``outs`` one after the other (one preadv per
        IOV_MAX buffers on a local file; one ranged GET elsewhere). Returns the bytes read:
        all of ``outs``."""
        total = 0
        for o in outs:
            total += o.nbytes
        if self._fd is None:
            data = memoryview(self._cat(offset, total))
            if data.nbytes != total:
                raise TruncatedFile(f"{self.path}: asked for {total} bytes at {offset}, got {data.nbytes}")
            pos = 0
            for o in outs:
                o[:] = data[pos : pos + o.nbytes]
                pos += o.nbytes
            return total
        if len(outs) <= IOV_MAX:
            got = os.preadv(self._fd, outs, offset)  # a local file's read is whole but for its end
            progress()
            if got == total:
                return total
        else:
            got = 0
        self._read_rest(offset, outs, got)
        return total

    def _read_rest(self, offset: int, outs: list[memoryview], got: int) -> None:
        """:meth:`read_scatter`'s ``outs`` from byte ``got`` of them on (a short read, or more
        buffers than one preadv takes)."""
        pending = [o for o in outs if o.nbytes]
        i, pos = 0, offset + got
        while True:
            while got:  # step past what was filled; a short read leaves a buffer partly filled
                n = pending[i].nbytes
                if got >= n:
                    got -= n
                    i += 1
                else:
                    pending[i] = pending[i][got:]
                    got = 0
            if i == len(pending):
                return
            batch = pending[i : i + IOV_MAX]
            got = os.preadv(self._fd, batch, pos)
            if got == 0:
                raise TruncatedFile(f"{self.path} ends at byte {pos}, expected {pos + sum(o.nbytes for o in batch)}")
            pos += got
            progress()

    def _cat(self, offset: int, n: int) -> bytes:
        try:
            return self.storage.fs.cat_file(self.path, start=offset, end=offset + n)
        except FileNotFoundError:
            raise MissingFile(f"{self.path} is missing") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
