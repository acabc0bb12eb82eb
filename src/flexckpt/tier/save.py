"""A fast save's pieces (``FastTier.save`` queues the job; its thread runs them): the
staged stream (the tier's own buffer, or the persistent save's of the same step), this
rank's files in the node's folder, written through :mod:`flexckpt.writer` as a persistent
save writes them (uncompressed, never fsynced), and what its marker carries of the
state's structure."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from flexckpt.errors import SaveError
from flexckpt.manifest import SavedTensor
from flexckpt.names import data_name, step_dir, table_name, values_name
from flexckpt.plan import part_of_world
from flexckpt.staging import StagingBuffer
from flexckpt.storage import Storage, makedirs
from flexckpt.tier.inventory import compat_fingerprint
from flexckpt.tier.transport import mapped
from flexckpt.writer import raw_chunks, write_rank_files, write_raw


@dataclass(eq=False)
class FastJob:
    step: int
    attempt: str
    handle: Any
    entry: Any
    srcs: list | None
    plain: dict
    lanes: dict
    per_rank: dict
    copy: Any  # the staging copy of srcs into the buffer, CPU or CUDA (None when shared holds the bytes)
    keyed: dict = field(default_factory=dict)  # bytes values by key (carried in the marker, as records carry them)
    shared: Any = None  # the persistent save of the same step whose staged buffer this save reads
    release: Any = None  # lets go of that buffer (once, after the node's data file is written)
    branch: int = 0  # the run's branch in this launch when save() was called (see FastTier.abandon)

    def let_go(self) -> None:
        """Release the shared staging buffer, if this save still holds it."""
        if self.release is not None:
            self.release()
            self.release = None


def staged_stream(job: FastJob, buffer: StagingBuffer) -> memoryview:
    """The job's staged bytes: the shared persistent save's buffer once its staging is
    done (SaveError if it failed), else ``buffer``, staged into now (the fence released
    either way)."""
    e, h = job.entry, job.handle
    if job.shared is not None:  # the persistent save stages the bytes; this save reads its buffer
        job.shared.handle._staged.wait()
        if not job.shared.staged_ok:
            raise SaveError(f"the persistent save of step {job.step}, whose staged bytes this fast save takes, "
                            f"failed while staging: {job.shared.handle.exception()}")
        return memoryview(job.shared.buffer.data.numpy())
    try:
        buffer.ensure(e.rank_plan.nbytes, pin=e.device.type == "cuda")
        dsts = buffer.views(e.id, e.rank_plan, e.plan.specs, e.shapes)
        job.copy(dsts, job.srcs)
    finally:
        job.srcs = None
        h._staged.set()
    return memoryview(buffer.data.numpy())


class OwnFiles(NamedTuple):
    files: dict  # file name (in the step folder) -> its bytes (the data file mapped): what a copy sends
    line: list  # the rank's record line (flexckpt.writer.write_rank_files)
    chunks: int


def write_own(storage: Storage, job: FastJob, stream: memoryview, rank: int) -> OwnFiles:
    """This rank's files of ``job`` in the node's folder (``storage``): the data file (the shared buffer
    let go once it is written), its chunks hashed from the file, then the table and values."""
    e = job.entry
    folder = step_dir(job.step)
    data = data_name(job.attempt, rank)
    nbytes = e.rank_plan.nbytes
    makedirs(storage, f"{folder}/{job.attempt}")
    if nbytes:
        write_raw(storage, f"{folder}/{data}", stream, nbytes, fsync=False, direct=False)
    job.let_go()  # the node's file holds the bytes now: the buffer may be staged into again
    files: dict[str, bytes | memoryview | np.ndarray] = {}
    chunks = []
    if nbytes:  # hashed from the node's file, and the copy sent from it (mapped): no buffer held
        files[data] = view = mapped(storage.path(f"{folder}/{data}"), 0, nbytes)
        # a shared save's chunks are hashed once, by whichever of the two writers comes first
        chunks = raw_chunks(memoryview(view), e.rank_plan.chunks, None if job.shared is None else job.shared.sums)
    own = write_rank_files(storage, folder, rank=rank, attempt=job.attempt, fingerprint=e.fingerprint, codec="none",
                           chunks=chunks, per_rank=job.per_rank, fsync=False)
    files[table_name(job.attempt, rank)] = own.table
    if own.values:
        files[values_name(job.attempt, rank)] = own.values
    return OwnFiles(files, own.line, len(chunks))


class CarriedStructure:
    """The world-independent fingerprint of a plan's structure, and what this rank's
    marker carries of it: saved rank 0's, its tensors with their saved layouts, the plan
    rules and its structure; a pipeline stage's lowest rank (the lowest rank of the
    meshes its stage's tensors live on), its structure, from which a recovery builds the
    union of the stages' as the persistent commit does (:mod:`flexckpt.stages`). Kept
    while the plan stays the same."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._for: int | None = None
        self._of: tuple[str, dict] = ("", {})

    def of(self, e: Any) -> tuple[str, dict]:
        if self._for != e.id:
            lowest = [min(t.layout.rank_table()) for t in e.plan.specs if part_of_world(t.layout, self.world)]
            carried: dict = {"structure": e.structure} if self.rank == 0 or (lowest and self.rank == min(lowest)) else {}
            if self.rank == 0:
                tensors = {t.name: SavedTensor(t.name, t.dtype, t.shape, t.layout).to_json() for t in e.plan.specs}
                carried.update(tensors=tensors, rules=e.plan.rules.to_json())
            self._of = (compat_fingerprint(e.structure), carried)
            self._for = e.id
        return self._of
