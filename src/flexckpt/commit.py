"""The coordinator's side of a save: wait for every rank's record by reading storage,
check them against each other, write the manifest (the commit), then apply retention.
No collective and no barrier: ranks meet only through storage."""
from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from flexckpt.errors import ManifestError, SaveError
from flexckpt.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    SavedPiece,
    SavedTensor,
    StoredChunk,
    data_file,
    failed_file,
    parse_manifest,
    parse_record,
    parse_step_dir,
    record_file,
    step_dir,
)
from flexckpt.plan import WritePlan
from flexckpt.storage import Storage

log = logging.getLogger("flexckpt")


def wait_for_records(
    storage: Storage, step: int, run_id: str, world_size: int, timeout: float, max_delay: float = 0.01
) -> dict[int, dict]:
    """Records of ranks 1..world-1 for ``step`` of this run, polled with backoff up to
    ``max_delay`` seconds between listings."""
    folder = step_dir(step)
    pending = set(range(1, world_size))
    records: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    delay = 0.001
    while pending:
        names = set(storage.list_names(folder))
        for r in sorted(pending):
            name = record_file(run_id, r)
            if name in names:
                where = f"record {folder}/{name}"
                records[r] = parse_record(storage.read_bytes(f"{folder}/{name}"), where)
                pending.discard(r)
        if not pending:
            break
        if time.monotonic() > deadline:
            raise SaveError(
                f"step {step}: ranks {sorted(pending)} of {world_size} did not write their records within "
                f"{timeout:.0f} s (commit_timeout); is every rank calling save({step}, ...)?"
            )
        time.sleep(delay)
        delay = min(delay * 2, max_delay)
    return records


def check_records(
    records: dict[int, dict], step: int, run_id: str, world_size: int, fingerprint: str, structure: dict
) -> None:
    for r, rec in sorted(records.items()):
        for key, want in (("run_id", run_id), ("step", step), ("rank", r), ("world_size", world_size)):
            if rec[key] != want:
                raise SaveError(f"step {step}: record of rank {r} has {key}={rec[key]!r}, expected {want!r}")
        if rec["fingerprint"] != fingerprint:
            raise SaveError(
                f"step {step}: rank {r} saved a different state structure than rank 0: "
                f"{describe_difference(structure, rec['structure'])}"
            )


def describe_difference(ours: dict, theirs: dict) -> str:
    """Which keys differ between two canonical structures (rank 0 vs another rank)."""
    parts = []
    mine = {t["name"]: t for t in ours.get("tensors", [])}
    other = {t.get("name"): t for t in theirs.get("tensors", []) if isinstance(t, dict)}
    only_0 = sorted(set(mine) - set(other))
    only_r = sorted(k for k in set(other) - set(mine) if isinstance(k, str))
    changed = sorted(k for k in set(mine) & set(other) if mine[k] != other[k])
    if only_0:
        parts.append(f"tensors only on rank 0: {only_0[:10]}")
    if only_r:
        parts.append(f"tensors only on the other rank: {only_r[:10]}")
    for k in changed[:10]:
        parts.append(f"tensor {k!r}: rank 0 has {mine[k]}, the other rank has {other[k]}")
    for kind in ("plain", "lanes", "per_rank"):
        a, b = set(ours.get(kind, [])), set(theirs.get(kind, []))
        if a != b:
            parts.append(f"{kind} keys differ: only on rank 0 {sorted(a - b)[:10]}, only on the other {sorted(b - a)[:10]}")
    return "; ".join(parts) or "the structures hash differently"


def build_manifest(
    *,
    step: int,
    run_id: str,
    plan: WritePlan,
    fingerprint: str,
    own_chunks: list[StoredChunk],
    records: dict[int, dict],
    plain: dict[str, Any],
    own_lanes: dict[str, bytes],
    own_per_rank: dict[str, bytes],
) -> Manifest:
    world = plan.world_size
    chunks_by_rank = {0: own_chunks}
    for r, rec in records.items():
        chunks_by_rank[r] = [StoredChunk(*c) for c in rec["chunks"]]
    files: dict[str, FileEntry] = {}
    pieces: dict[int, list[SavedPiece]] = {i: [] for i in range(len(plan.specs))}
    for r, rank_plan in enumerate(plan.ranks):
        name = data_file(run_id, r)
        if rank_plan.nbytes == 0:
            continue
        stored = chunks_by_rank[r]
        if [(c.raw_offset, c.raw_length) for c in stored] != [(c.offset, c.length) for c in rank_plan.chunks]:
            raise SaveError(f"step {step}: rank {r} wrote chunks that do not follow the write plan")
        files[name] = FileEntry(name, rank_plan.nbytes, tuple(stored))
        for p in rank_plan.pieces:
            pieces[p.spec_index].append(SavedPiece(name, p.start, p.stop, p.offset))
    tensors = {
        spec.name: SavedTensor(spec.name, spec.dtype, spec.shape, spec.layout, tuple(sorted(pieces[i], key=lambda p: p.start)))
        for i, spec in enumerate(plan.specs)
    }
    lanes: dict[str, dict[str, Any]] = {}
    sources: dict[tuple[str, str], int] = {}
    for r, lane_values in [(0, own_lanes)] + [(r, rec["lanes"]) for r, rec in sorted(records.items())]:
        for path, value in lane_values.items():
            mapping = orjson.loads(value) if isinstance(value, bytes) else value
            if not isinstance(mapping, dict):
                raise SaveError(f"step {step}: rank {r} sent lanes of {path!r} that are not keyed by lane")
            merged = lanes.setdefault(path, {})
            for lane, v in mapping.items():
                if lane in merged:
                    raise SaveError(
                        f"step {step}: lane {lane!r} of {path!r} was saved by ranks {sources[(path, lane)]} and {r}; "
                        f"each lane must be hosted by exactly one rank"
                    )
                merged[lane] = v
                sources[(path, lane)] = r
    per_rank: dict[str, list[Any]] = {}
    for path, value in own_per_rank.items():
        per_rank[path] = [orjson.loads(value)] + [records[r]["per_rank"].get(path) for r in range(1, world)]
    return Manifest(step, run_id, world, time.time(), fingerprint, files, tensors, plain, lanes, per_rank)


def commit(storage: Storage, manifest: Manifest, fsync: bool) -> None:
    """Write the manifest last, atomically: this is the commit."""
    storage.put_atomic(f"{step_dir(manifest.step)}/{MANIFEST}", manifest.to_bytes(), fsync=fsync)


def mark_failed(storage: Storage, step: int, run_id: str, message: str) -> None:
    """Tell the other ranks (who poll for the manifest) that this step will not commit."""
    try:
        storage.makedirs(step_dir(step))
        storage.put_atomic(f"{step_dir(step)}/{failed_file(run_id)}", message.encode(), fsync=False)
    except Exception:  # noqa: BLE001 - best effort; the save already failed
        log.exception("could not write the failure marker of step %d", step)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists, ascending (listings are never served from a cache)."""
    steps = [s for s in (parse_step_dir(n) for n in storage.list_names("")) if s is not None]
    if storage.local:
        return [s for s in steps if storage.exists(f"{step_dir(s)}/{MANIFEST}")]
    fs = storage.fs
    fs.invalidate_cache(storage.root)
    found = fs.glob(storage.path(f"step-*/{MANIFEST}"))
    with_manifest = {parse_step_dir(p.rstrip("/").split("/")[-2]) for p in found}
    return sorted(s for s in steps if s in with_manifest)


def read_manifest(storage: Storage, step: int) -> Manifest:
    rel = f"{step_dir(step)}/{MANIFEST}"
    manifest = parse_manifest(storage.read_bytes(rel, limit=MAX_MANIFEST_BYTES), where=f"manifest {rel}")
    if manifest.step != step:
        raise ManifestError(f"{rel} describes step {manifest.step}, not {step}")
    return manifest


def apply_retention(storage: Storage, keep_last: int | None, newest: int, run_id: str) -> None:
    """Delete committed checkpoints beyond the newest ``keep_last`` (manifest first, then
    data) and incomplete folders older than the newest commit."""
    steps = committed_steps(storage)
    doomed = steps[:-keep_last] if keep_last else []
    for s in doomed:
        storage.remove(f"{step_dir(s)}/{MANIFEST}")
        storage.remove_tree(step_dir(s))
        log.info("retention: removed step %d", s)
    committed = set(steps)
    for name in storage.list_names(""):
        s = parse_step_dir(name)
        if s is not None and s < newest and s not in committed:
            storage.remove_tree(name)
            log.info("removed incomplete checkpoint folder %s", name)
    _remove_strays(storage, newest, run_id)


def _remove_strays(storage: Storage, step: int, run_id: str) -> None:
    """Files in the just-committed folder that its manifest does not own (an earlier job's
    attempt at the same step)."""
    folder = step_dir(step)
    for name in storage.list_names(folder):
        if name == MANIFEST or name.startswith(run_id + "-") or name.startswith("."):
            continue
        storage.remove(f"{folder}/{name}")
