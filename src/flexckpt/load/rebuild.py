"""A saved state rebuilt without a template (``Checkpointer.load_dict``): every tensor read
whole onto one device, plain, bytes, per-lane and per-rank values decoded, all put back in
the dicts, lists and tuples of the manifest's container tree (:mod:`flexckpt.state.tree`).

What comes back: dicts (str and int keys, in the saved order; a dict subclass, an
``OrderedDict`` or a module's state dict, as a ``dict``), lists, tuples, the plain values of
:mod:`flexckpt.state.plain`, ``bytes``, and tensors: plain ``torch.Tensor`` (a ``Parameter``, a
DTensor or a ShardedTensor comes back as the whole tensor, contiguous, without
``requires_grad``), each its own storage (tensors that shared storage when saved, tied
weights, come back as equal, separate tensors). ``ByLane`` and ``PerRank`` values come back
as those objects (a per-rank value only at the saved world size). A manifest without a tree
(before version 4, or a fast-tier save) gives nested dicts of str keys.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from flexckpt.errors import ManifestError, StructureMismatch
from flexckpt.format.manifest import MAX_ZSTD_RATIO, Manifest
from flexckpt.format.names import step_dir
from flexckpt.load.pending import PendingLoad, decode_per_rank, read_bytes_values, subset_load
from flexckpt.state.dtypes import itemsize
from flexckpt.state.plain import decode_plain
from flexckpt.state.structure import Walk
from flexckpt.state.tree import assemble, name_path, put, walk_tree
from flexckpt.state.values import ByLane, PerRank
from flexckpt.storage import Storage

_CPU = torch.device("cpu")


def load_dict(storage: Storage, manifest: Manifest, rank: int, world_size: int, device: torch.device,
              gone: Callable[[str], bool] | None, threads: int) -> dict:
    keep = (lambda n: True) if gone is None else (lambda n: not gone(n))
    values: dict[str, Any] = {}
    step = manifest.step
    if manifest.tree is not None:
        saved = set(_saved_order(manifest))
        lost = next((path for name, path in walk_tree(manifest.tree) if name not in saved), None)
        if lost is not None:
            raise ManifestError(f"checkpoint step {step}: its container tree holds {lost!r}, which the manifest does "
                                f"not save; the manifest is damaged")
    for name, raw in manifest.plain.items():
        if keep(name):
            try:
                values[name] = decode_plain(raw)
            except (ValueError, RecursionError) as e:
                raise ManifestError(f"checkpoint step {step}: plain value {_shown(manifest, name)} cannot be loaded: "
                                    f"{str(e)[:300]}") from None
    values.update(read_bytes_values(storage, manifest, [n for n in manifest.keyed if keep(n)]))
    values.update({n: ByLane(dict(v)) for n, v in manifest.lanes.items() if keep(n)})
    per_rank = [n for n in manifest.per_rank if keep(n)]
    if per_rank:
        if manifest.world_size != world_size:
            raise StructureMismatch(
                f"per-rank value {_shown(manifest, per_rank[0])} of checkpoint step {step} belongs to the ranks of "
                f"world size {manifest.world_size}, and this is world size {world_size}; leave it out with "
                f"exclude=({_path(manifest, per_rank[0])!r},)")
        saved = manifest.rank_values(rank)
        for n in per_rank:
            if n not in saved:
                raise ManifestError(f"checkpoint step {step} has no per-rank value {n!r} for rank {rank}")
            values[n] = PerRank(decode_per_rank(saved[n], n), restored=True)
    values.update(_read_tensors(storage, manifest, [n for n in manifest.tensors if keep(n)], device, threads))
    out = assemble(manifest.tree, values, gone) if manifest.tree is not None else {}
    for name in [n for n in _saved_order(manifest) if n in values]:  # leaves the tree does not hold
        put(out, name_path(name), values.pop(name), f"checkpoint step {step}: value")
    return out


def _read_tensors(storage: Storage, manifest: Manifest, names: list[str], device: torch.device,
                  threads: int) -> dict[str, torch.Tensor]:
    """The tensors ``names``, whole, read as rank 0 of a world of 1 would (each byte range
    once, verified), onto ``device``. Allocated only once the data files are found to be
    able to hold them (a manifest is untrusted: its shapes may claim terabytes)."""
    want = sum(manifest.tensors[n].numel * itemsize(manifest.tensors[n].dtype) for n in names)
    held = _backed_bytes(storage, manifest)
    if want > held:
        raise ManifestError(f"checkpoint step {manifest.step}: its tensors claim {want} bytes, and its data files "
                            f"can hold at most {held}; the checkpoint is damaged")
    w = Walk()
    for name in names:
        t = manifest.tensors[name]
        w.key.append((name, t.dtype, t.shape, _CPU))
        w.tensors.append(torch.empty(t.shape, dtype=t.dtype))
    pending = PendingLoad(storage, manifest, w, 0, 1, strict=False)
    pending.read(threads)
    with subset_load():  # the values it leaves out are decoded by load_dict itself: no warning
        pending.apply()
    return {name: t if device == _CPU else t.to(device) for name, t in zip(names, w.tensors)}


def _backed_bytes(storage: Storage, manifest: Manifest) -> int:
    """The most raw bytes the data files hold, as their sizes on storage vouch."""
    if manifest.version >= 2:
        for rank, entry in enumerate(manifest.ranks):
            if entry.stored_nbytes:
                manifest.files.table(rank)  # type: ignore[attr-defined]  # checks the data file's size too
        stored, packed = manifest.stored_bytes, manifest.codec != "none"
    else:
        folder = step_dir(manifest.step)
        stored = sum(min(storage.size(f"{folder}/{name}"), sum(c.length for c in f.chunks))
                     for name, f in manifest.files.items())
        packed = any(c.codec != "none" for f in manifest.files.values() for c in f.chunks)
    return stored * (MAX_ZSTD_RATIO if packed else 1)


def _saved_order(manifest: Manifest) -> list[str]:
    return [*manifest.tensors, *manifest.plain, *manifest.keyed, *manifest.lanes, *manifest.per_rank]


def _path(manifest: Manifest, name: str) -> tuple:
    if manifest.tree is not None:
        for n, path in walk_tree(manifest.tree):
            if n == name:
                return path
    return name_path(name)


def _shown(manifest: Manifest, name: str) -> str:
    return repr(_path(manifest, name))
