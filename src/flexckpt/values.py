"""Values that are not the same on every rank, marked on purpose.

* :class:`ByLane` - values keyed by lane (a data pipeline's cursors). Each rank
  contributes the lanes it hosts; the manifest holds the union; on load every rank
  receives the whole union (``.values`` is replaced in place) and takes what it hosts now.
* :class:`PerRank` - a value private to each rank (an RNG state). Stored per rank and
  restored only when the world size is the same; at another world size it is left as it
  is (code that resumes at another size derives such values from seed, step and rank).

Neither enters the structure fingerprint, so they may differ between ranks freely.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ByLane:
    """A mapping ``lane id (str) -> JSON value`` holding this rank's lanes."""

    values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.values, dict):
            raise TypeError(f"ByLane needs a dict of lane -> value, got {type(self.values).__name__}")
        for key in self.values:
            if not isinstance(key, str):
                raise TypeError(f"ByLane keys must be str lane ids, got {key!r}; use str(lane)")


@dataclass
class PerRank:
    """A value that belongs to this rank only: JSON data, or a CPU tensor (an RNG state)."""

    value: Any = None
    restored: bool = field(default=False, compare=False)
