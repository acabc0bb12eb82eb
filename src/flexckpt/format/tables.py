"""The chunk tables: the only metadata I/O besides the manifest's own document.

Version 2's (and later) ``manifest.files`` (:class:`TableFiles`, a
:class:`~flexckpt.format.manifest.DataFiles`): each rank's chunk table (:mod:`flexckpt.format.chunktable`),
read from storage on first use and verified against the manifest's line for that rank,
and turned into that rank's data file's :class:`~flexckpt.format.manifest.FileEntry`; and each
rank's per-rank values file. :func:`file_entries` reads the entries a read plan needs, so
that the planner (:mod:`flexckpt.load.read_plan`) is given them and does no I/O itself."""
from __future__ import annotations

import math
import threading
from typing import Any, Iterable, Iterator

import numpy as np

from flexckpt.errors import ManifestError
from flexckpt.format.checksum import checksum
from flexckpt.format.chunktable import ChunkTable, parse_table
from flexckpt.format.jsondoc import show
from flexckpt.format.manifest import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKS_PER_FILE,
    MAX_ZSTD_RATIO,
    DataFiles,
    FileEntry,
    Manifest,
    RankEntry,
)
from flexckpt.format.names import data_name, table_name, values_name
from flexckpt.format.write_plan import WritePlan
from flexckpt.state.dtypes import itemsize
from flexckpt.storage_stall import bounded


def file_entries(manifest: Manifest, files: Iterable[str]) -> dict[str, FileEntry]:
    """The chunk entries of the data files ``files`` (names as the manifest gives them):
    for version 2 and later, each from its rank's chunk table, read and verified now unless
    read before; for version 1, as listed. Raises ``ManifestError`` for a file the manifest
    does not list, or a table that is damaged or belongs to another save."""
    return manifest.files.entries(files)


class TableFiles(DataFiles):
    """Version 2's (and later) ``manifest.files``: the data files by name, each read on
    first use from its rank's table file (verified against the manifest), never all at once."""

    def __init__(self, plan: WritePlan, attempt: str, codec: str, ranks: tuple[RankEntry, ...]) -> None:
        self.plan = plan
        self.attempt = attempt
        self.codec = codec
        self.ranks = ranks
        self._names = {data_name(attempt, r): r for r, e in enumerate(ranks) if e.stored_nbytes}
        self._entries: dict[int, FileEntry] = {}
        self._tables: dict[int, ChunkTable] = {}
        self._lock = threading.Lock()
        self.storage: Any = None  # bound by catalog.read_manifest
        self.folder = ""
        self.bytes_read = 0  # metadata read through this mapping (table and values files)
        self.peer_bytes_read = 0  # the part of it received from peers (a fast tier's recovery)

    def bind(self, storage: Any, folder: str) -> None:
        self.storage, self.folder = storage, folder

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> FileEntry:
        rank = self._names.get(name)
        if rank is None:
            raise ManifestError(f"the plan reads {show(name)}, but the manifest lists no data stored for that rank")
        with self._lock:
            entry = self._entries.get(rank)
        if entry is None:
            entry = self._file_entry(rank, self.table(rank))
            with self._lock:
                self._entries[rank] = entry
        return entry

    def entries(self, names: Iterable[str]) -> dict[str, FileEntry]:
        """As ``DataFiles.entries``; the tables not read yet are read under one stall watch
        (one hand-off to a helper thread for them all, not one a table)."""
        names = list(names)
        with self._lock:
            unread = any(self._names.get(n) not in self._entries for n in names)
        if not unread or self.storage is None:
            return super().entries(names)
        return bounded(self.storage.stall_timeout, f"reading {len(names)} chunk tables on {self.storage.url}",
                       lambda: super(TableFiles, self).entries(names))

    def table(self, rank: int) -> ChunkTable:
        """Rank ``rank``'s table file, read and verified once."""
        with self._lock:
            table = self._tables.get(rank)
        if table is not None:
            return table
        if self.storage is None:
            raise ManifestError("this version-2 manifest is not bound to its storage; read it with read_manifest")
        # its storage calls (the table, the data file's size) under one watch: on one helper
        # thread, one hand-off, not one each
        return bounded(self.storage.stall_timeout, f"reading the chunk table of rank {rank} on {self.storage.url}",
                       lambda: self._read_table(rank))

    def _read_table(self, rank: int) -> ChunkTable:
        e = self.ranks[rank]
        rel = f"{self.folder}/{table_name(self.attempt, rank)}"
        data = self._read_verified(rel, e.table_nbytes, e.table_checksum, "chunk table")
        # the work of cutting the stream into chunks is bounded by sizes the manifest and
        # the table vouch for: the stream's length by the stored length (equal, or at most
        # zstd's best ratio), the chunk count by the table's length
        _pieces, raw_nbytes = self.plan.rank_pieces(rank)
        stored = e.stored_nbytes
        if (raw_nbytes != stored) if self.codec == "none" else (raw_nbytes > MAX_ZSTD_RATIO * stored or (stored and not raw_nbytes)):
            raise ManifestError(f"chunk table {rel}: the plan gives rank {rank} a stream of {raw_nbytes} bytes, which "
                                f"{stored} bytes stored with codec {self.codec} cannot hold")
        if raw_nbytes // min(self.plan.rules.min_chunk, self.plan.chunk_bytes) > MAX_CHUNKS_PER_FILE:
            raise ManifestError(f"chunk table {rel}: rank {rank}'s stream of {raw_nbytes} bytes needs too many chunks")
        if stored:
            size = self.storage.size(f"{self.folder}/{data_name(self.attempt, rank)}")
            if size != stored:
                raise ManifestError(f"data file {self.folder}/{data_name(self.attempt, rank)} is {size} bytes, the "
                                    f"manifest says {stored}; the file is damaged")
        raw = self.plan.rank_plan(rank)
        table = parse_table(data, rel, rank=rank, attempt=self.attempt, chunks=len(raw.chunks))
        with self._lock:
            self._tables[rank] = table
        return table

    def _read_verified(self, rel: str, nbytes: int, want: str, what: str) -> bytes:
        """A small metadata file, checked against the length and checksum the manifest holds."""
        if self.storage is None:
            raise ManifestError("this version-2 manifest is not bound to its storage; read it with read_manifest")
        data = self.storage.read_bytes(rel, limit=nbytes)
        got = checksum(data)
        if len(data) != nbytes or got != want:
            raise ManifestError(
                f"{what} {rel}: {len(data)} bytes with checksum {got}, the manifest says {nbytes} bytes with {want}; "
                f"it is damaged or belongs to another save"
            )
        peer = self.storage.from_peer(rel)
        with self._lock:
            self.bytes_read += len(data)
            self.peer_bytes_read += len(data) if peer else 0
        return data

    @property
    def raw_bytes(self) -> int:
        """The tensors' bytes, without the streams' padding."""
        return sum(math.prod(s.shape) * itemsize(s.dtype) for s in self.plan.specs)

    @property
    def stored_bytes(self) -> int:
        return sum(e.stored_nbytes for e in self.ranks)

    def rank_values(self, rank: int) -> dict:
        """Rank ``rank``'s per-rank values file, verified against the manifest."""
        e = self.ranks[rank]
        if not e.values_nbytes:
            return {}
        rel = f"{self.folder}/{values_name(self.attempt, rank)}"
        data = self._read_verified(rel, e.values_nbytes, e.values_checksum, "per-rank values")
        return ChunkTable(rank, self.codec, self.attempt, None, None, data).per_rank_values(rel)  # type: ignore[arg-type]

    def _file_entry(self, rank: int, table: ChunkTable) -> FileEntry:
        raw = self.plan.rank_plan(rank)
        name = data_name(self.attempt, rank)
        where = f"chunk table of rank {rank}"
        if table.codec != self.codec:
            raise ManifestError(f"{where}: codec {table.codec!r}, the manifest says {self.codec!r}")
        lengths = table.stored_lengths
        if (lengths > MAX_CHUNK_BYTES).any() or int(lengths.sum(dtype=np.uint64)) != self.ranks[rank].stored_nbytes:
            raise ManifestError(f"{where}: chunk lengths do not add up to the {self.ranks[rank].stored_nbytes} bytes stored")
        raw_offsets, raw_lengths = self.plan.chunk_columns(rank)
        stored = lengths.astype(np.int64)  # each at most MAX_CHUNK_BYTES: checked
        if self.codec == "none" and (stored != raw_lengths).any():
            bad = int(np.flatnonzero(stored != raw_lengths)[0])
            raise ManifestError(f"{where}: uncompressed chunk at {int(raw_offsets[bad])} stores {int(stored[bad])} bytes "
                                f"for {int(raw_lengths[bad])}")
        stored_at = np.concatenate(([0], np.cumsum(stored)[:-1])) if len(stored) else stored
        return FileEntry.from_columns(name, raw.nbytes, raw_offsets, raw_lengths, stored_at, stored, self.codec,
                                      table.checksums)

