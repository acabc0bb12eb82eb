"""Values that are not the same on every rank.

* ``bytes`` leaves - opaque values addressed by their key (their name in the state), not
  by rank: a data loader's state per data-parallel replica, ``{"dp_rank_<d>": bytes}``.
  Each rank saves the keys it holds; a key held by several ranks (the TP/PP peers of one
  replica) is stored once, and its copies must be equal, else the save fails naming it.
  On load each rank gets the keys it holds now, at any world size; a key it holds that no
  rank saved stops the load (opt out per key with ``load(..., exclude=("data/*",))``).
  The bytes are never unpickled or parsed by flexckpt; at most MAX_BYTES_VALUE each.
* :class:`ByLane` - values keyed by lane (a data pipeline's cursors). Each rank
  contributes the lanes it hosts (a lane hosted by several ranks: equal copies, stored
  once); the manifest holds the union; on load every rank receives the whole union
  (``.values`` is replaced in place) and takes what it hosts now.
* :class:`PerRank` - a value private to each rank (an RNG state). Stored per rank and
  restored only when the world size is the same; at another world size the load stops
  naming it (code that resumes at another size derives such values from seed, step and
  rank, and loads with ``exclude=`` naming them).

None of these enters the structure fingerprint, so they may differ between ranks freely.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_BYTES_VALUE = 16 << 20  # bytes of one ``bytes`` value: they travel through the save's records


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
