"""Lane cursors: the small, JSON-serialisable state of one lane.

A lane's state is where its input stood the last time its pack and shuffle buffers were empty
(the start of its current window), the window index (which fixes the window's shuffle order
and token quotas) and how many rows of that window the caller has consumed. Per source, the
input position is the document being read (epoch, index in the lane's share of that epoch),
how many of its tokens were already emitted, and the source's tokens emitted in total. The
size depends on the number of sources, never on buffer sizes. Restoring re-reads the window
from there and skips ``emitted`` rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import StateError


@dataclass(frozen=True)
class SourceState:
    """Where a lane stands in one source."""

    epoch: int = 0
    index: int = 0
    offset: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class LaneCursor:
    """One lane's resumable position (see the module docstring)."""

    sources: tuple[SourceState, ...]
    window: int = 0
    emitted: int = 0
    sequences: int = 0

    @classmethod
    def start(cls, n_sources: int) -> "LaneCursor":
        return cls(tuple(SourceState() for _ in range(n_sources)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "emitted": self.emitted,
            "sequences": self.sequences,
            "sources": [[s.epoch, s.index, s.offset, s.tokens] for s in self.sources],
        }

    @classmethod
    def from_dict(cls, value: Any, n_sources: int, lane: int) -> "LaneCursor":
        """Validate a cursor read from a checkpoint (untrusted input)."""

        def bad(why: str) -> StateError:
            return StateError(f"cursor of lane {lane} is invalid: {why}; it was not written by this pipeline version")

        if not isinstance(value, Mapping):
            raise bad(f"expected a dict, got {type(value).__name__}")
        for key in ("window", "emitted", "sequences"):
            v = value.get(key)
            if type(v) is not int or v < 0:
                raise bad(f"{key!r} must be a non-negative int, got {v!r}")
        sources = value.get("sources")
        if not isinstance(sources, list) or len(sources) != n_sources:
            raise bad(f"'sources' must list {n_sources} source states, got {sources!r}")
        parsed = []
        for s in sources:
            if not isinstance(s, list) or len(s) != 4 or any(type(x) is not int or x < 0 for x in s):
                raise bad(f"a source state must be 4 non-negative ints [epoch, index, offset, tokens], got {s!r}")
            parsed.append(SourceState(*s))
        return cls(tuple(parsed), value["window"], value["emitted"], value["sequences"])
