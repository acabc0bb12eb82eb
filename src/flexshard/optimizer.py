"""A sharded data-parallel optimizer (ZeRO style): Muon on 2-D matrices, AdamW on the rest,
with fp32 master weights and optimizer state only where each tensor's layout puts them.

Parameters stay replicated for forward and backward. One optimizer phase is::

    opt.reduce_gradients()  # each rank's .grad -> the reduced piece its layout gives it
    opt.step()              # update masters and state, then re-gather the parameters

Two placements, in the same code:

- ``"owned"`` (the point of flexshard): each Muon matrix is ``Owned`` by one rank, chosen
  by a balancer that weighs Newton-Schulz FLOPs. The owner gets the whole reduced
  gradient, keeps the whole momentum, orthogonalizes locally (no all-gather before the
  update, nobody else repeats the work) and the new matrix reaches the others in the
  parameter all-gather. Everything else is ``BlockShard(32)``, so an MXFP8 compute copy
  can be gathered block-aligned.
- ``"fsdp"`` (the baseline it is measured against): ``Shard(0)`` everywhere. Muon
  all-gathers each matrix's momentum update (as bf16: Newton-Schulz casts to bf16 first,
  so the bits are the same), every rank runs Newton-Schulz on every matrix and keeps its
  rows.

Fed the same reduced gradients, both produce bit for bit what single-process
``torch.optim.Muon`` / ``torch.optim.AdamW`` produce (same operations on the same numbers).

State (:meth:`state_dict`) is made of ``ShardedTensor``s whose ``.local`` are the live
state tensors, plus the step count; all of it exists from construction on, with the same
structure on every rank (an ``Owned`` tensor has an empty piece on non-owners). A
checkpointer loads in place into the state dict of an optimizer built at any world size,
then calls :meth:`load_state_dict`, which re-gathers the parameters from the masters.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Literal, Mapping

import torch
import torch.distributed as dist

from flexshard.adamw import AdamWConfig, adamw_step_
from flexshard.buckets import BucketPlan
from flexshard.collectives import (WireStats, all_gather_bucket, all_gather_pieces, sends_point_to_point,
                                   reduce_scatter_bucket, reduce_scatter_pieces)
from flexshard.gather import check_blocks_stay_whole, pack_mx, unpack_mx
from flexshard.layout import BlockShard, Layout, Owned, Shard, local_shape, row_numel
from flexshard.muon import MuonConfig, apply_update, momentum_update, muon_step_
from flexshard.mxfp8 import BLOCK_ORIENTATIONS, Blocks, MXBlocks, dequantize, quantize, wire_bytes
from flexshard.newton_schulz import newton_schulz_flops, orthogonalize
from flexshard.owner import assign_owners, rank_loads
from flexshard.sharded import ShardedTensor
from flexshard.world import current_world

PLACEMENTS = ("owned", "fsdp")
COMPUTE_COPIES = ("full", "mxfp8")


@dataclass(frozen=True)
class ShardingConfig:
    """Where state lives and how parameters travel.

    - ``placement``: ``"owned"`` or the ``"fsdp"`` baseline (see the module doc);
    - ``block_size``: rows per block of ``BlockShard`` (and MXFP8 block size);
    - ``average_gradients``: divide the summed gradients by the world size (data-parallel
      mean); ``False`` keeps the plain sum;
    - ``compute_copy``: ``"full"`` gathers parameters in their own dtype; ``"mxfp8"``
      gathers each rank's MXFP8 blocks and writes the dequantized values into the
      parameters (the MXBlocks stay available in :attr:`ShardedOptimizer.mx_params`);
    - ``mx_blocks``: block orientation for 2-D parameters in ``"mxfp8"`` mode (1-D ones
      use ``"row"`` blocks, which are 32 consecutive elements);
    - ``persistent_buffers``: keep the ``(W, padded bucket)`` communication buffers
      between steps (each about the parameters' bytes per rank; gloo with fp32 parameters
      needs one, other cases two) instead of allocating them every step; fresh buffers
      this size cost page faults on every step.
    """

    placement: Literal["owned", "fsdp"] = "owned"
    block_size: int = 32
    average_gradients: bool = True
    compute_copy: Literal["full", "mxfp8"] = "full"
    mx_blocks: Blocks = "row"
    persistent_buffers: bool = True

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ShardingConfig.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"ShardingConfig.block_size must be an int >= 1, got {self.block_size!r}")
        if self.compute_copy not in COMPUTE_COPIES:
            raise ValueError(f"ShardingConfig.compute_copy must be one of {COMPUTE_COPIES}, got {self.compute_copy!r}")
        if self.mx_blocks not in BLOCK_ORIENTATIONS:
            raise ValueError(f"ShardingConfig.mx_blocks must be one of {BLOCK_ORIENTATIONS}, got {self.mx_blocks!r}")


@dataclass(eq=False)
class _Entry:
    name: str
    param: torch.Tensor
    kind: str  # "muon" or "adamw"
    layout: Layout
    master: ShardedTensor
    state: dict[str, ShardedTensor]
    grad: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)


class ShardedOptimizer:
    """Muon (``torch.optim.Muon`` numerics) on the matrices named in ``muon_params`` (by
    default every 2-D parameter) and AdamW (``torch.optim.AdamW`` numerics) on the rest,
    sharded over ``group`` (the default process group, or a single process)."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        muon: MuonConfig = MuonConfig(),
        adamw: AdamWConfig = AdamWConfig(),
        sharding: ShardingConfig = ShardingConfig(),
        muon_params: Iterable[str] | None = None,
        group: "dist.ProcessGroup | None" = None,
    ) -> None:
        named = list(params.items()) if isinstance(params, Mapping) else list(params)
        _check_params(named)
        self.muon, self.adamw, self.sharding, self.group = muon, adamw, sharding, group
        self.rank, self.world_size = current_world(group)
        self.device = named[0][1].device  # masters, state and buffers live with the parameters
        if dist.is_available() and dist.is_initialized():
            check_backend_device(dist.get_backend(group), self.device)
        muon_names = _muon_names(named, muon_params)
        self.ns_costs = _ns_costs({n: tuple(p.shape) for n, p in named}, muon_names, muon)
        self.owners = assign_owners(self.ns_costs, self.world_size) if sharding.placement == "owned" else {}
        self.entries = [self._make_entry(n, p, "muon" if n in muon_names else "adamw") for n, p in named]
        self.step_count = 0
        self.stats = WireStats()
        self.ns_flops = 0  # Newton-Schulz FLOPs this rank has run
        # wall seconds of the last reduce_gradients / step's update / parameter gather on
        # this rank (host time: on CUDA what was queued, unless the caller synchronizes)
        self.phase_s: dict[str, float] = {"reduce": 0.0, "update": 0.0, "gather": 0.0}
        self.mx_params: dict[str, MXBlocks] = {}
        self._plan = BucketPlan.for_layouts([(e.shape, e.layout) for e in self.entries], self.world_size)
        # _ranges[r][i]: the flat range of entry i that rank r holds
        self._ranges = [[e.layout.flat_range(e.shape, self.world_size, r) for e in self.entries]
                        for r in range(self.world_size)]
        self._grad_bucket = torch.zeros(self._plan.padded, dtype=torch.float32, device=self.device)
        for i, e in enumerate(self.entries):
            r = self._plan.slot(self.rank, i)
            e.grad = self._grad_bucket[r.start : r.stop].view(e.master.local.shape)
        self._buffers: list[torch.Tensor | None] = [None, None]
        if sharding.compute_copy == "mxfp8":
            self._check_mx_gather()

    # --- construction ------------------------------------------------------------------------

    def _layout_for(self, name: str, kind: str) -> Layout:
        return _layout(self.sharding, self.owners, name, kind == "muon")

    def _make_entry(self, name: str, param: torch.Tensor, kind: str) -> _Entry:
        layout = self._layout_for(name, kind)
        w, r = self.world_size, self.rank
        master = ShardedTensor.from_global(param.detach().to(torch.float32), layout, r, w)
        names = ("momentum_buffer",) if kind == "muon" else ("exp_avg", "exp_avg_sq")
        state = {}
        for s in names:
            st = ShardedTensor.empty(tuple(param.shape), layout, torch.float32, param.device, r, w)
            st.local.zero_()
            state[s] = st
        return _Entry(name, param, kind, layout, master, state)

    def _check_mx_gather(self) -> None:
        for e in self.entries:
            if e.param.ndim not in (1, 2):
                raise ValueError(
                    f"compute_copy='mxfp8' handles 1-D and 2-D parameters; {e.name!r} has shape {e.shape}. "
                    f"Use compute_copy='full' or leave this parameter out of the optimizer"
                )
            check_blocks_stay_whole(e.shape, e.layout, self.world_size, self._mx_blocks(e), self.sharding.block_size)

    def _mx_blocks(self, e: _Entry) -> Blocks:
        return self.sharding.mx_blocks if e.param.ndim == 2 else "row"

    # --- gradients ---------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Reduce every parameter's ``.grad`` over the group into this rank's pieces
        (``Owned``: the owner gets the whole matrix; row layouts: each rank its rows).
        ``(W-1)/W`` of the gradient bytes per rank go on the wire (on gloo each piece
        straight from its ``.grad``, else one all-to-all of packed buckets); the sum runs in
        rank order; with ``average_gradients`` it is then divided by the world size."""
        t0 = time.perf_counter()
        w, plan = self.world_size, self._plan
        flats = []
        for e in self.entries:
            if e.param.grad is None:
                raise ValueError(
                    f"parameter {e.name!r} has no gradient; every parameter given to ShardedOptimizer must "
                    f"receive one each step on every rank (or leave it out of the optimizer)"
                )
            flats.append(e.param.grad.detach().reshape(-1))
        recv = self._comm_buffer(1)
        if w > 1 and sends_point_to_point(self.group) and all(f.dtype == torch.float32 for f in flats):
            # gloo: every piece goes from the gradient's own memory to its rank (no pack)
            reduce_scatter_pieces(plan, self._ranges, flats, self.group, self.stats, out=self._grad_bucket,
                                  scratch=recv)
        else:
            send = self._comm_buffer(0)
            for r in range(w):
                send[r, plan.total(r) :].zero_()
            for i, flat in enumerate(flats):
                for r in range(w):
                    src, dst = self._ranges[r][i], plan.slot(r, i)
                    send[r, dst.start : dst.stop].copy_(flat[src.start : src.stop])
            reduce_scatter_bucket(plan, send, self.group, self.stats, out=self._grad_bucket, scratch=recv)
        if self.sharding.average_gradients and w > 1:
            self._grad_bucket.div_(w)
        self.phase_s["reduce"] = time.perf_counter() - t0

    def set_reduced_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's pieces of gradients that are already reduced (the same whole
        tensors on every rank), with no communication."""
        missing = [e.name for e in self.entries if e.name not in grads]
        if missing:
            raise ValueError(f"set_reduced_gradients is missing gradients for {missing}")
        for e in self.entries:
            g = grads[e.name]
            if tuple(g.shape) != e.shape:
                raise ValueError(f"gradient for {e.name!r} has shape {tuple(g.shape)}, the parameter {e.shape}")
            rng = e.master.flat_range
            e.grad.view(-1).copy_(g.detach().reshape(-1)[rng.start : rng.stop])

    def set_lr(self, muon: float | None = None, adamw: float | None = None) -> None:
        """Set the learning rate of the Muon and/or AdamW updates (a schedule calls this
        before each :meth:`step`); validated like the configs."""
        if muon is not None:
            self.muon = replace(self.muon, lr=muon)
        if adamw is not None:
            self.adamw = replace(self.adamw, lr=adamw)

    @property
    def lrs(self) -> tuple[float, float]:
        """``(muon lr, adamw lr)`` now."""
        return float(self.muon.lr), float(self.adamw.lr)

    def zero_grad(self) -> None:
        for e in self.entries:
            e.param.grad = None

    # --- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Update masters and optimizer state from the reduced gradients, then re-gather
        the parameters on every rank."""
        t0 = time.perf_counter()
        self.step_count += 1
        fsdp_updates = []
        for e in self.entries:
            if e.kind == "adamw":
                if e.master.local.numel():
                    s = e.state
                    adamw_step_(e.master.local, e.grad, s["exp_avg"].local, s["exp_avg_sq"].local,
                                self.step_count, self.adamw)
            elif self.sharding.placement == "owned":
                if e.layout.owner == self.rank:
                    muon_step_(e.master.local, e.grad, e.state["momentum_buffer"].local, self.muon)
                    self.ns_flops += self.ns_costs[e.name]
            else:
                fsdp_updates.append((e, momentum_update(e.grad, e.state["momentum_buffer"].local, self.muon)))
        if fsdp_updates:
            self._fsdp_newton_schulz(fsdp_updates)
        t1 = time.perf_counter()
        self.gather_parameters()
        self.phase_s["update"], self.phase_s["gather"] = t1 - t0, time.perf_counter() - t1

    def _fsdp_newton_schulz(self, updates: list) -> None:
        """Baseline: gather every matrix's update (bf16), orthogonalize all of them on
        every rank, keep this rank's rows."""
        w = self.world_size
        plan = BucketPlan.for_layouts([(e.shape, e.layout) for e, _ in updates], w)
        mine = plan.pack([u.to(torch.bfloat16) for _, u in updates], self.rank)
        gathered = all_gather_bucket(plan, mine, self.group, self.stats)
        for i, (e, _) in enumerate(updates):
            whole = torch.cat([gathered[r, plan.slot(r, i).start : plan.slot(r, i).stop] for r in range(w)])
            ortho = orthogonalize(whole.view(e.shape), self.muon.ns_coefficients, self.muon.ns_steps, self.muon.eps)
            self.ns_flops += self.ns_costs[e.name]
            per_row = row_numel(e.shape)
            first = e.master.flat_range.start // per_row if per_row else 0
            apply_update(e.master.local, ortho[first : first + e.master.local.shape[0]], e.shape, self.muon)

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every rank's parameters from the masters' pieces: one all-gather (an ``Owned``
        matrix travels from its owner, row pieces from every rank; on gloo with fp32
        parameters each piece goes from the master straight into the parameters), in the
        parameters' own dtype or, with ``compute_copy="mxfp8"``, as MXFP8 blocks dequantized on arrival."""
        if self.sharding.compute_copy == "mxfp8":
            self._gather_mx()
            return
        w, plan = self.world_size, self._plan
        dtype = self.entries[0].param.dtype
        if w > 1 and dtype == torch.float32 and sends_point_to_point(self.group):
            # gloo, fp32: each master piece goes straight into every rank's parameter (no pack, no unpack)
            all_gather_pieces(self._ranges, [e.master.local for e in self.entries],
                              [e.param.detach().view(-1) for e in self.entries], self.group, self.stats)
            return
        mine, gathered = None, None
        if dtype == torch.float32:  # reuse a gradient buffer, idle by now
            gathered = self._comm_buffer(1)
            mine = gathered[self.rank]
        mine = plan.pack([e.master.local.to(dtype) for e in self.entries], self.rank, out=mine)
        gathered = all_gather_bucket(plan, mine, self.group, self.stats, out=gathered)
        for i, e in enumerate(self.entries):
            flat = e.param.detach().view(-1)
            for r in range(w):
                dst, src = self._ranges[r][i], plan.slot(r, i)
                flat[dst.start : dst.stop].copy_(gathered[r, src.start : src.stop])

    def _comm_buffer(self, which: int) -> torch.Tensor:
        """fp32 ``(W, padded)`` buffer 0 (what this rank sends, for the packed reduce) or 1
        (what it receives), made when first needed (gloo's bucket-free paths need only 1)."""
        if self._buffers[which] is not None:
            return self._buffers[which]
        buf = torch.empty((self.world_size, self._plan.padded), dtype=torch.float32, device=self.device)
        if self.sharding.persistent_buffers:
            self._buffers[which] = buf
        return buf

    def _gather_mx(self) -> None:
        w, bs = self.world_size, self.sharding.block_size
        sizes = tuple(
            tuple(wire_bytes(_mx_shape(local_shape(e.layout, e.shape, w, r)), self._mx_blocks(e), bs)
                  for e in self.entries)
            for r in range(w)
        )
        plan = BucketPlan(sizes)
        pieces = [pack_mx(quantize(e.master.local.reshape(_mx_shape(e.master.local.shape)), bs, self._mx_blocks(e)))
                  for e in self.entries]
        gathered = all_gather_bucket(plan, plan.pack(pieces, self.rank), self.group, self.stats)
        for i, e in enumerate(self.entries):
            parts = [gathered[r, plan.slot(r, i).start : plan.slot(r, i).stop] for r in range(w)]
            mx = unpack_mx(parts, e.shape, e.layout, w, self._mx_blocks(e), bs)
            self.mx_params[e.name] = mx
            e.param.detach().copy_(dequantize(mx, e.param.dtype))

    # --- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"step": int, "params": {name: {"master": ST, <state>: ST, ...}}}`` where every
        ST is a ``ShardedTensor`` whose ``.local`` is the live tensor (load in place)."""
        return {
            "step": self.step_count,
            "params": {e.name: {"master": e.master, **e.state} for e in self.entries},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Adopt a state dict shaped like :meth:`state_dict` at this world size (typically
        this optimizer's own, filled in place by a checkpointer), then re-gather the
        parameters from the masters. A collective: call it on every rank."""
        mine = self.state_dict()
        if set(state) != set(mine):
            raise ValueError(f"state dict keys {sorted(state)} differ from this optimizer's {sorted(mine)}")
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state dict 'step' must be an int >= 0, got {step!r}")
        theirs = state["params"]
        if set(theirs) != set(mine["params"]):
            extra, missing = set(theirs) - set(mine["params"]), set(mine["params"]) - set(theirs)
            raise ValueError(f"state dict parameters differ: unexpected {sorted(extra)}, missing {sorted(missing)}")
        for name, ours in mine["params"].items():
            if set(theirs[name]) != set(ours):
                raise ValueError(f"state of {name!r} has keys {sorted(theirs[name])}, expected {sorted(ours)}")
            for key, target in ours.items():
                _adopt(f"params.{name}.{key}", theirs[name][key], target)
        self.step_count = step
        self.gather_parameters()

    # --- reporting ---------------------------------------------------------------------------

    def owner_loads(self) -> list[float]:
        """Newton-Schulz FLOPs per rank under the owner assignment (``"owned"`` only)."""
        return rank_loads(self.ns_costs, self.owners, self.world_size)

    def load_ratio(self) -> float:
        """Largest over smallest per-rank Newton-Schulz load (inf if some rank has none)."""
        loads = self.owner_loads()
        return max(loads) / min(loads) if min(loads) > 0 else float("inf")


def plan_layouts(
    shapes: Mapping[str, tuple[int, ...]],
    world_size: int,
    sharding: ShardingConfig = ShardingConfig(),
    muon: MuonConfig = MuonConfig(),
    muon_params: Iterable[str] | None = None,
) -> dict[str, Layout]:
    """The layout a :class:`ShardedOptimizer` over parameters of these ``shapes`` gives each
    one at ``world_size`` (``Owned`` owners balanced by Newton-Schulz FLOPs), with no
    process group: what a restore planner asks before a job starts."""
    names = set(muon_params) if muon_params is not None else {n for n, s in shapes.items() if len(s) == 2}
    costs = _ns_costs(shapes, names, muon)
    owners = assign_owners(costs, world_size) if sharding.placement == "owned" else {}
    return {n: _layout(sharding, owners, n, n in names) for n in shapes}


def _ns_costs(shapes: Mapping[str, tuple[int, ...]], muon_names: set[str], muon: MuonConfig) -> dict[str, float]:
    return {n: newton_schulz_flops(tuple(s), muon.ns_steps) for n, s in shapes.items() if n in muon_names}


def _layout(sharding: ShardingConfig, owners: Mapping[str, int], name: str, is_muon: bool) -> Layout:
    if sharding.placement == "fsdp":
        return Shard(0)
    if is_muon:
        return Owned(owners[name])
    return BlockShard(sharding.block_size)


def _adopt(key: str, given: object, target: ShardedTensor) -> None:
    if not isinstance(given, ShardedTensor):
        raise TypeError(f"state {key!r} must be a ShardedTensor, got {type(given).__name__}")
    if (given.layout, given.global_shape, given.world_size, given.rank) != (
        target.layout, target.global_shape, target.world_size, target.rank
    ):
        raise ValueError(
            f"state {key!r} is {given}, this optimizer holds {target}: load the saved pieces into the "
            f"ShardedTensors returned by state_dict() of this optimizer (the checkpointer reshards), "
            f"then pass that dict back"
        )
    if given.local is not target.local:
        target.local.copy_(given.local)


def _mx_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape) if len(shape) else (1,)


def _muon_names(named: list[tuple[str, torch.Tensor]], muon_params: Iterable[str] | None) -> set[str]:
    if muon_params is None:
        return {n for n, p in named if p.ndim == 2}
    chosen = set(muon_params)
    known = {n: p for n, p in named}
    unknown = sorted(chosen - set(known))
    if unknown:
        raise ValueError(f"muon_params names {unknown}, which are not among the parameters given")
    not_2d = sorted(n for n in chosen if known[n].ndim != 2)
    if not_2d:
        raise ValueError(f"Muon needs 2-D matrices; {not_2d} are not 2-D. Leave them to AdamW")
    return chosen


def _check_params(named: list[tuple[str, torch.Tensor]]) -> None:
    if not named:
        raise ValueError("ShardedOptimizer needs at least one parameter")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique, repeated: {dups}")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        raise ValueError(f"all parameters must share one dtype (the gather moves one flat buffer), got {dtypes}")
    for n, p in named:
        if not p.is_floating_point():
            raise TypeError(f"parameter {n!r} is {p.dtype}; only floating-point parameters can be optimized")
        if not p.is_contiguous():
            raise ValueError(f"parameter {n!r} is not contiguous; the parameter gather writes it as a flat view")
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise ValueError(f"all parameters must be on one device (buckets are flat buffers there), got {sorted(map(str, devices))}")


def check_backend_device(backend: str, device: torch.device) -> None:
    """Refuse a process-group backend that cannot move tensors of ``device``: NCCL moves
    GPU tensors, gloo CPU ones."""
    want = {"nccl": "cuda", "gloo": "cpu"}.get(str(backend))
    if want is not None and device.type != want:
        raise ValueError(
            f"parameters are on {device} but the process group's backend is {backend}, which moves "
            f"{want} tensors: init the group with backend={'nccl' if device.type == 'cuda' else 'gloo'!r} "
            f"or move the model to {want}"
        )
