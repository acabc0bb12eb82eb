"""The manifest: one JSON document per committed checkpoint, written last. Its presence
is the commit. Also the per-rank records the coordinator builds it from.

A manifest read back is untrusted input: every name, path, dtype, shape, offset and
length is validated here, before anything is allocated or read, and no file name may
leave the checkpoint's folder.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
import torch

from flexckpt.checksum import ALGORITHM
from flexckpt.dtypes import dtype_from_name, dtype_name, itemsize
from flexckpt.errors import ManifestError
from flexshard import Layout, layout_from_json

FORMAT = "flexckpt"
RECORD_FORMAT = "flexckpt-record"
VERSION = 1
MANIFEST = "manifest.json"
CODECS = ("none", "zstd")

MAX_MANIFEST_BYTES = 1 << 30
MAX_RECORD_BYTES = 1 << 28
MAX_CHUNK_BYTES = 1 << 30
MAX_NUMEL = 1 << 48
MAX_FILE_BYTES = 1 << 50
MAX_WORLD = 1 << 20

_STEP_DIR = re.compile(r"^step-(\d{12})$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX = re.compile(r"[0-9a-f]*")


def step_dir(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12:
        raise ValueError(f"step must be an int in [0, 10**12), got {step!r}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id must match {_RUN_ID.pattern}, got {run_id!r}")
    return run_id


def data_file(run_id: str, rank: int) -> str:
    return f"{run_id}-r{rank:05d}.data"


def record_file(run_id: str, rank: int) -> str:
    return f"{run_id}-r{rank:05d}.json"


def failed_file(run_id: str) -> str:
    return f"{run_id}.failed"


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

    def to_json(self) -> list:
        return list(self)


@dataclass(frozen=True)
class FileEntry:
    name: str
    nbytes: int  # raw stream size
    chunks: tuple[StoredChunk, ...]

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True)
class SavedPiece:
    """Elements ``[start, stop)`` of a tensor, at raw byte ``raw_offset`` of ``file``."""

    file: str
    start: int
    stop: int
    raw_offset: int

    def to_json(self) -> list:
        return [self.file, self.start, self.stop, self.raw_offset]


@dataclass(frozen=True)
class SavedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout
    pieces: tuple[SavedPiece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "layout": self.layout.to_json(),
            "pieces": [p.to_json() for p in self.pieces],
        }


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
    per_rank: dict[str, list[Any]]

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "checksum": ALGORITHM,
            "step": self.step,
            "run_id": self.run_id,
            "world_size": self.world_size,
            "time": self.time,
            "fingerprint": self.fingerprint,
            "files": {name: f.to_json() for name, f in self.files.items()},
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "plain": self.plain,
            "lanes": self.lanes,
            "per_rank": self.per_rank,
        }
        return orjson.dumps(doc)

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())


# -- validation of untrusted documents ---------------------------------------------------------
def _fail(where: str, msg: str) -> ManifestError:
    return ManifestError(f"invalid checkpoint {where}: {msg}")


def _get(doc: dict, key: str, kind: type | tuple, where: str) -> Any:
    if key not in doc:
        raise _fail(where, f"missing field {key!r}")
    value = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _fail(where, f"field {key!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _int(value: Any, lo: int, hi: int, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _fail(where, f"{what} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def parse_json(data: bytes, where: str) -> dict:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise _fail(where, f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _fail(where, f"expected a JSON object, got {type(doc).__name__}")
    return doc


def parse_manifest(data: bytes, where: str = "manifest") -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise _fail(where, f"{len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    doc = parse_json(data, where)
    if doc.get("format") != FORMAT:
        raise _fail(where, f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise _fail(where, f"version {doc.get('version')!r} is not supported (this flexckpt reads {VERSION})")
    if doc.get("checksum") != ALGORITHM:
        raise _fail(where, f"checksum algorithm {doc.get('checksum')!r} is not supported (expected {ALGORITHM})")
    step = _int(doc.get("step"), 0, 10**12 - 1, "step", where)
    try:
        run_id = check_run_id(doc.get("run_id"))
    except ValueError as e:
        raise _fail(where, str(e)) from None
    world = _int(doc.get("world_size"), 1, MAX_WORLD, "world_size", where)
    wall = _get(doc, "time", (int, float), where)
    fp = _get(doc, "fingerprint", str, where)
    files = {name: _parse_file(name, entry, where) for name, entry in _get(doc, "files", dict, where).items()}
    tensors = {
        name: _parse_tensor(name, entry, files, where) for name, entry in _get(doc, "tensors", dict, where).items()
    }
    plain = _get(doc, "plain", dict, where)
    lanes = _get(doc, "lanes", dict, where)
    for path, mapping in lanes.items():
        if not isinstance(mapping, dict):
            raise _fail(where, f"lanes of {path!r} must be an object keyed by lane")
    per_rank = _get(doc, "per_rank", dict, where)
    for path, values in per_rank.items():
        if not isinstance(values, list) or len(values) != world:
            raise _fail(where, f"per-rank values of {path!r} must be a list of {world} entries")
    return Manifest(step, run_id, world, float(wall), fp, files, tensors, plain, lanes, per_rank)


def _parse_file(name: str, entry: Any, where: str) -> FileEntry:
    if not _FILE_NAME.match(name) or ".." in name:
        raise _fail(where, f"file name {name!r} is not a plain file name inside the checkpoint folder")
    if not isinstance(entry, dict):
        raise _fail(where, f"file {name!r} must be an object")
    nbytes = _int(entry.get("nbytes"), 0, MAX_FILE_BYTES, f"file {name!r} nbytes", where)
    raw_chunks = entry.get("chunks")
    if not isinstance(raw_chunks, list):
        raise _fail(where, f"file {name!r} chunks must be a list")
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
        raise _fail(where, f"file {name!r}: checksum {bad!r} is not 16 hex digits")
    if raw_pos != nbytes:
        raise _fail(where, f"file {name!r} chunks cover {raw_pos} bytes, not its {nbytes}")
    return FileEntry(name, nbytes, tuple(chunks))


def _explain_bad_chunk(name: str, i: int, c: Any, raw_pos: int, pos: int, where: str) -> None:
    what = f"file {name!r} chunk {i}"
    if not isinstance(c, list) or len(c) != 6:
        raise _fail(where, f"{what} must be [raw_offset, raw_length, offset, length, codec, checksum]")
    raw_offset, raw_length, offset, length, codec, check = c
    _int(raw_offset, 0, MAX_FILE_BYTES, f"{what} raw_offset", where)
    _int(raw_length, 1, MAX_CHUNK_BYTES, f"{what} raw_length", where)
    _int(offset, 0, MAX_FILE_BYTES, f"{what} offset", where)
    _int(length, 0, MAX_CHUNK_BYTES, f"{what} length", where)
    if codec not in CODECS:
        raise _fail(where, f"{what} codec {codec!r} is not one of {CODECS}")
    if not isinstance(check, str) or not _HEX16.match(check):
        raise _fail(where, f"{what} checksum {check!r} is not 16 hex digits")
    if raw_offset != raw_pos or offset != pos:
        raise _fail(where, f"{what} does not follow the previous chunk (gap or overlap)")
    raise _fail(where, f"{what} is uncompressed but stores {length} bytes for {raw_length}")


def _parse_tensor(name: str, entry: Any, files: dict[str, FileEntry], where: str) -> SavedTensor:
    if not name or len(name) > 4096:
        raise _fail(where, f"tensor name {name[:80]!r} is empty or too long")
    if not isinstance(entry, dict):
        raise _fail(where, f"tensor {name!r} must be an object")
    try:
        dtype = dtype_from_name(entry.get("dtype"))
        layout = layout_from_json(entry.get("layout"))
    except (ValueError, TypeError) as e:
        raise _fail(where, f"tensor {name!r}: {e}") from None
    shape_raw = entry.get("shape")
    if not isinstance(shape_raw, list) or len(shape_raw) > 64:
        raise _fail(where, f"tensor {name!r} shape must be a list of at most 64 ints")
    shape = tuple(_int(s, 0, MAX_NUMEL, f"tensor {name!r} dimension", where) for s in shape_raw)
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise _fail(where, f"tensor {name!r} has {numel} elements, more than {MAX_NUMEL}")
    size = itemsize(dtype)
    pieces_raw = entry.get("pieces")
    if not isinstance(pieces_raw, list):
        raise _fail(where, f"tensor {name!r} pieces must be a list")
    pieces = []
    for i, p in enumerate(pieces_raw):
        what = f"tensor {name!r} piece {i}"
        if not isinstance(p, list) or len(p) != 4:
            raise _fail(where, f"{what} must be [file, start, stop, raw_offset]")
        file = p[0]
        if file not in files:
            raise _fail(where, f"{what} names file {file!r}, which the manifest does not list")
        start = _int(p[1], 0, numel, f"{what} start", where)
        stop = _int(p[2], start, numel, f"{what} stop", where)
        raw_offset = _int(p[3], 0, MAX_FILE_BYTES, f"{what} raw_offset", where)
        if raw_offset + (stop - start) * size > files[file].nbytes:
            raise _fail(where, f"{what} ends past the end of {file!r}")
        pieces.append(SavedPiece(file, start, stop, raw_offset))
    return SavedTensor(name, dtype, shape, layout, tuple(pieces))


def parse_record(data: bytes, where: str) -> dict:
    """A per-rank record: checked for shape here; its meaning is checked by the coordinator."""
    if len(data) > MAX_RECORD_BYTES:
        raise _fail(where, f"{len(data)} bytes, more than the {MAX_RECORD_BYTES} allowed")
    doc = parse_json(data, where)
    if doc.get("format") != RECORD_FORMAT or doc.get("version") != VERSION:
        raise _fail(where, f"not a version-{VERSION} flexckpt record")
    for key, kind in (("run_id", str), ("fingerprint", str), ("file", str), ("chunks", list), ("lanes", dict),
                      ("per_rank", dict), ("structure", dict)):
        _get(doc, key, kind, where)
    for key in ("step", "rank", "world_size", "nbytes"):
        _int(doc.get(key), 0, MAX_FILE_BYTES, key, where)
    return doc
