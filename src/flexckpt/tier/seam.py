"""What the fast tier needs of the objects it is composed with: its host (who this rank is,
the run and its persistent store, as values the ``Checkpointer`` hands over: the tier holds
no reference to the facade and never calls back into it) and the persistent save pipeline's
staging (plans, captures, and the staged buffer of the save of the same step). The tier
reads nothing else of either."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flexckpt.save.job import PlanEntry, SaveJob
    from flexckpt.save.staging import StagingBuffer
    from flexckpt.storage import Storage
    from flexckpt.state.structure import Walk


@dataclass(frozen=True)
class TierHost:
    """The job the tier serves: this rank, the run, and its persistent store (whose
    committed steps a recovery reads itself, with ``committed_steps(storage)``)."""

    rank: int
    world_size: int
    run_id: str  # the run's id (attempts are numbered under it)
    session: str  # this launch's id (attempts of one launch are its own)
    storage: "Storage"  # the persistent store: the run folder's record, and a recovery's missing ranks
    group: Any  # the torch.distributed process group of the job, or None (the default group)
    read_threads: int  # parallel ranged reads of a recovery's load


class StagedSaves(Protocol):
    """The persistent save pipeline's side of a fast save: the same plan and capture, and
    the staged bytes of the persistent save of the same step, where it holds them."""

    def share_staged(self, step: int, state: dict) -> "SaveJob | None":
        """The persistent save of ``step`` from this very ``state`` whose staging buffer still
        holds its bytes, now with one more holder (the caller, who must :meth:`release` it
        once); None otherwise."""
        ...

    def plan_for(self, w: "Walk") -> "PlanEntry":
        """The write plan of the walked state on this rank (cached while its structure stays)."""
        ...

    def capture(self, w: "Walk", entry: "PlanEntry") -> tuple[list, dict, dict, dict]:
        """``(sources, plain, lanes, per_rank)``: what a save takes of the state now, on the
        calling thread (the sources are the state's tensors; the values are encoded)."""
        ...

    def release(self, buffer: "StagingBuffer") -> None:
        """Let go of a buffer :meth:`share_staged` handed out."""
        ...


__all__ = ["StagedSaves", "TierHost"]
