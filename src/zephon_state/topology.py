"""Lanes, the global batch and data parallelism: who hosts which lanes, and the checks that
keep every global batch identical for every data-parallel size dividing the lane count."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """``lanes`` (L) streams, ``global_batch`` (G) rows per step, microbatches of
    ``microbatch`` rows, on data-parallel rank ``rank`` of ``size`` (D).

    Each lane gives G/L rows per step; rank r hosts lanes [r*L/D, (r+1)*L/D) and cuts its
    microbatches from its lanes' rows in lane order."""

    lanes: int
    global_batch: int
    microbatch: int
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        for name in ("lanes", "global_batch", "microbatch", "size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive int")
        if type(self.rank) is not int or not 0 <= self.rank < self.size:
            raise ConfigError(f"rank={self.rank!r} must be an int in [0, {self.size}) for data-parallel size {self.size}")
        L, G, D, m = self.lanes, self.global_batch, self.size, self.microbatch
        if L % D:
            raise ConfigError(
                f"lanes={L} is not divisible by the data-parallel size {D}: every rank must host the "
                f"same number of lanes. Use a lane count that is a multiple of {D} (e.g. {math.lcm(L, D)}; "
                f"a new lane count is a new data plan) or a data-parallel size that divides {L}"
            )
        if G % L:
            raise ConfigError(
                f"global_batch_size={G} is not divisible by lanes={L}: each lane gives G/L rows per "
                f"step. Use a global batch that is a multiple of {L} (e.g. {-(-G // L) * L}) or a lane "
                f"count that divides {G}"
            )
        local = G // D
        if local % m:
            raise ConfigError(
                f"the local batch global_batch_size/size = {G}/{D} = {local} rows is not divisible by "
                f"microbatch_size={m}; use a microbatch size that divides {local} "
                f"(e.g. {math.gcd(local, m)})"
            )

    @property
    def per_lane(self) -> int:
        """Rows each lane contributes to one global batch."""
        return self.global_batch // self.lanes

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.size

    @property
    def microbatches(self) -> int:
        """Microbatches per step on each rank."""
        return self.local_batch // self.microbatch

    @property
    def hosted(self) -> range:
        """The lanes this rank hosts, in order."""
        k = self.lanes // self.size
        return range(self.rank * k, (self.rank + 1) * k)
