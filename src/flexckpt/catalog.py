"""The store's catalog: which steps it holds committed, and their manifests. A step is
committed when its manifest exists (the commit writes it last, atomically); everything
here only reads. The save side (the commit, retention, reclaim), the load, the fast tier's
recovery, the offline tools and the CLI all ask here; this module imports nothing of
``flexckpt.save``.
"""
from __future__ import annotations

import time

from flexckpt.errors import ManifestError
from flexckpt.format.manifest import MAX_MANIFEST_BYTES, Manifest
from flexckpt.format.manifest_parse import parse_manifest
from flexckpt.format.names import MANIFEST, parse_step_dir, step_dir
from flexckpt.storage import Storage
from flexckpt.storage_stall import bounded


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists, ascending (listings are never served from a cache). Its
    storage calls (the listing, a check a step) run under one stall watch: one hand-off to a
    helper thread, not one a step."""
    return bounded(storage.stall_timeout, f"listing the committed steps on {storage.url}",
                   lambda: _committed_steps(storage))


def _committed_steps(storage: Storage) -> list[int]:
    steps = [s for s in (parse_step_dir(n) for n in storage.list_names("")) if s is not None]
    if storage.local:
        return [s for s in steps if storage.exists(f"{step_dir(s)}/{MANIFEST}")]
    found = storage.glob(f"step-*/{MANIFEST}")
    with_manifest = {parse_step_dir(p.rstrip("/").split("/")[-2]) for p in found}
    return sorted(s for s in steps if s in with_manifest)


def read_manifest(storage: Storage, step: int, data: bytes | None = None) -> Manifest:
    """The step's manifest, validated; a version-2 manifest is bound to ``storage`` so that
    its chunk tables are read on first use. ``data``: its bytes, already obtained (a
    fanned-out load: rank 0 read them for every rank), checked all the same."""
    rel = f"{step_dir(step)}/{MANIFEST}"
    if data is None:
        data = read_manifest_bytes(storage, step)
    manifest = parse_manifest(data, where=f"manifest {rel}")
    if manifest.step != step:
        raise ManifestError(f"{rel} describes step {manifest.step}, not {step}")
    if manifest.version >= 2:
        manifest.files.bind(storage, step_dir(step))  # type: ignore[attr-defined]
    return manifest


def read_manifest_bytes(storage: Storage, step: int) -> bytes:
    """The bytes of the step's manifest, refused unread above :data:`MAX_MANIFEST_BYTES`."""
    return storage.read_bytes(f"{step_dir(step)}/{MANIFEST}", limit=MAX_MANIFEST_BYTES)


def written_since(storage: Storage, rel: str, since: float) -> bool:
    """Whether ``rel`` was written to after ``since`` (when this job started): a live job's
    (the save's check for another live job and the cleanup both ask)."""
    age = storage.age(rel)
    return age is not None and time.time() - age >= since


def committed_attempt(storage: Storage, step: int) -> str | None:
    """The attempt the step's manifest names now (None: no manifest, or version 1)."""
    try:
        return read_manifest(storage, step).attempt
    except (OSError, ValueError):
        return None
