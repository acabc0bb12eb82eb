"""The mixer: which document a lane reads next.

Each source's documents are dealt to lanes per epoch: lane ``l`` of ``L`` reads positions
``l, l+L, l+2L, ...`` of that epoch's order. Among the sources, a lane picks the one whose
*estimated* token count would stay furthest below its target share after taking its next
document (weighted fair queueing on finish times), so the realised token shares follow the
targets within about one document. Estimates are ``tokens_per_byte * bytes + 1`` (the EOS).
A source whose lane share runs out starts its next epoch, in a new order.

The whole state is four integers per source, so a cursor stays small.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cursor import SourceState
from .plan import Plan


@dataclass(frozen=True)
class Pick:
    """A chosen document and the mixer state just before it was chosen."""

    source: int
    index: int
    before: tuple[SourceState, ...]


class LaneReader:
    """The endless, deterministic document sequence of one lane."""

    def __init__(self, plan: Plan, lane: int, lanes: int, start: tuple[SourceState, ...]) -> None:
        self.plan, self.lane, self.lanes = plan, lane, lanes
        self.state = [list(s) for s in start]
        self.share_len = [len(range(lane, len(d), lanes)) for d in plan.documents]
        self.single = len(plan.documents) == 1

    def snapshot(self) -> tuple[SourceState, ...]:
        return tuple((s[0], s[1], s[2], s[3]) for s in self.state)

    def _next_index(self, source: int) -> int:
        epoch, position = self.state[source][0], self.state[source][1]
        return int(self.plan.order(source, epoch)[self.lane + position * self.lanes])

    def _choose(self) -> int:
        if self.single:
            return 0
        best, best_finish = 0, float("inf")
        for s, (share, tpb) in enumerate(zip(self.plan.shares, self.plan.tokens_per_byte)):
            nbytes = int(self.plan.documents[s].nbytes[self._next_index(s)])
            taken = tpb * self.state[s][2] + self.state[s][3]
            finish = (taken + tpb * nbytes + 1.0) / share
            if finish < best_finish:
                best, best_finish = s, finish
        return best

    def next(self) -> Pick:
        before = self.snapshot()
        s = self._choose()
        index = self._next_index(s)
        st = self.state[s]
        st[1] += 1
        if st[1] == self.share_len[s]:
            st[0], st[1] = st[0] + 1, 0
        st[2] += int(self.plan.documents[s].nbytes[index])
        st[3] += 1
        return Pick(s, index, before)
