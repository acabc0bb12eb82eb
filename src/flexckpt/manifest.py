"""The manifest: one JSON document per committed checkpoint, written last. Its presence
is the commit. Also the per-rank records the coordinator builds it from.

Version 2 holds O(tensors + ranks): each tensor's dtype, shape and layout,
the plan rules, and per rank one line (its chunk table's checksum and length, its data
file's stored length). Pieces, offsets and chunk boundaries are recomputed from those
(:mod:`flexckpt.plan`); chunk checksums and stored lengths live in each rank's table file
(:mod:`flexckpt.chunktable`), read only by the ranks that read that rank's data. Every
file of a save attempt sits in the attempt's own folder inside the step folder, so an
attempt never writes into a committed checkpoint's files. Version 1 (a list of every
piece and chunk) still loads.

A manifest read back is untrusted input: every name, path, dtype, shape, offset and
length is validated here, before anything is allocated or read, and no file name may
leave the checkpoint's folder. Version 3 adds mesh layouts; version 4 (written now) the
state's container tree (``tree``, checked by :func:`flexckpt.tree.check_tree`) and tagged
plain values (:mod:`flexckpt.plain`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

import numpy as np
import orjson
import torch

from flexckpt.checksum import ALGORITHM, checksum
from flexckpt.chunktable import MAX_TABLE_BYTES, ChunkTable, parse_table
from flexckpt.dtypes import dtype_from_name, dtype_name, itemsize
from flexckpt.errors import ManifestError
# the seal and the names live in flexckpt.jsondoc and flexckpt.names (imported from here too)
from flexckpt.jsondoc import SEAL_FIELD, fail, get_field, get_int, parse_json, seal, show, unseal
from flexckpt.names import (
    GROUP,
    MANIFEST,
    attempt_id,
    attempt_run_id,
    check_run_id,
    committed_name,
    data_name,
    failed_name,
    group_name,
    keyed_name,
    parse_step_dir,
    record_name,
    step_dir,
    table_name,
    values_name,
)
from flexckpt.plan import READ_RULES_VERSIONS, RULES_VERSION, PlanRules, WritePlan
from flexckpt.stall import bounded
from flexckpt.structure import TensorSpec
from flexckpt.tree import check_tree
from flexckpt.values import MAX_BYTES_VALUE
from flexshard import Box, FlatRange, Layout, MeshLayout, Part, layout_from_json
from flexshard.box import whole

FORMAT = "flexckpt"
RECORD_FORMAT = "flexckpt-record"
# 3: a tensor's layout may be a MeshLayout (pieces are n-D boxes); else as 2.
# 4: as 3, plus the state's container tree (``tree``, see flexckpt.tree) and plain values
#    with the tags of flexckpt.plain (dtype, device, path, enum, class, dataclass, dict)
VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
CODECS = ("none", "zstd")

MAX_MANIFEST_BYTES = 256 << 20  # parsing costs about 11 bytes of memory a byte
MAX_RECORD_BYTES = 1 << 28
MAX_CHUNK_BYTES = 1 << 30
MAX_NUMEL = 1 << 48
MAX_FILE_BYTES = 1 << 50
MAX_WORLD = 1 << 20
MAX_TIME = 253402300799  # 9999-12-31 23:59:59 UTC

_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX = re.compile(r"[0-9a-f]*")
MAX_CHUNKS_PER_FILE = 1 << 22
MAX_ZSTD_RATIO = 1 << 15  # a zstd block of 128 KiB of one byte value stores in 4 bytes


class RankEntry(NamedTuple):
    """What the manifest keeps of one rank: its table file's checksum and length, the
    stored length of its data file (0: no data file), and its per-rank values file's
    checksum and length ("" and 0: none)."""

    table_checksum: str
    table_nbytes: int
    stored_nbytes: int
    values_checksum: str = ""
    values_nbytes: int = 0


class StoredChunk(NamedTuple):
    """Raw bytes ``[raw_offset, raw_offset + raw_length)`` of a file's stream, stored at
    ``[offset, offset + length)`` of the file, compressed with ``codec``. (A named tuple:
    there are thousands per file, and JSON writes it as the list it is.)"""

    raw_offset: int
    raw_length: int
    offset: int
    length: int
    codec: str
    checksum: str


class FileEntry:
    """A data file: its raw stream's size and its chunks as columns, one row a chunk: raw
    byte offset and length, stored offset and length (int64), checksum (uint64), codec
    (uint8, an index into CODECS). A load plans and verifies over the columns (thousands of
    chunks a file: one object each was most of a warm load's planning); :attr:`chunks`, one
    :class:`StoredChunk` each, is built on first use for the callers that walk them one by
    one (verify, inspect)."""

    __slots__ = ("name", "nbytes", "raw_offsets", "raw_lengths", "offsets", "lengths", "checksums", "codec_ids",
                 "_chunks")

    def __init__(self, name: str, nbytes: int, chunks: "tuple[StoredChunk, ...]") -> None:
        self.name, self.nbytes = name, nbytes
        n = len(chunks)
        cols = [np.fromiter((c[k] for c in chunks), dtype=np.int64, count=n) for k in range(4)]
        self.raw_offsets, self.raw_lengths, self.offsets, self.lengths = cols
        self.codec_ids = np.fromiter((CODECS.index(c.codec) for c in chunks), dtype=np.uint8, count=n)
        self.checksums = np.fromiter((int(c.checksum or "0", 16) for c in chunks), dtype=np.uint64, count=n)
        self._chunks: tuple[StoredChunk, ...] | None = tuple(chunks)

    @classmethod
    def from_columns(cls, name: str, nbytes: int, raw_offsets: np.ndarray, raw_lengths: np.ndarray,
                     offsets: np.ndarray, lengths: np.ndarray, codec: str, checksums: np.ndarray) -> "FileEntry":
        """A file whose chunks all have ``codec`` (version 2: one codec a save)."""
        self = cls.__new__(cls)
        self.name, self.nbytes = name, nbytes
        self.raw_offsets, self.raw_lengths, self.offsets, self.lengths = (
            np.asarray(c, dtype=np.int64) for c in (raw_offsets, raw_lengths, offsets, lengths))
        self.codec_ids = np.full(len(self.offsets), CODECS.index(codec), dtype=np.uint8)
        self.checksums = np.asarray(checksums, dtype=np.uint64)
        self._chunks = None
        return self

    @property
    def chunks(self) -> "tuple[StoredChunk, ...]":
        if self._chunks is None:
            self._chunks = tuple(map(StoredChunk, self.raw_offsets.tolist(), self.raw_lengths.tolist(),
                                     self.offsets.tolist(), self.lengths.tolist(),
                                     [CODECS[c] for c in self.codec_ids.tolist()],
                                     map("{:016x}".format, self.checksums.tolist())))
        return self._chunks

    def __len__(self) -> int:
        return len(self.offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileEntry):
            return NotImplemented
        return (self.name, self.nbytes) == (other.name, other.nbytes) and all(
            np.array_equal(getattr(self, k), getattr(other, k))
            for k in ("raw_offsets", "raw_lengths", "offsets", "lengths", "checksums", "codec_ids"))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FileEntry({self.name!r}, {self.nbytes}, {len(self)} chunks)"


class SavedPiece(NamedTuple):
    """Elements ``[start, stop)`` of ``box`` (row-major in the box; None: the whole tensor)
    of a tensor, stored contiguously at raw byte ``raw_offset`` of ``file``. (A named tuple:
    a load recomputes one a piece it reads.)"""

    file: str
    start: int
    stop: int
    raw_offset: int
    box: Box | None = None


@dataclass(frozen=True)
class SavedTensor:
    """A saved tensor. Version 1 lists its ``pieces``; version 2 recomputes them from the
    plan (``source``) for just the range a reader wants: :meth:`pieces_in`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout
    pieces: tuple[SavedPiece, ...] | None = None
    source: "PlanPieces | None" = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def pieces_in(self, want: FlatRange | Part) -> list[SavedPiece]:
        """Saved pieces that may hold elements of ``want`` (a part of the tensor, or a flat
        range of it; for version 1: all of them)."""
        if self.pieces is not None:
            return list(self.pieces)
        assert self.source is not None
        return self.source.pieces_in(self.name, want)

    def all_pieces(self) -> list[SavedPiece]:
        return self.pieces_in(Part(whole(self.shape), 0, self.numel))

    def to_json(self) -> dict:
        """The tensor's entry in a version-2 (and later) manifest: its pieces follow from the plan."""
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape), "layout": self.layout.to_json()}


class PlanPieces:
    """Version 2: a tensor's saved pieces, recomputed from the write plan in closed form
    (only the writers of the wanted range, and only their offsets)."""

    def __init__(self, plan: WritePlan, attempt: str) -> None:
        self.plan = plan
        self.attempt = attempt
        self.index = {s.name: i for i, s in enumerate(plan.specs)}
        self._files: dict[int, str] = {}

    def offset(self, rank: int, spec_index: int) -> int:
        # pieces only: cutting chunks waits for the table that vouches for the sizes
        return self.plan.offsets(rank)[spec_index]

    def pieces_in(self, name: str, want: FlatRange | Part) -> list[SavedPiece]:
        i = self.index[name]
        plan = self.plan
        shape = plan.specs[i].shape
        return [
            SavedPiece(self._file(r), part.start, part.stop, plan.offsets(r)[i], None if part.box.sizes == shape else part.box)
            for r, part in plan.writers(i, want)
        ]

    def flat_pieces(self, name: str, lo: int, hi: int) -> list[tuple[str, int, int, int]] | None:
        """:meth:`pieces_in` of the flat range ``[lo, hi)`` (not empty) of a flat-layout
        tensor, as ``(file, start, stop, raw_offset)`` tuples (each a flat range of the whole
        tensor); None for a mesh layout, whose pieces are boxes."""
        i = self.index[name]
        plan = self.plan
        if plan._geometry[i].kind == "mesh":
            return None
        files, offsets = self._files, plan.offsets
        return [(files.get(r) or self._file(r), a, b, offsets(r)[i]) for r, a, b in plan.flat_spans(i, lo, hi)]

    def _file(self, rank: int) -> str:
        name = self._files.get(rank)
        if name is None:
            name = self._files[rank] = data_name(self.attempt, rank)
        return name


class TableFiles(Mapping):
    """Version 2's ``manifest.files``: the data files by name, each read on first use from
    its rank's table file (verified against the manifest), never all at once."""

    def __init__(self, plan: WritePlan, attempt: str, codec: str, ranks: tuple[RankEntry, ...]) -> None:
        self.plan = plan
        self.attempt = attempt
        self.codec = codec
        self.ranks = ranks
        self._names = {data_name(attempt, r): r for r, e in enumerate(ranks) if e.stored_nbytes}
        self._entries: dict[int, FileEntry] = {}
        self._tables: dict[int, ChunkTable] = {}
        self._lock = threading.Lock()
        self.storage: Any = None  # bound by commit.read_manifest
        self.folder = ""
        self.bytes_read = 0  # metadata read through this mapping (table files)

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
        with self._lock:
            self.bytes_read += len(data)
        return data

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
        bounds = np.fromiter(itertools.chain.from_iterable(raw.chunks), dtype=np.int64, count=2 * len(raw.chunks))
        raw_offsets, raw_lengths = bounds[0::2], bounds[1::2]  # (offset, length) a chunk
        stored = lengths.astype(np.int64)  # each at most MAX_CHUNK_BYTES: checked
        if self.codec == "none" and (stored != raw_lengths).any():
            bad = int(np.flatnonzero(stored != raw_lengths)[0])
            raise ManifestError(f"{where}: uncompressed chunk at {int(raw_offsets[bad])} stores {int(stored[bad])} bytes "
                                f"for {int(raw_lengths[bad])}")
        stored_at = np.concatenate(([0], np.cumsum(stored)[:-1])) if len(stored) else stored
        return FileEntry.from_columns(name, raw.nbytes, raw_offsets, raw_lengths, stored_at, stored, self.codec,
                                      table.checksums)


@dataclass(frozen=True)
class Manifest:
    step: int
    run_id: str
    world_size: int
    time: float
    fingerprint: str
    files: dict[str, FileEntry]
    tensors: dict[str, SavedTensor]
    plain: dict[str, Any]  # encoded plain values (see structure.encode_plain)
    lanes: dict[str, dict[str, Any]]
    per_rank: dict[str, list[Any]]  # version 1: every rank's value; version 2: keys only (values None)
    version: int = 1
    attempt: str | None = None
    rules: PlanRules | None = None
    codec: str = "none"
    ranks: tuple[RankEntry, ...] = ()
    sealed: bool = False  # read back with a verified manifest checksum (False: written without one)
    keyed: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # bytes values: offset, length, xxh3-64
    tree: Any = None  # version 4: the state's container tree (flexckpt.tree); None: not recorded

    def rank_values(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s per-rank values (version 2: read from its table file)."""
        if self.version == 1:
            return {k: v[rank] for k, v in self.per_rank.items()}
        assert isinstance(self.files, TableFiles)
        return self.files.rank_values(rank)

    @property
    def metadata_bytes_read(self) -> int:
        """Bytes of table files read so far (version 2), besides the manifest itself."""
        return self.files.bytes_read if isinstance(self.files, TableFiles) else 0

    def to_bytes(self) -> bytes:
        return seal(self._body())

    def _body(self) -> bytes:
        if self.version >= 2:
            return orjson.dumps({
                "format": FORMAT,
                "version": self.version,
                "checksum": ALGORITHM,
                "step": self.step,
                "run_id": self.run_id,
                "attempt": self.attempt,
                "world_size": self.world_size,
                "time": self.time,
                "fingerprint": self.fingerprint,
                "rules": self.rules.to_json() if self.rules else None,
                "codec": self.codec,
                "tensors": {name: t.to_json() for name, t in self.tensors.items()},
                "ranks": [list(e) for e in self.ranks],
                "plain": self.plain,
                "lanes": self.lanes,
                "per_rank": sorted(self.per_rank),
                **({"keyed": {k: list(v) for k, v in self.keyed.items()}} if self.keyed else {}),
                **({"tree": self.tree} if self.tree is not None and self.version >= 4 else {}),
            })
        raise ValueError(f"step {self.step}: a version-1 manifest is read, never written (flexckpt writes version "
                         f"{VERSION}); build the manifest with flexckpt.commit.build_manifest")

    @property
    def total_bytes(self) -> int:
        """Raw bytes saved (version 2: the tensors' bytes, without the streams' padding)."""
        if self.version >= 2:
            return sum(t.numel * itemsize(t.dtype) for t in self.tensors.values())
        return sum(f.nbytes for f in self.files.values())

    @property
    def stored_bytes(self) -> int:
        if self.version >= 2:
            return sum(e.stored_nbytes for e in self.ranks)
        return sum(c.length for f in self.files.values() for c in f.chunks)




def parse_manifest(data: bytes, where: str = "manifest") -> Manifest:
    """A manifest read back: its checksum (if it has one) verified, then every field."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise fail(where, f"{len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    body, sealed = unseal(data, where)
    manifest = _parse_document(body, where)
    if not sealed and manifest.version >= 3:  # v3 came with the checksum: one without it was stripped
        raise fail(where, f"a version-{manifest.version} manifest must begin with its {SEAL_FIELD}, and this one has "
                           f"none: it was edited or damaged")
    return dataclasses.replace(manifest, sealed=True) if sealed else manifest


def _parse_document(data: bytes, where: str) -> Manifest:
    doc = parse_json(data, where)
    if SEAL_FIELD in doc:
        raise fail(where, f"{SEAL_FIELD} is not the document's first field (the manifest was rewritten)")
    if doc.get("format") != FORMAT:
        raise fail(where, f"format is {show(doc.get('format'))}, expected {show(FORMAT)}")
    version = doc.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise fail(where, f"version {show(version)} is not supported (this flexckpt reads {list(READ_VERSIONS)})")
    if doc.get("checksum") != ALGORITHM:
        raise fail(where, f"checksum algorithm {show(doc.get('checksum'))} is not supported (expected {ALGORITHM})")
    step = get_int(doc.get("step"), 0, 10**12 - 1, "step", where)
    try:
        run_id = check_run_id(doc.get("run_id"))
    except ValueError as e:
        raise fail(where, str(e)) from None
    world = get_int(doc.get("world_size"), 1, MAX_WORLD, "world_size", where)
    wall = get_field(doc, "time", (int, float), where)
    if not 0 <= wall <= MAX_TIME:  # NaN fails too
        raise fail(where, f"time {show(wall)} is not seconds since 1970 before the year 10000")
    fp = get_field(doc, "fingerprint", str, where)
    if version >= 2:
        return _parse_v2(doc, step, run_id, world, float(wall), fp, where, version)
    files = {name: _parse_file(name, entry, where) for name, entry in get_field(doc, "files", dict, where).items()}
    tensors = {
        name: _parse_tensor(name, entry, files, where) for name, entry in get_field(doc, "tensors", dict, where).items()
    }
    plain = get_field(doc, "plain", dict, where)
    lanes = get_field(doc, "lanes", dict, where)
    for path, mapping in lanes.items():
        if not isinstance(mapping, dict):
            raise fail(where, f"lanes of {show(path)} must be an object keyed by lane")
    per_rank = get_field(doc, "per_rank", dict, where)
    for path, values in per_rank.items():
        if not isinstance(values, list) or len(values) != world:
            raise fail(where, f"per-rank values of {show(path)} must be a list of {world} entries")
    return Manifest(step, run_id, world, float(wall), fp, files, tensors, plain, lanes, per_rank)


def _parse_values(doc: dict, where: str) -> tuple[dict, dict]:
    plain = get_field(doc, "plain", dict, where)
    lanes = get_field(doc, "lanes", dict, where)
    for path, mapping in lanes.items():
        if not isinstance(mapping, dict):
            raise fail(where, f"lanes of {show(path)} must be an object keyed by lane")
    return plain, lanes


def _parse_rules(raw: Any, where: str, version: int) -> PlanRules:
    rules_version = (raw.get("version") if isinstance(raw, dict) and raw.get("version") in (3, RULES_VERSION)
                     else RULES_VERSION) if version >= 3 else 2
    if not isinstance(raw, dict) or raw.get("version") != rules_version or rules_version not in READ_RULES_VERSIONS:
        raise fail(where, f"plan rules {show(raw)} are not version {rules_version} (the rules this flexckpt computes "
                           f"for a version-{version} manifest)")
    if set(raw) != {"version", "align", "chunk_bytes", "min_chunk", "chunks_per_piece", "hybrid_part_bytes"}:
        raise fail(where, f"plan rules have fields {sorted(raw)}")
    align = get_int(raw["align"], 1, 4096, "rules align", where)
    if align & (align - 1):
        raise fail(where, f"rules align {align} is not a power of two")
    chunk = get_int(raw["chunk_bytes"], align, MAX_CHUNK_BYTES, "rules chunk_bytes", where)
    min_chunk = get_int(raw["min_chunk"], align, MAX_CHUNK_BYTES, "rules min_chunk", where)
    per_piece = get_int(raw["chunks_per_piece"], 1, 1 << 16, "rules chunks_per_piece", where)
    part = get_int(raw["hybrid_part_bytes"], align, MAX_CHUNK_BYTES, "rules hybrid_part_bytes", where)
    return PlanRules(chunk, rules_version, align, min_chunk, per_piece, part)


def _parse_v2(doc: dict, step: int, run_id: str, world: int, wall: float, fp: str, where: str, version: int) -> Manifest:
    attempt = get_field(doc, "attempt", str, where)
    if attempt_run_id(attempt) != run_id:
        raise fail(where, f"attempt {show(attempt[:80])} is not an attempt of run {show(run_id)}")
    rules = _parse_rules(doc.get("rules"), where, version)
    codec = doc.get("codec")
    if codec not in CODECS:
        raise fail(where, f"codec {show(codec)} is not one of {CODECS}")
    fields = []  # (name, dtype, shape, layout) a tensor: the plan's key, TensorSpecs only for a new plan
    for name, entry in get_field(doc, "tensors", dict, where).items():
        dtype, shape, layout = _tensor_fields(name, entry, where)
        if entry.keys() != _V2_TENSOR_FIELDS:
            raise fail(where, f"tensor {show(name)} has fields {sorted(entry)}, expected dtype, shape and layout")
        if version < 3 and isinstance(layout, MeshLayout):
            raise fail(where, f"tensor {show(name)} has a mesh layout, which a version-{version} manifest cannot hold")
        fields.append((name, dtype, shape, layout))
    try:
        plan = _write_plan(fields, world, rules)
    except (ValueError, OverflowError) as e:  # OverflowError: sizes past int64 (a block of 2**62)
        raise fail(where, str(e) or type(e).__name__) from None
    raw_ranks = get_field(doc, "ranks", list, where)
    if len(raw_ranks) != world:
        raise fail(where, f"ranks lists {len(raw_ranks)} entries for a world of {world}")
    ranks = []
    for r, e in enumerate(raw_ranks):
        ok = (
            type(e) is list and len(e) == 5 and type(e[0]) is str and _HEX16.fullmatch(e[0]) is not None
            and type(e[1]) is int and 0 < e[1] <= MAX_TABLE_BYTES and type(e[2]) is int and 0 <= e[2] <= MAX_FILE_BYTES
            and type(e[3]) is str and type(e[4]) is int and 0 <= e[4] <= MAX_TABLE_BYTES
            and (_HEX16.fullmatch(e[3]) is not None if e[4] else e[3] == "")
        )
        if not ok:
            raise fail(where, f"rank {r} entry must be [table checksum (16 hex), table bytes, stored bytes, values "
                               f"checksum, values bytes], got {show(e)}")
        ranks.append(RankEntry(*e))
    ranks_t = tuple(ranks)
    source = PlanPieces(plan, attempt)
    tensors = {s.name: _saved_tensor(s, source) for s in plan.specs}
    plain, lanes = _parse_values(doc, where)
    keys = get_field(doc, "per_rank", list, where)
    if not all(isinstance(k, str) for k in keys):
        raise fail(where, "per_rank must list value names")
    files = TableFiles(plan, attempt, codec, ranks_t)
    keyed = _parse_keyed(doc.get("keyed", {}), where)
    tree = doc.get("tree") if version >= 4 else None
    if tree is not None:
        check_tree(tree, where)
    return Manifest(step, run_id, world, wall, fp, files, tensors, plain, lanes, {k: None for k in keys},
                    version, attempt, rules, codec, ranks_t, keyed=keyed, tree=tree)


_PLANS: dict[tuple, WritePlan] = {}  # the newest few, oldest first
_PLANS_KEPT = 2
_plans_lock = threading.Lock()


def _write_plan(fields: list[tuple], world: int, rules: PlanRules) -> WritePlan:
    """The plan of a structure (``(name, dtype, shape, layout)`` a tensor) at a world size
    under the rules: a pure function of the three, which caches each rank's pieces and
    chunks as they are asked for. Manifests of one structure (each step a job saves, each
    load of it) share one, so a repeated load plans once."""
    key = (tuple(fields), world, rules)
    with _plans_lock:
        plan = _PLANS.pop(key, None)
        if plan is not None:
            _PLANS[key] = plan  # now the newest
            return plan
    plan = WritePlan([TensorSpec(*f) for f in fields], world, rules)
    with _plans_lock:
        _PLANS[key] = plan
        while len(_PLANS) > _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
    return plan


def _parse_keyed(raw: Any, where: str) -> dict[str, tuple[int, int, str]]:
    """The index of the bytes values file: each key's ``[offset, length, checksum]``; the
    values must lie one after the other from byte 0, each at most MAX_BYTES_VALUE."""
    if not isinstance(raw, dict):
        raise fail(where, "keyed must be an object of bytes values by key")
    out = {}
    for key, e in raw.items():
        ok = (
            0 < len(key) <= 4096 and type(e) is list and len(e) == 3 and type(e[0]) is int and type(e[1]) is int
            and 0 <= e[0] <= MAX_FILE_BYTES and 0 <= e[1] <= MAX_BYTES_VALUE
            and type(e[2]) is str and _HEX16.fullmatch(e[2]) is not None
        )
        if not ok:
            raise fail(where, f"bytes value {show(key)} must be [offset, length (at most {MAX_BYTES_VALUE}), "
                               f"checksum (16 hex)], got {show(e)}")
        out[key] = (e[0], e[1], e[2])
    pos = 0
    for key, (offset, length, _) in sorted(out.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if offset != pos:
            raise fail(where, f"bytes value {show(key)} starts at byte {offset}, not {pos} where the one before ends")
        pos += length
    return out


def _parse_file(name: str, entry: Any, where: str) -> FileEntry:
    if not _FILE_NAME.match(name) or ".." in name:
        raise fail(where, f"file name {show(name)} is not a plain file name inside the checkpoint folder")
    if not isinstance(entry, dict):
        raise fail(where, f"file {show(name)} must be an object")
    nbytes = get_int(entry.get("nbytes"), 0, MAX_FILE_BYTES, f"file {show(name)} nbytes", where)
    raw_chunks = entry.get("chunks")
    if not isinstance(raw_chunks, list):
        raise fail(where, f"file {show(name)} chunks must be a list")
    chunks = []
    checks = []
    raw_pos = pos = 0
    for i, c in enumerate(raw_chunks):  # thousands per file: one tight loop, one error path
        ok = type(c) is list and len(c) == 6
        if ok:
            raw_offset, raw_length, offset, length, codec, check = c
            ok = (
                type(raw_offset) is int and type(raw_length) is int and type(offset) is int and type(length) is int
                and raw_offset == raw_pos and offset == pos
                and 0 < raw_length <= MAX_CHUNK_BYTES and 0 <= length <= MAX_CHUNK_BYTES
                and codec in CODECS and (codec != "none" or length == raw_length)
                and type(check) is str and len(check) == 16
            )
        if not ok:
            _explain_bad_chunk(name, i, c, raw_pos, pos, where)
        raw_pos += raw_length
        pos += length
        checks.append(check)
        chunks.append(StoredChunk(raw_offset, raw_length, offset, length, codec, check))
    if checks and not _HEX.fullmatch("".join(checks)):
        bad = next(c for c in checks if not _HEX16.match(c))
        raise fail(where, f"file {show(name)}: checksum {show(bad)} is not 16 hex digits")
    if raw_pos != nbytes:
        raise fail(where, f"file {show(name)} chunks cover {raw_pos} bytes, not its {nbytes}")
    return FileEntry(name, nbytes, tuple(chunks))


def _explain_bad_chunk(name: str, i: int, c: Any, raw_pos: int, pos: int, where: str) -> None:
    what = f"file {show(name)} chunk {i}"
    if not isinstance(c, list) or len(c) != 6:
        raise fail(where, f"{what} must be [raw_offset, raw_length, offset, length, codec, checksum]")
    raw_offset, raw_length, offset, length, codec, check = c
    get_int(raw_offset, 0, MAX_FILE_BYTES, f"{what} raw_offset", where)
    get_int(raw_length, 1, MAX_CHUNK_BYTES, f"{what} raw_length", where)
    get_int(offset, 0, MAX_FILE_BYTES, f"{what} offset", where)
    get_int(length, 0, MAX_CHUNK_BYTES, f"{what} length", where)
    if codec not in CODECS:
        raise fail(where, f"{what} codec {show(codec)} is not one of {CODECS}")
    if not isinstance(check, str) or not _HEX16.match(check):
        raise fail(where, f"{what} checksum {show(check)} is not 16 hex digits")
    if raw_offset != raw_pos or offset != pos:
        raise fail(where, f"{what} does not follow the previous chunk (gap or overlap)")
    raise fail(where, f"{what} is uncompressed but stores {length} bytes for {raw_length}")


_V2_TENSOR_FIELDS = frozenset(("dtype", "shape", "layout"))
_INT_ONLY = frozenset((int,))
_new = object.__new__


def _saved_tensor(spec: TensorSpec, source: PlanPieces) -> SavedTensor:
    """``SavedTensor(spec.name, spec.dtype, spec.shape, spec.layout, None, source)``,
    built without the frozen dataclass's per-field ``__setattr__`` (a load builds one a
    tensor, and that was a fifth of reading a manifest)."""
    t = _new(SavedTensor)
    t.__dict__.update(name=spec.name, dtype=spec.dtype, shape=spec.shape, layout=spec.layout, pieces=None,
                      source=source)
    return t


def _tensor_fields(name: str, entry: Any, where: str) -> tuple[torch.dtype, tuple[int, ...], Layout]:
    """A tensor's dtype, shape and layout, validated (of any version)."""
    if not name or len(name) > 4096:
        raise fail(where, f"tensor name {show(name[:80])} is empty or too long")
    if not isinstance(entry, dict):
        raise fail(where, f"tensor {show(name)} must be an object")
    try:
        dtype = dtype_from_name(entry.get("dtype"))
        layout = layout_from_json(entry.get("layout"))
    except (ValueError, TypeError, RecursionError) as e:
        raise fail(where, f"tensor {show(name)}: {str(e)[:200]}") from None
    shape_raw = entry.get("shape")
    if not isinstance(shape_raw, list) or len(shape_raw) > 64:
        raise fail(where, f"tensor {show(name)} shape must be a list of at most 64 ints")
    # every dimension exactly an int in [0, MAX_NUMEL], checked in C; the message only on failure
    if shape_raw and not (_INT_ONLY.issuperset(map(type, shape_raw)) and min(shape_raw) >= 0 and max(shape_raw) <= MAX_NUMEL):
        shape = tuple(get_int(s, 0, MAX_NUMEL, f"tensor {show(name)} dimension", where) for s in shape_raw)
    shape = tuple(shape_raw)
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise fail(where, f"tensor {show(name)} has {numel} elements, more than {MAX_NUMEL}")
    return dtype, shape, layout


def _parse_tensor(name: str, entry: Any, files: dict[str, FileEntry], where: str) -> SavedTensor:
    """A version-1 tensor: its fields and its list of pieces, which must tile it."""
    dtype, shape, layout = _tensor_fields(name, entry, where)
    numel = math.prod(shape)
    size = itemsize(dtype)
    pieces_raw = entry.get("pieces")
    if not isinstance(pieces_raw, list):
        raise fail(where, f"tensor {show(name)} pieces must be a list")
    saved = []
    for i, p in enumerate(pieces_raw):
        what = f"tensor {show(name)} piece {i}"
        if not isinstance(p, list) or len(p) != 4:
            raise fail(where, f"{what} must be [file, start, stop, raw_offset]")
        file = p[0]
        if type(file) is not str or file not in files:
            raise fail(where, f"{what} names file {show(file)}, which the manifest does not list")
        start = get_int(p[1], 0, numel, f"{what} start", where)
        stop = get_int(p[2], start, numel, f"{what} stop", where)
        raw_offset = get_int(p[3], 0, MAX_FILE_BYTES, f"{what} raw_offset", where)
        if raw_offset + (stop - start) * size > files[file].nbytes:
            raise fail(where, f"{what} ends past the end of {show(file)}")
        saved.append(SavedPiece(file, start, stop, raw_offset))
    # every element saved exactly once: the non-empty pieces, by start, tile [0, numel)
    pos, tiled = 0, True
    for p in sorted((p for p in saved if p.stop > p.start), key=lambda p: p.start):
        tiled = tiled and p.start == pos
        pos = p.stop if tiled else pos
    if not tiled or pos != numel:
        raise fail(where, f"tensor {show(name)} pieces do not cover its {numel} elements exactly once "
                           f"(a gap or an overlap at element {pos})")
    return SavedTensor(name, dtype, shape, layout, tuple(saved))


def parse_record(data: bytes, where: str) -> dict:
    """A per-rank record (or a group's records gathered by its leader): checked for shape
    here; its meaning is checked by the coordinator."""
    if len(data) > MAX_RECORD_BYTES:
        raise fail(where, f"{len(data)} bytes, more than the {MAX_RECORD_BYTES} allowed")
    doc = parse_json(data, where)
    if doc.get("format") != RECORD_FORMAT or doc.get("version") != VERSION:
        raise fail(where, f"not a version-{VERSION} flexckpt record")
    for key, kind in (("run_id", str), ("attempt", str), ("ranks", dict), ("lanes", dict), ("keyed", dict)):
        get_field(doc, key, kind, where)
    for key in ("step", "world_size"):
        get_int(doc.get(key), 0, MAX_FILE_BYTES, key, where)
    return doc
