"""What a committed checkpoint holds, for tools that read it through ``Checkpointer``
(converters, inspection): tensor names with dtype, global shape and saved layout, plain
values, and the names of per-lane and per-rank values. Nothing about files or chunks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flexckpt.commit import read_manifest
from flexckpt.storage import Storage
from flexckpt.structure import decode_plain
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
    tensors: dict[str, TensorInfo]  # by name ("/"-joined keys, escaped as in the walk)
    plain: dict[str, Any]  # decoded plain values
    lanes: list[str]  # names of ByLane values
    per_rank: list[str]  # names of PerRank values
    keyed: list[str] = field(default_factory=list)  # names of bytes values (addressed by key)


def read_contents(storage: Storage, step: int) -> Contents:
    m = read_manifest(storage, step)
    return Contents(
        step=m.step,
        world_size=m.world_size,
        tensors={n: TensorInfo(t.dtype, tuple(t.shape), t.layout) for n, t in sorted(m.tensors.items())},
        plain={n: decode_plain(v) for n, v in sorted(m.plain.items())},
        lanes=sorted(m.lanes),
        per_rank=sorted(m.per_rank),
        keyed=sorted(m.keyed),
    )
