"""Dealing: which documents of a source a lane reads, epoch after epoch.

In each epoch a source's documents are put in an order fixed by (seed, phase, source,
epoch), and lane ``l`` of ``L`` reads positions ``l, l+L, l+2L, ...`` of it. When its share
runs out the lane starts the source's next epoch, in a new order; the epoch is part of the
cursor. Lanes therefore never depend on one another, nor on how many ranks host them.
"""
from __future__ import annotations

from .mixture import Plan


class SourceReader:
    """One lane's endless document sequence from one source."""

    def __init__(self, plan: Plan, source: int, lane: int, lanes: int, epoch: int, index: int) -> None:
        self.plan, self.source, self.lane, self.lanes = plan, source, lane, lanes
        self.share_len = len(range(lane, len(plan.documents[source]), lanes))
        if index >= self.share_len:
            raise ValueError(f"document {index} of lane {lane}'s share of source {source} (it has {self.share_len})")
        self.epoch, self.index = epoch, index

    def next(self) -> tuple[int, int, int]:
        """(epoch, index in the lane's share, document index in the source), then advance."""
        doc = int(self.plan.order(self.source, self.epoch)[self.lane + self.index * self.lanes])
        out = (self.epoch, self.index, doc)
        self.index += 1
        if self.index == self.share_len:
            self.epoch, self.index = self.epoch + 1, 0
        return out
