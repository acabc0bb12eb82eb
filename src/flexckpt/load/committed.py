"""A load from the persistent store, as ``Checkpointer.load`` runs it on every rank: the
ranks agree on a step (rank 0 picks it), each reads its part of that step, and they agree on
success before any value is set. A failure on any rank fails the load on all; with
``fallback``, the ranks then try the previous committed step together."""
from __future__ import annotations

import logging
import time
import torch.distributed as dist

from flexckpt.agree import agree_step, distributed, first_failed_rank, share_bytes
from flexckpt.catalog import committed_steps, read_manifest, read_manifest_bytes
from flexckpt.errors import LoadError
from flexckpt.load.exchange import PeerFailure, fanout_for
from flexckpt.load.pending import LoadStats, PendingLoad, collection_paused
from flexckpt.state.structure import Excluder, Walk
from flexckpt.storage import Storage

log = logging.getLogger("flexckpt")


def manifest_bytes(storage: Storage, step: int, rank: int, world_size: int, group: "dist.ProcessGroup | None",
                   once: bool) -> tuple[bytes, bool]:
    """The bytes of ``step``'s manifest on ``storage`` and whether they came from a peer: read
    by this rank, or with ``once`` (every rank of the group calls it then: a collective) read
    by rank 0 and received by the others (:func:`flexckpt.agree.share_bytes`), as a fanned-out
    load and a fast tier's recovery that takes ranks from the store read it."""
    if not once:
        return read_manifest_bytes(storage, step), False
    data = share_bytes(rank, world_size, group, lambda: read_manifest_bytes(storage, step),
                       f"the manifest of step {step} on {storage.url}")
    return data, distributed(world_size) and rank != 0


def load_committed(storage: Storage, w: Walk, *, rank: int, world_size: int, group: "dist.ProcessGroup | None",
                   step: int | None, strict: bool, gone: Excluder | None, read_threads: int,
                   fallback: bool, fanout: "str | bool" = False) -> tuple[int, LoadStats]:
    """Load the walked state ``w`` from ``step`` (None: the newest committed step); the step
    loaded and the load's stats. Raises this rank's error, or ``LoadError`` naming the rank
    that failed, unless ``fallback`` finds an older step that loads on every rank.
    ``fanout``: the ``Checkpointer``'s option (read once, fan out: :mod:`flexckpt.load.exchange`)."""
    def steps() -> list[int]:
        return committed_steps(storage)

    t0 = time.perf_counter()
    chosen = agree_step(rank, world_size, group, steps, storage.url, step, None)
    agreed = time.perf_counter() - t0  # the step agreements' seconds
    while True:
        error: BaseException | None = None
        pending = None
        fan = fanout_for(fanout, storage, rank, world_size, group)
        try:
            t0 = time.perf_counter()
            with collection_paused():  # the plan's allocations too (a collection here walks the trainer's heap)
                data, from_peer = manifest_bytes(storage, chosen, rank, world_size, group, once=fan is not None)
                manifest = read_manifest(storage, chosen, data)
                pending = PendingLoad(storage, manifest, w, rank, world_size, strict, gone)
                pending.stats.manifest_bytes, pending.stats.manifest_from_peer = len(data), from_peer
                pending.stats.plan_s = time.perf_counter() - t0
                pending.read(read_threads, fan)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
            error = exc
            if fan is not None:
                fan.join_failed()  # a rank that failed before the fan-out's gather still joins it
        t0 = time.perf_counter()
        try:
            failed_rank = first_failed_rank(rank, world_size, group, error is not None, isinstance(error, PeerFailure))
        except Exception:  # noqa: BLE001 - a peer that died breaks the agreement too: name it, not the group
            if isinstance(error, PeerFailure):
                raise error from None
            raise
        agreed += time.perf_counter() - t0
        if failed_rank is None:
            assert pending is not None
            pending.stats.agree_s = agreed
            pending.apply()
            return chosen, pending.stats
        if error is not None and fallback:  # handled, not raised: say what failed (raised: never logged too)
            log.warning("flexckpt rank %d: load of step %d failed: %s", rank, chosen, error)
        if not fallback:
            if error is not None:
                raise error
            raise LoadError(f"load of step {chosen} failed on rank {failed_rank}; see that rank's error")
        previous = chosen
        t0 = time.perf_counter()
        chosen = agree_step(rank, world_size, group, steps, storage.url, None, previous)
        agreed += time.perf_counter() - t0
        log.warning("flexckpt: load of step %d failed; falling back to step %d", previous, chosen)
