"""A persistent save on its way: the settings the save side runs with (``SaveSettings``),
a state structure's plan on this rank (``PlanEntry``) and one save in flight (``SaveJob``).
Shared by :mod:`flexckpt.save_pipeline`, which makes and moves jobs, and
:mod:`flexckpt.committer`, which commits them; data only, no behaviour."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flexckpt.codec import Compression
from flexckpt.handle import SaveHandle
from flexckpt.plan import RankPlan, WritePlan
from flexckpt.staging import StagingBuffer
from flexckpt.storage import Storage
from flexckpt.writer import RawSums


@dataclass(frozen=True)
class SaveSettings:
    """What the save pipeline and the committer both need, fixed at construction."""

    storage: Storage
    rank: int
    world_size: int
    run_id: str
    session: str
    compression: Compression
    chunk_bytes: int
    fsync: bool
    direct_io: bool
    stage_delay: float  # seconds the staging copy waits after save() returns (cut short by the fence)
    commit_timeout: float
    poll_interval: float  # longest pause between the listings or existence checks that wait for other ranks

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


@dataclass(eq=False)
class PlanEntry:
    """A state structure's plan on this rank, kept while the structure stays the same."""

    id: int
    plan: WritePlan
    rank_plan: RankPlan
    fingerprint: str
    structure: dict
    structure_bytes: bytes
    order: list[int]  # walk indices of this rank's pieces, in stream order
    shapes: list[tuple]
    device: torch.device  # staged from: the CPU or this rank's accelerator
    per_rank_keys: list[str] = field(default_factory=list)
    parts: list = field(default_factory=list)  # per piece: None (all of it) or (start, stop) of the local flat piece
    published: bool = False  # the structure went out in a record (the first save with it)
    partial: bool = False  # holds a tensor on a mesh spanning part of the world (a pipeline stage's)
    published_in: tuple | None = None  # (step, attempt) whose record carried the structure, until seen committed


@dataclass(eq=False)
class SaveJob:
    """One persistent save on its way through the stager, writer and commit threads."""

    step: int
    handle: SaveHandle
    entry: PlanEntry
    buffer: StagingBuffer
    srcs: list[torch.Tensor] | None
    plain: dict[str, Any]
    lanes: dict[str, bytes]
    per_rank: dict[str, bytes]
    ready: Any  # the copies' mark on the training stream (None on a CPU)
    attempt: str = ""
    keyed: dict[str, bytes] = field(default_factory=dict)  # this rank's bytes values, by key
    lease: int = 0  # the buffer's acquisition that holds this save (BufferPool.share)
    # the state object saved, held (not its id(): a freed state's id may come back as another
    # object's) until the buffer is released: a fast save of the same step and state shares it
    state: Any = None
    staged_ok: bool = False  # the buffer holds the state (set before the fence is released)
    sums: RawSums | None = None  # its chunk checksums, shared with a fast save of its bytes (uncompressed only)
    chunks: list = field(default_factory=list)
    # its record line, 6 fields: [fingerprint, table checksum, table bytes, stored bytes,
    #                             values checksum ("" without values), values bytes]
    line: list = field(default_factory=list)
    tree: Any = None  # the coordinator's: the state's container tree, for the manifest (flexckpt.tree)
