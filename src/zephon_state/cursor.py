"""Lane cursors: the small, JSON-serialisable state of one lane.

A lane's state is where its input stood the last time its pack and shuffle buffers were empty
(the start of its current window), the window index (which fixes the window's shuffle order
and token quotas) and how many rows of that window the caller has consumed. Per source, the
input position is the document being read (epoch, index in the lane's share of that epoch),
how many of its tokens were already emitted, the source's tokens emitted in total, and a
resume point inside the document: the character ``char`` where the part of the document being
read starts (a cut where the text from there tokenizes to the whole document's tokens from
``base`` on; both 0 at a document start). The size depends on the number of sources, never
on buffer sizes. Restoring tokenizes the document from ``char``, skips ``offset - base``
tokens, re-reads the window from there and skips ``emitted`` rows.

Format: version 2 writes ``"version": 2`` and six counts per source; a version-1 cursor (no
``version`` key, four counts ``[epoch, index, offset, tokens]``) still loads, with its resume
point at the document start, and resumes identically.
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
    char: int = 0
    base: int = 0


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
            "version": VERSION,
            "window": self.window,
            "emitted": self.emitted,
            "sequences": self.sequences,
            "sources": [[s.epoch, s.index, s.offset, s.tokens, s.char, s.base] for s in self.sources],
        }

    @classmethod
    def from_dict(cls, value: Any, n_sources: int, lane: int) -> "LaneCursor":
        """Validate a cursor read from a checkpoint (untrusted input): the right keys, each a
        count in ``[0, 2**53)``. ``LaneSetup.check_cursor`` then checks it against the plan."""

        def bad(why: str) -> StateError:
            return cursor_error(lane, why)

        if not isinstance(value, Mapping):
            raise bad(f"expected a dict, got {type(value).__name__}")
        version = value.get("version", 1)
        if version not in (1, VERSION) or type(version) is not int:
            raise bad(f"'version' is {short(version)}; this pipeline reads cursor versions 1 and {VERSION}")
        keys = _KEYS | {"version"} if version == VERSION else _KEYS
        if set(value) != keys:
            raise bad(f"its keys are {short(sorted(map(str, value)))}, expected {sorted(keys)}")
        fields = SOURCE_FIELDS if version == VERSION else SOURCE_FIELDS[:4]
        for key in ("window", "emitted", "sequences"):
            _check_count(value[key], repr(key), bad)
        sources = value["sources"]
        if not isinstance(sources, list) or len(sources) != n_sources:
            raise bad(f"'sources' must list {n_sources} source states, got {short(sources)}")
        parsed = []
        for i, s in enumerate(sources):
            if not isinstance(s, list) or len(s) != len(fields):
                raise bad(f"'sources[{i}]' must be {len(fields)} counts [{', '.join(fields)}], got {short(s)}")
            for name, x in zip(fields, s):
                _check_count(x, f"'sources[{i}].{name}'", bad)
            state = SourceState(*s)
            if state.base > state.offset or (state.char == 0) != (state.base == 0):
                raise bad(f"'sources[{i}]' resumes at char {state.char}, token {state.base}, but a resume point "
                          f"is both 0 (the document start) or both positive with the token at most offset {state.offset}")
            parsed.append(state)
        return cls(tuple(parsed), value["window"], value["emitted"], value["sequences"])


VERSION = 2
SOURCE_FIELDS = ("epoch", "index", "offset", "tokens", "char", "base")
COUNT_LIMIT = 1 << 53  # far beyond any real run; larger JSON numbers lose precision in many readers
_KEYS = {"window", "emitted", "sequences", "sources"}


def cursor_error(lane: int, why: str) -> StateError:
    return StateError(f"cursor of lane {lane} is invalid: {why}; it was not written by this pipeline and data")


def _check_count(value: Any, name: str, bad: Callable[[str], StateError]) -> None:
    if type(value) is not int or not 0 <= value < COUNT_LIMIT:
        raise bad(f"{name} must be an int in [0, 2**53), got {short(value)}")
