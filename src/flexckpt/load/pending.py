"""Loading one rank's state from a committed checkpoint, at the saved world size or any
other: match the target's structure to the manifest, fetch only the chunks that hold the
target's pieces (straight into the target tensor when a chunk lands whole in it), verify
every chunk's checksum, then hand back the values to apply once every rank has succeeded.

:class:`PendingLoad` holds the checks (in its constructor), the small values and
:meth:`~PendingLoad.apply`; its :meth:`~PendingLoad.read` plans the requests
(:mod:`flexckpt.load.read_plan`, over chunk entries :func:`flexckpt.format.tables.file_entries` read)
and hands them to the fetch loop (:mod:`flexckpt.load.fetch`). ``FETCH_BYTES`` and
``READ_GROUP_BYTES`` (read at each load) size its requests.

``exclude`` patterns (see :func:`flexckpt.state.structure.excluder`) take leaves out of the load
on both sides: the state keeps what it holds, and the checkpoint need not have them.
"""
from __future__ import annotations

import base64
import contextlib
import gc
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from flexckpt.errors import ManifestError, StructureMismatch
from flexckpt.load.exchange import Fanout, fetch_fanned
from flexckpt.format.manifest import Manifest
from flexckpt.format.names import keyed_name, step_dir
from flexckpt.format.tables import file_entries
from flexckpt.format.write_plan import part_of_world
from flexckpt.load.fetch import FetchLoop, StoreSource, byte_view, run_shares, target_views, verify
from flexckpt.load.read_plan import file_plans, gather_runs, requests_of
from flexckpt.state.dtypes import dtype_from_name, dtype_name
from flexckpt.state.structure import Excluder, Walk, decode_plain
from flexckpt.storage import Storage
from flexshard import Part, part_of

log = logging.getLogger("flexckpt")

FETCH_BYTES = 16 << 20  # adjacent chunks are fetched together, up to this many bytes a request
READ_GROUP_BYTES = 512 << 10  # local files: chunks read (and then verified) together, about this many bytes


@dataclass
class LoadStats:
    chunks: int = 0
    fetches: int = 0
    bytes_read: int = 0
    direct_chunks: int = 0
    tensors: int = 0
    metadata_bytes: int = 0  # chunk tables and values files read (version 2 and later), besides the manifest
    # where this rank's bytes came from (data ranges, chunk tables, values files, bytes values):
    # read from the storage (in a fast tier's recovery: the node's tier folder or the store),
    # or received from peers (a fast tier's recovery: the ranges it asked of other nodes)
    bytes_from_store: int = 0
    bytes_from_peers: int = 0  # with fan-out (Checkpointer(fanout=)) also the chunks other ranks read for this one
    # the manifest read from the persistent store (not in the counts above; also a fast tier's
    # recovery that takes missing ranks from the store's step, 0 in one from the tier alone): its
    # bytes, read by this rank, or by rank 0 for every rank (``manifest_from_peer``: a fanned-out
    # load, or that recovery)
    manifest_bytes: int = 0
    manifest_from_peer: bool = False
    peer_chunks_reread: int = 0  # fan-out: chunks received from a peer that failed their check, read from the store
    # where this rank's load spent its time (wall seconds): ``plan_s``, the manifest read and
    # parsed, the checks, the chunk tables and the read plan; ``fetch_s``, the bytes read (or
    # received), verified and placed; ``agree_s``, the step and success agreements with the
    # other ranks (waiting for the slowest rank included); ``apply_s``, the values set and
    # staged tensors copied home. Their sum is most of the load's wall time.
    plan_s: float = 0.0
    fetch_s: float = 0.0
    agree_s: float = 0.0
    apply_s: float = 0.0
    # strict=False (or exclude=): ``missing``, the state's keys the checkpoint lacks (they keep
    # what they held); ``not_loaded``, the checkpoint's keys this rank's state did not take
    # (per-rank values at another world size too); ``skipped``, both, sorted
    missing: list[str] = field(default_factory=list)
    not_loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _check_keys(kind: str, target: set[str], saved: set[str], step: int, strict: bool, stats: LoadStats,
                elsewhere: set[str] = frozenset()) -> set[str]:  # type: ignore[assignment]
    """The keys to load; those left out go to ``stats`` (``strict=False``). ``elsewhere``:
    saved keys another rank of the target may want (another pipeline stage's), never
    unexpected here."""
    missing = sorted(target - saved)
    unexpected = sorted(saved - target - elsewhere)
    if strict and missing:
        raise StructureMismatch(
            f"checkpoint step {step} has no {kind} {missing[:10]}{' ...' if len(missing) > 10 else ''} that the "
            f"state to load into has; pass exclude=({missing[0]!r},) (name patterns) to load without them, or "
            f"strict=False to load the rest, leaving these unchanged"
        )
    if strict and unexpected:
        raise StructureMismatch(_unexpected_message(kind, unexpected, target, step))
    stats.missing += missing
    stats.not_loaded += unexpected
    return target & saved


def _unexpected_message(kind: str, unexpected: list[str], target: set[str], step: int) -> str:
    """What to do about saved keys the state lacks. Most often they are an optimizer's
    state that the state to load into has not created yet (a ``torch.optim`` optimizer
    makes it at its first ``step()``): ``strict=False`` would then drop it, so the message
    says how to create it instead."""
    listed = f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
    owners = sorted(_unmaterialised_optimizers(unexpected, target))
    if not owners:
        return (f"checkpoint step {step} holds {kind} {listed} that the state to load into does not have; pass "
                f"strict=False to load the rest without them (last_load_stats.not_loaded lists them)")
    where = ", ".join(repr(o.rstrip("/") or "(top level)") for o in owners)
    return (
        f"checkpoint step {step} holds optimizer state {listed} ({len(unexpected)} {kind}) that the state to load into "
        f"does not have: the optimizer under {where} has no state yet (a torch.optim optimizer creates it at its first "
        f"step()). Create it before loading: call torch.distributed.checkpoint.state_dict.get_optimizer_state_dict("
        f"model, optimizer) once (it creates the state in place), or save and load get_state_dict(model, optimizer) "
        f"and apply it with set_state_dict, as the README's FSDP2 section shows. (strict=False would load the rest and "
        f"leave the optimizer without its saved state.)"
    )


def _unmaterialised_optimizers(unexpected: list[str], target: set[str]) -> set[str]:
    """Prefixes ``P`` (``"optim/"``, or ``""`` for the top level) under which the checkpoint
    holds ``P + "state/<param>/<name>"`` keys and the state to load into holds no ``P + "state/"``
    key: an optimizer whose state has not been created."""
    owners = set()
    for name in unexpected:
        parts = name.split("/")
        for i in range(len(parts) - 2):
            if parts[i] == "state":
                owners.add("".join(p + "/" for p in parts[:i]))
                break
    return {o for o in owners if not any(t.startswith(o + "state/") for t in target)}


def _elsewhere(manifest: Manifest, w: Walk, saved: set[str], world_size: int) -> set[str]:
    """Saved tensors that may be another pipeline stage's, not this rank's: every one when
    this rank is a stage (it holds a tensor on a mesh spanning part of the target world),
    else those saved on a mesh spanning part of the saved world. (A key this rank wants and
    the checkpoint lacks is still an error, naming it.)"""
    if any(part_of_world(s.layout, world_size) for s in w.specs):
        return saved
    return {n for n in saved if part_of_world(manifest.tensors[n].layout, manifest.world_size)}


def _metadata_read(manifest: Manifest) -> tuple[int, int]:
    """Bytes of table and values files read so far: from the storage, and from peers."""
    files = manifest.files
    return files.bytes_read - files.peer_bytes_read, files.peer_bytes_read


class PendingLoad:
    """Tensors are read and verified by :meth:`read`; values are applied by :meth:`apply`
    only after every rank has read successfully."""

    def __init__(self, storage: Storage, manifest: Manifest, w: Walk, rank: int, world_size: int, strict: bool,
                 gone: Excluder | None = None) -> None:
        w = w.without(gone)
        kept = (lambda names: set(names)) if gone is None else (lambda names: {n for n in names if not gone(n)})
        self.storage = storage
        self.manifest = manifest
        self.walk = w
        self.rank = rank
        self.world_size = world_size
        self.strict = strict
        self.stats = LoadStats()
        step = manifest.step
        names = {s.name: i for i, s in enumerate(w.specs)}
        saved = kept(manifest.tensors)
        keep = _check_keys("tensors", set(names), saved, step, strict, self.stats,
                           _elsewhere(manifest, w, saved, world_size))
        self.targets: list[tuple[int, Part]] = []  # (walk index, wanted part: a box, or a flat range)
        specs, tensors, saved_tensors = w.specs, w.tensors, manifest.tensors
        for name in sorted(keep):
            i = names[name]
            spec, saved = specs[i], saved_tensors[name]
            if spec.dtype != saved.dtype or spec.shape != saved.shape:
                raise StructureMismatch(
                    f"tensor {name!r}: checkpoint step {step} has {dtype_name(saved.dtype)} {list(saved.shape)}, "
                    f"the state to load into has {dtype_name(spec.dtype)} {list(spec.shape)}"
                )
            rng = part_of(spec.layout, spec.shape, world_size, rank)  # kept: most tensors share a few
            n = len(rng)
            if n != tensors[i].numel():
                raise StructureMismatch(f"tensor {name!r}: target piece has {tensors[i].numel()} elements, its layout gives {n}")
            if n:
                self.targets.append((i, rng))
        self.plain = _check_keys("plain values", set(w.plain), kept(manifest.plain), step, strict, self.stats)
        self.lanes = _check_keys("per-lane values", set(w.lanes), kept(manifest.lanes), step, strict, self.stats)
        self.per_rank = _check_keys("per-rank values", set(w.per_rank), kept(manifest.per_rank), step, strict,
                                    self.stats)
        self._per_rank_skipped: set[str] = set()  # strict=False at another world size: marked not restored
        if self.per_rank and manifest.world_size != world_size:
            names = sorted(self.per_rank)
            if strict:
                raise StructureMismatch(
                    f"per-rank values {names[:10]} of checkpoint step {step} belong to the ranks of world size "
                    f"{manifest.world_size} and cannot be restored at world size {world_size}; derive them from seed, "
                    f"step and rank and pass exclude=({names[0]!r},) to load without them"
                )
            self.stats.not_loaded += names
            self._per_rank_skipped, self.per_rank = self.per_rank, set()
        # bytes values: each rank asks for the keys it holds; the others' keys are not its concern
        missing = sorted(set(w.keyed) - set(manifest.keyed))
        if missing and strict:
            raise StructureMismatch(
                f"checkpoint step {step} has no bytes value {missing[:10]}{' ...' if len(missing) > 10 else ''} that "
                f"rank {rank} of {world_size} holds: no rank saved it. To load without it (the state keeps what it "
                f"holds), pass exclude=({missing[0]!r},) (name patterns, e.g. 'data/*')"
            )
        self.stats.missing += missing
        self.stats.missing.sort()
        self.stats.not_loaded.sort()
        self.stats.skipped = sorted(self.stats.missing + self.stats.not_loaded)
        self.keyed = sorted(set(w.keyed) & set(manifest.keyed))

    def read(self, threads: int, fanout: "Fanout | None" = None) -> None:
        """Read and verify this rank's bytes; with ``fanout``, the chunks other ranks need
        too are read once and exchanged (:mod:`flexckpt.load.exchange`; every rank of the group
        calls it then)."""
        with collection_paused():
            self._read(threads, fanout)

    def _read(self, threads: int, fanout: "Fanout | None" = None) -> None:
        """Plan the reads (the chunk tables they need read first: :func:`flexckpt.format.tables.file_entries`),
        read and check the small values, then fetch every request (:mod:`flexckpt.load.fetch`)."""
        m = self.manifest
        t0 = time.perf_counter()
        tables_before = _metadata_read(m)
        targets = [(m.tensors[self.walk.specs[i].name], rng) for i, rng in self.targets]
        by_file = gather_runs(targets)
        plans = file_plans(by_file, file_entries(m, by_file))
        views, self._copy_back = target_views([self.walk.tensors[i] for i, _ in self.targets])
        self._read_values()
        folder = step_dir(m.step)
        store = StoreSource(self.storage, folder)
        loop = FetchLoop(views, store, folder)
        exchange = None
        t1 = time.perf_counter()
        self.stats.plan_s += t1 - t0
        try:
            if fanout is None:
                requests = requests_of(plans, FETCH_BYTES, READ_GROUP_BYTES)
                whole = run_shares(loop.fetch, requests, threads, self.storage.stall_timeout,
                                   f"reading {len(requests)} ranges on {self.storage.url}")
            else:
                requests, whole, exchange = fetch_fanned(fanout, sorted(m.files), plans, loop, store, FETCH_BYTES,
                                                         READ_GROUP_BYTES, threads, self.storage.stall_timeout,
                                                         self.storage.url)
        finally:
            store.close()
            self.stats.fetch_s += time.perf_counter() - t1
        keyed = sum(len(v) for v in self._keyed.values())
        keyed_from_peer = keyed and self.storage.from_peer(f"{folder}/{keyed_name(m.attempt)}")
        tables = [now - before for now, before in zip(_metadata_read(m), tables_before)]
        s = self.stats
        s.fetches = len(requests)
        s.direct_chunks = sum(whole)
        s.chunks = sum(r.stop - r.first for r in requests)
        s.bytes_read = sum(r.length for r in requests) + keyed
        s.tensors = len(self.targets)
        s.metadata_bytes = m.metadata_bytes_read
        s.bytes_from_store = store.bytes_from_store + tables[0] + (0 if keyed_from_peer else keyed)
        s.bytes_from_peers = store.bytes_from_peers + tables[1] + (keyed if keyed_from_peer else 0)
        if exchange is not None:
            s.direct_chunks += exchange.direct
            s.bytes_from_peers += exchange.bytes_from_peers
            s.peer_chunks_reread = exchange.rereads

    def _read_values(self) -> None:
        """Per-rank values (version 2 and later: from this rank's values file), plain values
        and bytes values, read and checked now, before the ranks agree, so that
        :meth:`apply` cannot fail half-way."""
        m = self.manifest
        same_world = m.world_size == self.world_size
        self._rank_values = m.rank_values(self.rank) if self.per_rank and same_world else {}
        self._decoded = {
            name: decode_per_rank(self._rank_values[name], name) for name in self.per_rank if name in self._rank_values
        }
        missing = sorted(n for n in self.per_rank if same_world and n not in self._rank_values)
        if missing:
            raise ManifestError(f"checkpoint step {m.step} has no per-rank values {missing} for rank {self.rank}")
        self._values = self._decode_values()
        self._keyed = self._read_keyed()

    def _read_keyed(self) -> dict[str, bytes]:
        """The bytes values this rank holds keys of (see :func:`read_bytes_values`)."""
        out = read_bytes_values(self.storage, self.manifest, self.keyed)
        for name, value in out.items():
            slot = self.walk.keyed_slots[name]
            if isinstance(slot.container, tuple) and slot.container[slot.key] != value:
                raise StructureMismatch(f"cannot load bytes value {name!r} into a tuple; use a list")
        return out

    def _decode_values(self) -> dict[str, Any]:
        """Plain values decoded and checked against their slots, before the ranks agree:
        :meth:`apply` then only assigns, and cannot fail half-way."""
        m, w = self.manifest, self.walk
        out: dict[str, Any] = {}
        for name in self.plain:
            slot = w.plain_slots[name]
            try:
                value = decode_plain(m.plain[name])
            except (ValueError, RecursionError) as e:
                raise ManifestError(f"checkpoint step {m.step}: plain value {name!r} is malformed: {str(e)[:200]}") from None
            if isinstance(slot.like, tuple) and isinstance(value, list):
                value = tuple(value)
            if isinstance(slot.container, tuple):
                if slot.container[slot.key] != value:
                    raise StructureMismatch(f"cannot load plain value {name!r} into a tuple; use a list")
                continue
            out[name] = value
        return out

    def apply(self) -> None:
        """Copy staged tensors home, set plain, per-lane and per-rank values (all decoded
        and checked by :meth:`read`, before the ranks agreed), and call ``load_state_dict``
        on stateful objects (innermost first)."""
        t0 = time.perf_counter()
        for t, tmp in self._copy_back:
            t.copy_(tmp, non_blocking=False)
        m, w = self.manifest, self.walk
        for name, value in self._values.items():
            slot = w.plain_slots[name]
            slot.container[slot.key] = value
        for name in self.lanes:
            w.lanes[name].values = dict(m.lanes[name])
        for name, value in self._keyed.items():
            slot = w.keyed_slots[name]
            if not isinstance(slot.container, tuple):  # a tuple holding bytes: checked in read()
                slot.container[slot.key] = value
        for name in self.per_rank:  # only at the saved world size (checked in __init__)
            target = w.per_rank[name]
            target.value = self._decoded[name]
            target.restored = True
        for name in self._per_rank_skipped:
            w.per_rank[name].restored = False
        for _name, obj, sd in reversed(w.statefuls):
            obj.load_state_dict(sd)
        self.stats.apply_s = time.perf_counter() - t0
        if self.stats.not_loaded and self.rank == 0 and not getattr(_subset, "on", False):
            names = self.stats.not_loaded
            log.warning("flexckpt: load of step %d with strict=False left out %d key(s) the checkpoint holds: %s%s "
                        "(last_load_stats.not_loaded lists them; exclude=(patterns) leaves them out on purpose)",
                        m.step, len(names), names[:5], " ..." if len(names) > 5 else "")


_subset = threading.local()


@contextlib.contextmanager
def subset_load() -> Iterator[None]:
    """Loads on this thread take a subset of a checkpoint on purpose (the converters and
    ``reshard`` read some tensors at a time): the keys they leave out are not warned about.
    Elsewhere a ``strict=False`` load that leaves out any of the checkpoint's keys says how
    many, once (on rank 0): it never drops saved state silently."""
    was = getattr(_subset, "on", False)
    _subset.on = True
    try:
        yield
    finally:
        _subset.on = was


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The garbage collector held off while a load plans and reads (the manifest's parse, the
    checks and the read plan: ``load_committed``; the read: ``PendingLoad.read``): it allocates thousands
    of small tuples (pieces, chunks, copies) and no reference cycles, and the collections
    they would trigger walk every object of the trainer for nothing. The collector's state
    is restored on the way out, whatever happens."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_bytes_values(storage: Storage, manifest: Manifest, names: list[str]) -> dict[str, bytes]:
    """Bytes values by key, each read alone from the save's ``keyed.values`` file and
    checked against the manifest's checksum; returned as the bytes they are (never
    unpickled or parsed)."""
    if not names:
        return {}
    rel = f"{step_dir(manifest.step)}/{keyed_name(manifest.attempt)}"  # type: ignore[arg-type]
    out = {}
    with storage.open_reader(rel) as reader:
        for name in names:
            offset, length, want = manifest.keyed[name]
            buf = bytearray(length)  # at most MAX_BYTES_VALUE: the manifest's parser checked
            if length:
                reader.read_into(offset, memoryview(buf))
            verify(memoryview(buf), want, f"{rel} bytes [{offset}, {offset + length}) (bytes value {name!r})")
            out[name] = bytes(buf)
    return out


# -- per-rank values: JSON, or a small CPU tensor (written by writer.encode_per_rank) -------------
def decode_per_rank(value: Any, name: str) -> Any:
    if isinstance(value, dict) and set(value) == {"$tensor"}:
        spec = value["$tensor"]
        try:
            dtype = dtype_from_name(spec["dtype"])
            shape = [int(s) for s in spec["shape"]]
            raw = base64.b64decode(spec["data"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"per-rank tensor {name!r} is malformed: {e}") from None
        if any(s < 0 for s in shape) or math.prod(shape) * torch.empty((), dtype=dtype).element_size() != len(raw):
            raise ManifestError(f"per-rank tensor {name!r}: {len(raw)} bytes do not fill shape {shape} of {spec['dtype']}")
        out = torch.empty(shape, dtype=dtype)
        if raw:
            byte_view(out)[:] = raw
        return out
    return value
