"""The manifest's data model: one JSON document per committed checkpoint, written last. Its
presence is the commit. Also the limits that bound a checkpoint read back.

Version 2 holds O(tensors + ranks): each tensor's dtype, shape and layout,
the plan rules, and per rank one line (its chunk table's checksum and length, its data
file's stored length). Pieces, offsets and chunk boundaries are recomputed from those
(:mod:`flexckpt.format.write_plan`, :class:`PlanPieces`); chunk checksums and stored lengths live in
each rank's table file (:mod:`flexckpt.format.chunktable`), read only by the ranks that read that
rank's data (:mod:`flexckpt.format.tables`). Version 1 (a list of every piece and chunk) still
loads. Version 3 adds mesh layouts; version 4 (written now) the state's container tree
(``tree``, checked by :func:`flexckpt.state.tree.check_tree`) and tagged plain values
(:mod:`flexckpt.state.plain`).

The format's other ideas have their own modules: :mod:`flexckpt.format.names` (folder and file
names), :mod:`flexckpt.format.jsondoc` (checked JSON fields, the seal), :mod:`flexckpt.format.tables`
(the chunk tables), :mod:`flexckpt.format.manifest_parse` (reading a manifest or record back).
Import their names from those modules.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import orjson
import torch

from flexckpt.format.checksum import ALGORITHM
from flexckpt.format.jsondoc import seal
from flexckpt.format.names import data_name
from flexckpt.format.write_plan import PlanRules, WritePlan
from flexckpt.state.dtypes import dtype_name
from flexshard import Box, FlatRange, Layout, Part
from flexshard.box import whole

__all__ = [
    # the model
    "CODECS", "FORMAT", "MAX_CHUNK_BYTES", "MAX_CHUNKS_PER_FILE", "MAX_FILE_BYTES", "MAX_MANIFEST_BYTES", "MAX_NUMEL",
    "MAX_RECORD_BYTES", "MAX_TIME", "MAX_WORLD", "MAX_ZSTD_RATIO", "READ_VERSIONS", "RECORD_FORMAT", "VERSION",
    "DataFiles", "FileEntry", "ListedFiles", "Manifest", "PlanPieces", "RankEntry", "SavedPiece", "SavedTensor", "StoredChunk",
]

FORMAT = "flexckpt"
RECORD_FORMAT = "flexckpt-record"
# 3: a tensor's layout may be a MeshLayout (pieces are n-D boxes); else as 2.
# 4: as 3, plus the state's container tree (``tree``, see flexckpt.state.tree) and plain values
#    with the tags of flexckpt.state.plain (dtype, device, path, enum, class, dataclass, dict)
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
    chunks a file: no Python object a chunk on that path); :attr:`chunks`, one
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


class DataFiles(Mapping):
    """``Manifest.files``, one interface for every format version: the data files by name
    (each a :class:`FileEntry`), each rank's per-rank values, and the checkpoint's sizes.
    A version-1 manifest lists them (:class:`ListedFiles`); a later one reads each rank's
    chunk table and values file on first use (:class:`flexckpt.format.tables.TableFiles`, the
    only metadata I/O). ``bytes_read``: metadata read so far (tables, values files), and
    ``peer_bytes_read`` the part of it a fast tier's recovery received from peers."""

    bytes_read = 0
    peer_bytes_read = 0

    def entries(self, names: Iterable[str]) -> dict[str, "FileEntry"]:
        """The entries of the data files ``names`` (those a load reads), by name."""
        return {name: self[name] for name in names}

    def rank_values(self, rank: int) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def raw_bytes(self) -> int:
        """Raw bytes saved."""
        raise NotImplementedError

    @property
    def stored_bytes(self) -> int:
        """Bytes the data files store."""
        raise NotImplementedError


class ListedFiles(dict, DataFiles):  # type: ignore[misc]
    """Version 1's files: every data file and chunk listed in the manifest, and every
    rank's per-rank values in it (``per_rank``: name to one value a rank). No I/O."""

    def __init__(self, files: dict[str, FileEntry], per_rank: dict[str, list[Any]]) -> None:
        super().__init__(files)
        self.per_rank = per_rank

    def rank_values(self, rank: int) -> dict[str, Any]:
        return {k: v[rank] for k, v in self.per_rank.items()}

    @property
    def raw_bytes(self) -> int:
        return sum(f.nbytes for f in self.values())

    @property
    def stored_bytes(self) -> int:
        return sum(c.length for f in self.values() for c in f.chunks)


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
        self.index = plan.spec_index
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

    def _file(self, rank: int) -> str:
        name = self._files.get(rank)
        if name is None:
            name = self._files[rank] = data_name(self.attempt, rank)
        return name


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
    tree: Any = None  # version 4: the state's container tree (flexckpt.state.tree); None: not recorded
    # ``files`` is a DataFiles: a ListedFiles (version 1) or a flexckpt.format.tables.TableFiles

    def __post_init__(self) -> None:
        if type(self.files) is dict:  # listed by the caller (a version-1 document, a test): the same interface
            object.__setattr__(self, "files", ListedFiles(self.files, self.per_rank))

    def rank_values(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s per-rank values (version 2 and later: read from its values file)."""
        return self.files.rank_values(rank)  # type: ignore[attr-defined]

    @property
    def metadata_bytes_read(self) -> int:
        """Bytes of table and values files read so far, besides the manifest itself."""
        return self.files.bytes_read

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
                         f"{VERSION}); build the manifest with flexckpt.save.commit.build_manifest")

    @property
    def total_bytes(self) -> int:
        """Raw bytes saved (version 2 and later: the tensors' bytes, without the streams' padding)."""
        return self.files.raw_bytes  # type: ignore[attr-defined]

    @property
    def stored_bytes(self) -> int:
        return self.files.stored_bytes  # type: ignore[attr-defined]
