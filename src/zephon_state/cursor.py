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
from typing import Any, Callable, Mapping

from .errors import StateError, short


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
        """Validate a cursor read from a checkpoint (untrusted input): the right keys, each a
        count in ``[0, 2**53)``. ``LaneSetup.check_cursor`` then checks it against the plan."""

        def bad(why: str) -> StateError:
            return cursor_error(lane, why)

        if not isinstance(value, Mapping):
            raise bad(f"expected a dict, got {type(value).__name__}")
        if set(value) != _KEYS:
            raise bad(f"its keys are {short(sorted(map(str, value)))}, expected {sorted(_KEYS)}")
        for key in ("window", "emitted", "sequences"):
            _check_count(value[key], repr(key), bad)
        sources = value["sources"]
        if not isinstance(sources, list) or len(sources) != n_sources:
            raise bad(f"'sources' must list {n_sources} source states, got {short(sources)}")
        parsed = []
        for i, s in enumerate(sources):
            if not isinstance(s, list) or len(s) != 4:
                raise bad(f"'sources[{i}]' must be 4 counts [epoch, index, offset, tokens], got {short(s)}")
            for name, x in zip(SOURCE_FIELDS, s):
                _check_count(x, f"'sources[{i}].{name}'", bad)
            parsed.append(SourceState(*s))
        return cls(tuple(parsed), value["window"], value["emitted"], value["sequences"])


SOURCE_FIELDS = ("epoch", "index", "offset", "tokens")
COUNT_LIMIT = 1 << 53  # far beyond any real run; larger JSON numbers lose precision in many readers
_KEYS = {"window", "emitted", "sequences", "sources"}


def cursor_error(lane: int, why: str) -> StateError:
    return StateError(f"cursor of lane {lane} is invalid: {why}; it was not written by this pipeline and data")


def _check_count(value: Any, name: str, bad: Callable[[str], StateError]) -> None:
    if type(value) is not int or not 0 <= value < COUNT_LIMIT:
        raise bad(f"{name} must be an int in [0, 2**53), got {short(value)}")
