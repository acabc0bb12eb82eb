"""Ranks whose structures differ (pipeline stages): the union that the manifest holds.

Under pipeline parallelism no rank knows the other stages' keys. Each rank plans its own
writes from its own structure; rules 4 of :mod:`flexckpt.format.write_plan` make that plan equal to the
union's plan for that rank, as long as

* a tensor every rank writes by the world's rules (``Replicate``, ``Shard``, ``HybridShard``,
  a mesh spanning the world, ...) is in every rank's structure, the same everywhere;
* a tensor on a mesh spanning part of the world is in the structure of every rank of its
  mesh (a rank outside it may carry it too, holding nothing), the same wherever it is;
* plain values, lanes and per-rank values are named alike on every rank.

Those rules are checked here, on the committing rank, from one structure per fingerprint
(the records carry each structure once per group, the first time a rank saves it; see
:func:`flexckpt.save.commit.merge_records`), in O(tensors + ranks): never a collective. A
violation fails the save naming the key. Pure functions.
"""
from __future__ import annotations

from typing import Any

from flexckpt.errors import SaveError
from flexckpt.format.write_plan import part_of_world
from flexckpt.state.dtypes import dtype_from_name
from flexckpt.state.structure import TensorSpec, fingerprint
from flexshard.layout import layout_from_json


def union_structure(
    entries: dict[int, list], step: int, own_fp: str, own: dict, structures: dict[str, dict], world_size: int,
) -> tuple[list[TensorSpec], dict, str] | None:
    """``(specs, structure, fingerprint)`` of the union of the ranks' structures, or None
    when every rank saved ``own`` (rank 0's). SaveError naming the key when the ranks'
    structures cannot make one checkpoint."""
    fp_of = {r: e[0] for r, e in entries.items()}
    fps = set(fp_of.values())
    if fps == {own_fp}:
        return None
    known = {**structures, own_fp: own}
    ranks_of: dict[str, list[int]] = {}
    for r in sorted(fp_of):
        ranks_of.setdefault(fp_of[r], []).append(r)
    missing = [fp for fp in fps if fp not in known]
    if missing:
        r = ranks_of[missing[0]][0]
        raise SaveError(
            f"step {step}: rank {r} saved a different state structure than rank 0 (its structure hashes to "
            f"{missing[0]}, rank 0's to {own_fp}), and that structure is not in the records (a rank sends it only "
            f"while it holds a tensor on a mesh spanning part of the world); ranks may differ only by tensors on "
            f"meshes of their own (a pipeline stage's DTensors)"
        )
    first = {fp: ranks_of[fp][0] for fp in fps}
    tensors: dict[str, tuple[dict, list[str]]] = {}  # name -> (its json, fingerprints holding it)
    for fp in sorted(fps, key=first.get):
        for t in known[fp].get("tensors", []):
            have = tensors.get(t["name"])
            if have is None:
                tensors[t["name"]] = (t, [fp])
            elif have[0] != t:
                a, b = have[0].get("layout", {}), t.get("layout", {})
                if _same_but_ranks(a, b) and (have[0]["dtype"], have[0]["shape"]) == (t["dtype"], t["shape"]):
                    raise SaveError(
                        f"step {step}: tensor {t['name']!r} is held on {a.get('mesh')} meshes of different ranks by rank "
                        f"{first[have[1][0]]} and rank {first[fp]} (data-parallel replicas of one mesh, DDP x TP): a "
                        f"tensor must live on one mesh; put it on a mesh spanning the replicas (e.g. (dp_replicate, tp) "
                        f"with Replicate() on dp_replicate) before saving"
                    )
                raise SaveError(
                    f"step {step}: tensor {t['name']!r} differs between ranks that hold it: rank {first[have[1][0]]} has "
                    f"{_show(have[0])}, rank {first[fp]} has {_show(t)}; a key must have one dtype, shape and layout "
                    f"on every rank that holds it"
                )
            else:
                have[1].append(fp)
    for kind in ("plain", "lanes", "per_rank"):
        base = set(own.get(kind, []))
        for fp in fps:
            other = set(known[fp].get(kind, []))
            if other != base:
                odd = sorted(base ^ other)
                raise SaveError(
                    f"step {step}: {kind} value {odd[0]!r} is on rank {first[fp] if odd[0] in other else 0} but not on "
                    f"rank {0 if odd[0] in other else first[fp]}; plain values, lanes and per-rank values must be named "
                    f"alike on every rank (pipeline stages may differ only by tensors on their own meshes)"
                )
    specs = []
    checked: set[tuple] = set()
    for name in sorted(tensors):
        t, holders = tensors[name]
        layout = layout_from_json(t["layout"])
        spec = TensorSpec(name, dtype_from_name(t["dtype"]), tuple(t["shape"]), layout)
        specs.append(spec)
        if not part_of_world(layout, world_size):
            if len(holders) != len(fps):
                lack = min(first[fp] for fp in fps - set(holders))
                raise SaveError(
                    f"step {step}: tensor {name!r} ({layout}) is written by the whole world's rules but rank {lack} "
                    f"does not hold it; a tensor held by part of the world (a pipeline stage's) must be a DTensor on "
                    f"that part's mesh (or a ShardedTensor with a MeshLayout of its ranks)"
                )
            continue
        key = (layout.mesh, layout.ranks, layout.offset, frozenset(holders))
        if key in checked:
            continue
        checked.add(key)
        for r in layout.rank_table():
            if fp_of.get(r) not in key[3]:
                raise SaveError(
                    f"step {step}: tensor {name!r} lives on {layout} (ranks {layout.rank_table()[:16]}), but rank {r} of "
                    f"that mesh does not hold it, so its piece would never be written; give every rank of the mesh "
                    f"the tensor"
                )
    structure = {"tensors": [tensors[n][0] for n in sorted(tensors)], "plain": sorted(own.get("plain", [])),
                 "lanes": sorted(own.get("lanes", [])), "per_rank": sorted(own.get("per_rank", []))}
    return specs, structure, fingerprint(structure)


def has_partial(structure: dict, world_size: int) -> bool:
    """Whether ``structure`` (canonical JSON) holds a tensor on a mesh spanning part of the world."""
    for t in structure.get("tensors", []):
        layout = t.get("layout") if isinstance(t, dict) else None
        if isinstance(layout, dict) and layout.get("kind") == "mesh":
            try:
                if part_of_world(layout_from_json(layout), world_size):
                    return True
            except ValueError:
                return True  # malformed: let the union name it
    return False


def _same_but_ranks(a: Any, b: Any) -> bool:
    keys = ("kind", "mesh", "placements")
    return isinstance(a, dict) and isinstance(b, dict) and a.get("kind") == "mesh" and all(a.get(k) == b.get(k) for k in keys)


def _show(t: dict[str, Any]) -> str:
    return f"dtype {t.get('dtype')} shape {t.get('shape')} layout {t.get('layout')}"


__all__ = ["has_partial", "union_structure"]
