"""Reading a manifest or a record back: untrusted input, every name, path, dtype, shape,
offset and length validated before anything is allocated or read, and no file name may
leave the checkpoint's folder. Version 2 and later (:func:`_parse_v2`) list each tensor's
dtype, shape and layout and one line a rank, and recompute the pieces from the plan rules
(the plan of one structure cached across manifests); version 1 (:func:`_parse_file`,
:func:`_parse_tensor`) lists every piece and chunk."""
from __future__ import annotations

import dataclasses
import math
import operator
import re
import threading
from typing import Any

import orjson
import torch

from flexckpt.errors import ManifestError
from flexckpt.format.checksum import ALGORITHM
from flexckpt.format.chunktable import MAX_TABLE_BYTES
from flexckpt.format.jsondoc import SEAL_FIELD, fail, get_field, get_int, parse_json, show, unseal
from flexckpt.format.manifest import (
    CODECS,
    FORMAT,
    MAX_CHUNK_BYTES,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NUMEL,
    MAX_RECORD_BYTES,
    MAX_TIME,
    MAX_WORLD,
    READ_VERSIONS,
    RECORD_FORMAT,
    VERSION,
    FileEntry,
    ListedFiles,
    Manifest,
    PlanPieces,
    RankEntry,
    SavedPiece,
    SavedTensor,
    StoredChunk,
)
from flexckpt.format.names import attempt_run_id, check_run_id
from flexckpt.format.tables import TableFiles
from flexckpt.format.write_plan import READ_RULES_VERSIONS, RULES_VERSION, PlanRules, WritePlan
from flexckpt.state.dtypes import dtype_from_name, itemsize
from flexckpt.state.structure import TensorSpec
from flexckpt.state.tree import check_tree
from flexckpt.state.values import MAX_BYTES_VALUE
from flexshard import Layout, MeshLayout, layout_from_json

_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX = re.compile(r"[0-9a-f]*")


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
    return Manifest(step, run_id, world, float(wall), fp, ListedFiles(files, per_rank), tensors, plain, lanes, per_rank)


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
    # (name, dtype, shape, layout) a tensor: the plan's key, TensorSpecs only for a new plan
    fields = _v2_tensors(get_field(doc, "tensors", dict, where), where, version)
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


_PLANS: list[tuple[tuple, WritePlan]] = []  # the newest few, newest last
_PLANS_KEPT = 2
_plans_lock = threading.Lock()


def _write_plan(fields: list[tuple], world: int, rules: PlanRules) -> WritePlan:
    """The plan of a structure (``(name, dtype, shape, layout)`` a tensor) at a world size
    under the rules: a pure function of the three, which caches each rank's pieces and
    chunks as they are asked for. Manifests of one structure (each step a job saves, each
    load of it) share one, so a repeated load plans once. Found by equality, not by hash:
    comparing two structures whose layouts are the same objects costs a third of hashing
    one (a layout's hash is Python code, its equality to itself is not)."""
    key = (world, rules, fields)
    with _plans_lock:
        for k, (known, plan) in enumerate(_PLANS):
            if known == key:
                _PLANS.append(_PLANS.pop(k))  # now the newest
                return plan
    plan = WritePlan([TensorSpec(*f) for f in fields], world, rules)
    with _plans_lock:
        _PLANS.append((key, plan))
        del _PLANS[:-_PLANS_KEPT]
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


def _v2_entry(name: str, entry: Any, where: str, version: int) -> tuple[torch.dtype, tuple[int, ...], Layout]:
    """A version-2 (and later) tensor's dtype, shape and layout, validated."""
    fields = _tensor_fields(name, entry, where)
    if entry.keys() != _V2_TENSOR_FIELDS:
        raise fail(where, f"tensor {show(name)} has fields {sorted(entry)}, expected dtype, shape and layout")
    if version < 3 and isinstance(fields[2], MeshLayout):
        raise fail(where, f"tensor {show(name)} has a mesh layout, which a version-{version} manifest cannot hold")
    return fields


def _v2_tensors(raw: dict, where: str, version: int) -> list[tuple]:
    """``(name, dtype, shape, layout)`` of every tensor of ``raw``, validated.

    A manifest has hundreds of tensors and a handful of distinct entries: each distinct
    entry is checked once, found by its JSON text (which tells its value exactly: a bool
    is not an int there, nor 1.0 the int 1; ``raw`` is orjson's, which refuses NaN and
    infinity, the only values it would write as another's text), so equal texts give
    equal fields. Where
    anything fails, the tensors are checked one by one, so that the error names the first
    bad tensor as it always has."""
    names, entries = list(raw), list(raw.values())
    try:
        texts = list(map(orjson.dumps, entries))
    except TypeError:  # nested too deep to write back: checked one by one below
        texts = None
    if texts is not None and all(map(_name_ok, names)):  # (a name is checked with its entry below)
        try:
            fields_of = {text: _v2_entry(name, entry, where, version)
                         for text, (name, entry) in dict(zip(texts, zip(names, entries))).items()}
        except ManifestError:
            pass
        else:
            return list(map(operator.add, zip(names), map(fields_of.__getitem__, texts)))
    return [(name, *_v2_entry(name, entry, where, version)) for name, entry in raw.items()]


_INT_ONLY = frozenset((int,))
_new = object.__new__


def _saved_tensor(spec: TensorSpec, source: PlanPieces) -> SavedTensor:
    """``SavedTensor(spec.name, spec.dtype, spec.shape, spec.layout, None, source)``,
    built without the frozen dataclass's per-field ``__setattr__`` (a load builds one a
    tensor, on the manifest's hot path); the same object the constructor would give."""
    t = _new(SavedTensor)
    t.__dict__.update(name=spec.name, dtype=spec.dtype, shape=spec.shape, layout=spec.layout, pieces=None,
                      source=source)
    return t


MAX_TENSOR_NAME = 4096  # characters


def _name_ok(name: str) -> bool:
    return 0 < len(name) <= MAX_TENSOR_NAME


def _tensor_fields(name: str, entry: Any, where: str) -> tuple[torch.dtype, tuple[int, ...], Layout]:
    """A tensor's dtype, shape and layout, validated (of any version)."""
    if not _name_ok(name):
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
