"""What a committed checkpoint holds, for tools that read it through ``Checkpointer``
(converters, inspection): tensors with dtype, global shape and saved layout, plain values,
and the per-lane, per-rank and bytes values, each by its *key path*: the tuple of keys
from the state's top down (str and int; a list item by its index), so ``{"a/b": x}``
(``("a/b",)``) is told apart from ``{"a": {"b": x}}`` (``("a", "b")``). A checkpoint
saved before format version 4 (no container tree) gives str keys only. Nothing about
files or chunks.

A key path stands for an ``exclude=`` pattern as it is (``exclude=(("opt", "state"),)``);
:meth:`Contents.by_name` gives the same contents by the internal names that name
patterns match (``/``-joined, a ``/`` or ``%`` inside a key written ``%2F`` or ``%25``),
for tools that select by pattern."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flexckpt.catalog import read_manifest
from flexckpt.errors import ManifestError
from flexckpt.format.manifest import Manifest
from flexckpt.state.plain import decode_plain
from flexckpt.state.tree import KeyPath, name_path, walk_tree
from flexckpt.storage import Storage
from flexshard import Layout


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout  # as saved; a load may use any layout

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Contents:
    step: int
    world_size: int  # the world that saved it
    tensors: dict[KeyPath, TensorInfo]  # by key path (see the module doc)
    plain: dict[KeyPath, Any]  # decoded plain values
    lanes: list[KeyPath]  # key paths of ByLane values
    per_rank: list[KeyPath]  # key paths of PerRank values
    keyed: list[KeyPath] = field(default_factory=list)  # key paths of bytes values (addressed by key)
    names: dict[KeyPath, str] = field(default_factory=dict, repr=False, compare=False)  # internal names

    def by_name(self) -> "Contents":
        """The same contents keyed by internal names (what name patterns match)."""
        n = self.names
        return Contents(self.step, self.world_size, {n[p]: v for p, v in self.tensors.items()},
                        {n[p]: v for p, v in self.plain.items()}, sorted(n[p] for p in self.lanes),
                        sorted(n[p] for p in self.per_rank), sorted(n[p] for p in self.keyed),
                        {name: (name,) for name in n.values()})


def read_contents(storage: Storage, step: int) -> Contents:
    m = read_manifest(storage, step)
    paths = dict(walk_tree(m.tree)) if m.tree is not None else {}
    order = {name: i for i, name in enumerate(paths)}  # the saved order; leaves the tree lacks after, by name

    def keyed(names: Any) -> list[tuple[str, KeyPath]]:
        return [(n, paths.get(n) or name_path(n)) for n in sorted(names, key=lambda n: (order.get(n, len(order)), n))]

    tensors = keyed(m.tensors)
    plain = keyed(m.plain)
    lanes, per_rank, keyed_values = keyed(m.lanes), keyed(m.per_rank), keyed(m.keyed)
    return Contents(
        step=m.step,
        world_size=m.world_size,
        tensors={p: TensorInfo(m.tensors[n].dtype, tuple(m.tensors[n].shape), m.tensors[n].layout) for n, p in tensors},
        plain={p: _decoded(m, n, p) for n, p in plain},
        lanes=[p for _, p in lanes],
        per_rank=[p for _, p in per_rank],
        keyed=[p for _, p in keyed_values],
        names={p: n for n, p in (*tensors, *plain, *lanes, *per_rank, *keyed_values)},
    )


def _decoded(m: Manifest, name: str, path: KeyPath) -> Any:
    try:
        return decode_plain(m.plain[name])
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"checkpoint step {m.step}: plain value {path!r} cannot be read: {str(e)[:300]}") from None
