"""What a restore on another world size will do, before any job starts: for target
layouts (per tensor) and a world size, each rank's held bytes, the bytes and requests it
reads and the memory it needs, and what happens to plain, per-lane and per-rank values.
Pure: built from a parsed manifest with the same read plan the load runs
(``read_plan.plan_requests``), so the predicted bytes equal
``Checkpointer.last_load_stats.bytes_read``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from flexckpt.format.manifest import Manifest
from flexckpt.load.pending import FETCH_BYTES  # the load's largest coalesced request: the same fetches
from flexckpt.load.read_plan import plan_requests
from flexckpt.state.dtypes import itemsize
from flexshard import Layout, part_of


@dataclass(frozen=True)
class RankRestore:
    """One target rank: ``holds`` bytes of tensors, ``reads`` stored bytes in ``requests``
    ranged reads of ``chunks`` chunks from ``files`` files; ``memory`` = ``holds`` plus the
    largest request (a compressed chunk is read into scratch before it is decoded)."""

    rank: int
    holds: int
    reads: int
    requests: int
    chunks: int
    files: int
    memory: int

    @property
    def read_ratio(self) -> float | None:
        return self.reads / self.holds if self.holds else None


@dataclass(frozen=True)
class TensorMove:
    name: str
    saved: dict
    target: dict

    @property
    def changes(self) -> bool:
        return self.saved != self.target


@dataclass(frozen=True)
class RestorePlan:
    step: int
    saved_world: int
    world: int
    ranks: tuple[RankRestore, ...]
    tensors: tuple[TensorMove, ...]
    plain: tuple[str, ...]       # the same on every rank: restored as they are
    lanes: tuple[str, ...]       # keyed by lane: every rank receives the union
    per_rank: tuple[str, ...]    # restored only at the saved world size
    keyed: tuple[str, ...] = ()  # bytes values, by key: each rank reads the keys its state holds

    @property
    def per_rank_restored(self) -> bool:
        return self.world == self.saved_world

    def to_json(self) -> dict:
        return {
            "step": self.step, "saved_world": self.saved_world, "world": self.world,
            "ranks": [r.__dict__ for r in self.ranks],
            "tensors": {t.name: {"saved": t.saved, "target": t.target} for t in self.tensors},
            "plain": list(self.plain), "lanes": list(self.lanes), "per_rank": list(self.per_rank),
            "per_rank_restored": self.per_rank_restored, "keyed": list(self.keyed),
        }


def restore_plan(manifest: Manifest, layouts: Mapping[str, Layout], world: int) -> RestorePlan:
    """The plan of restoring ``manifest`` on ``world`` ranks with ``layouts[name]`` for each
    saved tensor (every saved tensor needs one)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    missing = sorted(set(manifest.tensors) - set(layouts))
    if missing:
        raise ValueError(f"no target layout for saved tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    ranks = []
    for r in range(world):
        targets, held = [], 0
        for name, t in sorted(manifest.tensors.items()):
            rng = part_of(layouts[name], t.shape, world, r)
            if len(rng):
                targets.append((t, rng))
                held += len(rng) * itemsize(t.dtype)
        fetches = plan_requests(manifest, targets, FETCH_BYTES)
        biggest = max((f.length for f in fetches), default=0)
        ranks.append(RankRestore(r, held, sum(f.length for f in fetches), len(fetches),
                                 sum(f.stop - f.first for f in fetches), len({f.plan.file for f in fetches}),
                                 held + biggest))
    moves = tuple(TensorMove(n, t.layout.to_json(), layouts[n].to_json()) for n, t in sorted(manifest.tensors.items()))
    return RestorePlan(manifest.step, manifest.world_size, world, tuple(ranks), moves, tuple(sorted(manifest.plain)),
                       tuple(sorted(manifest.lanes)), tuple(sorted(manifest.per_rank)), tuple(sorted(manifest.keyed)))
