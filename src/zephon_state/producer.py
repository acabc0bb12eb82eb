"""The producer: a background thread that assembles this rank's steps ahead of the caller.

Per step it takes ``G/L`` rows from each hosted lane, in lane order, hashes each lane's
contribution, and cuts the rows into microbatches. Each microbatch carries, for the lanes
whose rows it holds, the lane cursor after its last such row; the pipeline records those
when the caller receives the microbatch, so state always describes consumed batches, never
prefetched ones.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .batch import Batch
from .cursor import LaneCursor
from .digest import lane_digest
from .lane import Lane, LaneSetup
from .pack import Rows
from .topology import Topology

_POLL_S = 0.05


@dataclass(frozen=True)
class Resume:
    """Where this rank's next step starts: step index, rows still owed by each hosted lane for
    that step (``G/L`` unless resuming mid-step) and the first microbatch's index."""

    step: int
    rows: tuple[int, ...]
    microbatch: int


def resume_point(topology: Topology, cursors: Mapping[int, LaneCursor]) -> Resume:
    """The step the hosted lanes' cursors stand at; raises ``ValueError`` naming the lanes
    when they cannot continue as one step here."""
    per_lane = topology.per_lane
    sequences = [cursors[lane].sequences for lane in topology.hosted]
    step = min(q // per_lane for q in sequences)
    rows = tuple((step + 1) * per_lane - q for q in sequences)
    if any(r < 0 for r in rows):
        detail = ", ".join(f"lane {lane}: {q}" for lane, q in zip(topology.hosted, sequences))
        raise ValueError(
            f"the lanes this rank hosts stand more than one step apart ({detail} rows of {per_lane} "
            "per step); save the state at a step boundary"
        )
    consumed = topology.local_batch - sum(rows)
    if consumed % topology.microbatch:
        raise ValueError(
            f"the checkpoint was taken {consumed} rows into step {step} of this rank's lanes, which is not a "
            f"whole number of microbatches of {topology.microbatch}; save at a step boundary or resume "
            "at the saved data-parallel size"
        )
    return Resume(step, rows, consumed // topology.microbatch)


class Producer:
    """Runs the hosted lanes on a background thread; ``get`` returns the next microbatch."""

    def __init__(
        self, setup: LaneSetup, topology: Topology, cursors: Mapping[int, LaneCursor], resume: Resume, prefetch: int
    ) -> None:
        self.setup, self.topology, self.resume = setup, topology, resume
        self._cursors = dict(cursors)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch * topology.microbatches))
        self._stop = threading.Event()
        self._lanes: list[Lane] = []
        self._thread = threading.Thread(target=self._run, name="zephon-producer", daemon=True)
        self._thread.start()

    def get(self) -> Batch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put(item)  # every later call fails the same way
            raise item
        return item

    def close(self, timeout: float = 60.0) -> None:
        """Stop: cancel the lanes' queued tokenization (a wait on it ends at once) and join."""
        self._stop.set()
        for lane in list(self._lanes):
            lane.cancel()
        while True:  # a put blocked on a full queue returns now, not at its next poll
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for lane in self.topology.hosted:
                self._lanes.append(Lane(lane, self.setup, self._cursors[lane]))
            step, takes, first = self.resume.step, self.resume.rows, self.resume.microbatch
            while not self._stop.is_set():
                batches = self._step(step, takes, first)
                if step == self.resume.step:  # every lane's first window is built: tokenize ahead now
                    for lane in self._lanes:
                        lane.start_readahead()
                for batch in batches:
                    if not self._put(batch):
                        return
                step, takes, first = step + 1, (self.topology.per_lane,) * len(self._lanes), 0
        except BaseException as e:  # handed to the caller, which is the one to decide
            self._put(e)
        finally:
            for lane in self._lanes:
                lane.cancel()

    def _step(self, step: int, takes: Sequence[int], first: int) -> list[Batch]:
        topo = self.topology
        parts: list[Rows] = []
        cursors: list[list[LaneCursor]] = []
        digests: dict[int, bytes] = {}
        for lane, k in zip(self._lanes, takes):
            if k == 0:
                cursors.append([])
                continue
            rows, after = lane.take(k)
            parts.append(rows)
            cursors.append(after)
            if k == topo.per_lane:
                digests[lane.id] = lane_digest(rows.input_ids)
        rows = Rows.concat(parts)
        lane_ids = np.repeat(np.asarray(topo.hosted, dtype=np.int32), takes)
        starts = np.cumsum(takes) - np.asarray(takes)
        m = topo.microbatch
        out = []
        for j in range(len(rows) // m):
            lo, hi = j * m, (j + 1) * m
            mb_cursors = {}
            for lane, a, k, after in zip(topo.hosted, starts.tolist(), takes, cursors):
                if a < hi and a + k > lo:
                    mb_cursors[lane] = after[min(hi, a + k) - a - 1]
            part = rows.take(slice(lo, hi))
            out.append(
                Batch(part.input_ids, part.labels, part.position_ids, part.document_ids, part.source_ids,
                      lane_ids[lo:hi], step, first + j, topo.microbatches, digests, mb_cursors)
            )
        return out
