"""The reshard command and the pieces the CLI's commands share: a committed step picked
and read (with a hint when there is none), each tensor's layout for a target world
(``--layout``, ``--mesh``), and the offline rewrite of a step for another world size.

Below both ``cli.py`` and ``convert/cli.py`` (``import-dcp --world`` reshards through it),
so neither imports the other."""
from __future__ import annotations

import argparse
import fnmatch
import math
import os
import re
import uuid
from typing import Any

from flexckpt.catalog import committed_steps, read_manifest
from flexckpt.checkpointer import Checkpointer
from flexckpt.convert.offline import OfflineSave
from flexckpt.errors import CheckpointError
from flexckpt.format.manifest import Manifest
from flexckpt.load.pending import subset_load
from flexckpt.restore_plan import restore_plan
from flexckpt.state.dtypes import itemsize
from flexckpt.state.values import ByLane, PerRank
from flexckpt.storage import Storage
from flexshard import BlockShard, HybridShard, Layout, MeshLayout, Owned, Replicate, Shard, ShardedTensor, assign_owners, part_of
from flexshard.world import ranks


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def no_checkpoint(storage: Storage) -> CheckpointError:
    """"Nothing here", with a hint when URL is a flextrain run folder (its checkpoints are in ckpt/)."""
    msg = f"no committed checkpoint under {storage.url}"
    storage.probe()  # an object store's missing bucket is named, not read as "nothing here"
    if storage.local and not os.path.exists(storage.root):  # a typo reads as "no checkpoint" otherwise
        return CheckpointError(f"{msg}: {storage.root} does not exist; check the path (for a flextrain run, "
                               f"RUN_DIR/ckpt)")
    try:
        if committed_steps(Storage(storage.url.rstrip("/") + "/ckpt")):
            msg += f"; it looks like a flextrain run folder: pass {storage.url.rstrip('/')}/ckpt"
    except (OSError, CheckpointError):
        pass
    return CheckpointError(msg)


def pick_step(storage: Storage, step: int | None) -> int:
    steps = committed_steps(storage)
    if not steps:
        raise no_checkpoint(storage)
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f"step {step} is not committed under {storage.url}; committed: {steps}")
    return step


def read_step(storage: Storage, step: int, newest: bool) -> Any:
    """The step's manifest; when the newest step (taken by default) is damaged, the error
    names the step before it."""
    try:
        return read_manifest(storage, step)
    except CheckpointError as e:
        older = [s for s in committed_steps(storage) if s < step] if newest else []
        if not older:
            raise
        raise CheckpointError(f"{e}; pass --step {older[-1]} for the step before it") from None


_MESH_KIND = re.compile(r"^(R|S\d+|SS\d+:\d+)(,(R|S\d+|SS\d+:\d+))*$")


def parse_mesh(text: str) -> tuple[int, ...]:
    """``fsdp=2,tp=2`` (names are for the reader) or ``2,2``: the mesh shape."""
    try:
        sizes = tuple(int(part.rsplit("=", 1)[-1]) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(k < 1 for k in sizes) or len(sizes) > 8:
        raise argparse.ArgumentTypeError(f"--mesh wants NAME=SIZE,... or SIZE,... (1 to 8 sizes >= 1), got {text!r}")
    return sizes


def _parse_kind(kind: str, mesh: tuple[int, ...] | None = None) -> Any:
    if _MESH_KIND.match(kind):
        codes = tuple(kind.split(","))
        if mesh is None or len(mesh) != len(codes):
            raise CheckpointError(f"layout {kind!r} has {len(codes)} placements; give a target mesh of as many dims "
                                  f"(--mesh NAME=SIZE,...){'' if mesh is None else f', not {mesh}'}")
        return lambda name, world, owners: MeshLayout(mesh, codes)
    try:
        if kind == "replicate":
            return lambda name, world, owners: Replicate()
        if kind == "shard":
            return lambda name, world, owners: Shard(0)
        if kind == "owned":
            return lambda name, world, owners: Owned(owners[name])
        if kind == "block" or kind.startswith("block:"):
            size = int(kind.split(":")[1]) if ":" in kind else 32
            return lambda name, world, owners: BlockShard(size)
        if kind.startswith("hybrid:") and kind.count(":") <= 2:
            parts = [int(p) for p in kind.split(":")[1:]]
            return lambda name, world, owners: HybridShard(parts[0], parts[1] if len(parts) > 1 else None)
    except ValueError:  # a size that is not an integer
        pass
    raise CheckpointError(f"unknown layout kind {kind!r}: use replicate, shard, owned, block[:SIZE], hybrid:GROUP[:BLOCK] "
                          "(SIZE, GROUP and BLOCK are integers) or placements on --mesh such as S0,S1")


def target_layouts(m: Manifest, world: int, overrides: list[str], mesh: tuple[int, ...] | None = None) -> dict[str, Layout]:
    """Each tensor's layout at ``world``: its saved kind unless a --layout pattern says
    otherwise; placements (``S0,S1``) lay a tensor out on ``mesh``."""
    if mesh is not None and math.prod(mesh) != world:
        raise CheckpointError(f"--mesh {mesh} spans {ranks(math.prod(mesh))}, --world is {world}; make them agree")
    rules = []
    for rule in overrides:
        if "=" not in rule:
            raise CheckpointError(f"--layout wants PATTERN=KIND, got {rule!r}")
        pattern, kind = rule.rsplit("=", 1)
        _parse_kind(kind, mesh)
        if not any(fnmatch.fnmatchcase(name, pattern) for name in m.tensors):
            raise CheckpointError(f"--layout {rule!r} matches no tensor of step {m.step} (tensors: "
                                  f"{', '.join(sorted(m.tensors)[:4])}{' ...' if len(m.tensors) > 4 else ''})")
        rules.append((pattern, kind))
    kinds: dict[str, str] = {}
    for name, t in m.tensors.items():
        kind = {"Replicate": "replicate", "Shard": "shard", "Owned": "owned"}.get(type(t.layout).__name__)
        if isinstance(t.layout, BlockShard):
            kind = f"block:{t.layout.block_size}"
        if isinstance(t.layout, HybridShard):
            kind = f"hybrid:{t.layout.group_size}" + (f":{t.layout.block_size}" if t.layout.block_size else "")
        if isinstance(t.layout, MeshLayout):
            kind = ",".join(t.layout.placements)
        for pattern, k in rules:
            if fnmatch.fnmatchcase(name, pattern):
                kind = k
        kinds[name] = kind
    owned = {n: m.tensors[n].numel * itemsize(m.tensors[n].dtype) for n, k in kinds.items() if k == "owned"}
    owners = assign_owners(owned, world)
    out = {}
    for n, k in kinds.items():
        saved = m.tensors[n].layout
        on_saved_mesh = mesh is None and isinstance(saved, MeshLayout) and k == ",".join(saved.placements)
        if on_saved_mesh and saved.size != world:
            raise CheckpointError(f"tensor {n!r} is saved on mesh {saved.mesh}, which does not span {ranks(world)}; give "
                             f"the target mesh (--mesh NAME=SIZE,...) or a --layout for it")
        out[n] = saved if on_saved_mesh else _parse_kind(k, mesh)(n, world, owners)
    return out


def checked_layouts(m: Manifest, world: int, overrides: list[str], mesh: tuple[int, ...] | None = None) -> dict[str, Layout]:
    """``target_layouts``, each tried on its tensor's shape at ``world`` (a mesh layout on
    every rank: a placement may leave only some ranks a strided set)."""
    try:
        layouts = target_layouts(m, world, overrides, mesh)
        for name, t in m.tensors.items():
            for r in range(world) if isinstance(layouts[name], MeshLayout) else (0,):
                part_of(layouts[name], t.shape, world, r)
    except ValueError as e:  # e.g. a HybridShard group that does not divide --world
        raise CheckpointError(f"cannot lay step {m.step}'s tensors out on {ranks(world)}: {e}") from None
    return layouts


def cmd_reshard(args: argparse.Namespace) -> int:
    src = Storage(args.src)
    step = pick_step(src, args.step)
    m = read_step(src, step, args.step is None)
    world = args.world
    layouts = checked_layouts(m, world, args.layout, getattr(args, "mesh", None))
    budget = getattr(args, "budget", None)  # import-dcp --world --budget-mib: one rank's share at a time, bounded
    if budget is not None:
        holds = [r.holds for r in restore_plan(m, layouts, world).ranks]
        big = max(range(world), key=holds.__getitem__)
        if holds[big] > budget:
            raise CheckpointError(
                f"--budget-mib {budget >> 20}: with --world {world} target rank {big} holds {_mib(holds[big])} (a rank's "
                f"share is read and written whole); raise --budget-mib to {-(-holds[big] >> 20)} or give a larger --world")
    out = OfflineSave(args.dst)  # a failure of any rank fails the whole at once, and removes what it wrote
    writable_folder(args.dst)
    run_id = uuid.uuid4().hex[:16]
    same_world = world == m.world_size
    if m.per_rank and not same_world:
        print(f"note: per-rank values {sorted(m.per_rank)} cannot move to another world size and are dropped")
    writers: list[Checkpointer] = []
    try:
        writers += [Checkpointer(args.dst, rank=r, world_size=world, run_id=run_id, compression=args.compression)
                    for r in range(world)]
        for r in reversed(range(world)):  # a group leader after its group (it gathers their records), rank 0 last
            state: dict[str, Any] = {}
            for name, t in m.tensors.items():
                _put(state, name, ShardedTensor.empty(t.shape, layouts[name], t.dtype, rank=r, world_size=world))
            for name in m.plain:
                _put(state, name, None)
            for name in m.lanes:  # lanes are not tied to ranks: all of them go to rank 0
                _put(state, name, ByLane())
            if r == 0:  # nor are bytes values (addressed by key)
                for name in m.keyed:
                    _put(state, name, b"")
            if same_world:
                for name in m.per_rank:
                    _put(state, name, PerRank(None))
            with Checkpointer(args.src, rank=r, world_size=world, run_id="reshard", read_only=True) as reader:
                with subset_load():  # per-rank values at another world size: noted above
                    reader.load(state, step=step, strict=False)
            for name in m.lanes:
                if r != 0:
                    _get(state, name).values = {}
            h = writers[r].save(step, state)
            if budget is not None and r != 0:
                writers[r].wait()  # written: its buffers are free before the next rank's share is read
            else:
                h.wait_staged()
            out.started(h)
            held = sum(t.local.numel() * t.local.element_size() for t in _tensors(state))
            print(f"  rank {r}/{world}: {_mib(held)} staged")
        out.result()
    except BaseException:
        for w in writers:
            w.close()
        out.remove()
        raise
    finally:
        for w in writers:
            w.close()
    print(f"wrote step {step} for {ranks(world)} to {args.dst}")
    return 0


def writable_folder(url: str) -> None:
    """A local destination is created and checked before any work (an object store is
    written to as it is: creating its folder could create a bucket)."""
    storage = Storage(url)
    if storage.local:
        os.makedirs(storage.root, exist_ok=True)
        if not os.access(storage.root, os.W_OK | os.X_OK):
            raise CheckpointError(f"{url} is not writable; choose a writable place")


def _tensors(state: dict) -> list[ShardedTensor]:
    out = []
    for v in state.values():
        if isinstance(v, dict):
            out += _tensors(v)
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def _put(state: dict, name: str, value: Any) -> None:
    parts = [p.replace("%2F", "/").replace("%25", "%") for p in name.split("/")]
    for p in parts[:-1]:
        state = state.setdefault(p, {})
    state[parts[-1]] = value


def _get(state: dict, name: str) -> Any:
    for p in name.split("/"):
        state = state[p.replace("%2F", "/").replace("%25", "%")]
    return state
