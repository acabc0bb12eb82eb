"""Walking a training state: nested dicts (and lists) of tensors, ShardedTensors, plain
values, ``bytes`` values (addressed by key), per-lane and per-rank values, and objects
with ``state_dict()`` / ``load_state_dict()``.

A walk turns the state into flat, named leaves. Names are ``/``-joined keys (``%`` and
``/`` inside a key are escaped). The *structure* is what every rank must agree on: tensor
names, dtypes, global shapes and layouts, and the names of plain, per-lane and per-rank
values (never their contents). ``bytes`` values are not part of it: ranks hold different
sets of keys (each data-parallel replica its own), see :mod:`flexckpt.values`.

The walk is also the one judge of what can be checkpointed: every leaf it cannot convert
is collected (the exception its conversion raised, with the leaf's name) and the walk goes
on, so one :class:`~flexckpt.errors.UnsupportedState` lists them all
(``Checkpointer.check``); there is no second list of supported kinds to drift from it.
"""
from __future__ import annotations

import fnmatch
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
import torch

from flexckpt.dtensor import dtensor_leaf, dtensor_type, is_dtensor
from flexckpt.dtypes import dtype_name
from flexckpt.errors import UnsupportedState
from flexckpt.values import MAX_BYTES_VALUE, ByLane, PerRank
from flexshard import Layout, Replicate, ShardedTensor

SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the global structure."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape), "layout": self.layout.to_json()}


@dataclass
class Slot:
    """Where a loaded plain value goes: ``container[key]``."""

    container: Any
    key: Any
    like: Any  # the target's current value (its type is kept: tuple stays tuple)


@dataclass
class Walk:
    """The leaves of one state, in walk order.

    ``key`` is the cheap structure key compared save after save to reuse the plan: one
    tuple per leaf. Tensor leaves are ``(name, dtype, shape, device)`` for a plain tensor
    and ``(name, dtype, global_shape, layout, local_shape, device)`` for a ShardedTensor;
    ``specs`` are built from them only when the key changes.
    """

    key: list[tuple] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)  # this rank's local piece, per tensor leaf
    plain: dict[str, Any] = field(default_factory=dict)
    plain_slots: dict[str, Slot] = field(default_factory=dict)
    lanes: dict[str, ByLane] = field(default_factory=dict)
    per_rank: dict[str, PerRank] = field(default_factory=dict)
    keyed: dict[str, bytes] = field(default_factory=dict)  # bytes values, by key
    keyed_slots: dict[str, Slot] = field(default_factory=dict)
    errors: list[tuple[str, BaseException]] = field(default_factory=list)  # leaves that cannot be checkpointed
    statefuls: list[tuple[str, Any, dict]] = field(default_factory=list)  # (name, object, its state dict)
    _specs: list[TensorSpec] | None = None

    @property
    def specs(self) -> list[TensorSpec]:
        if self._specs is None:
            self._specs = [
                TensorSpec(k[0], k[1], tuple(k[2]), k[3] if len(k) == 6 else _REPLICATE)
                for k in self.key
                if len(k) >= 4
            ]
        return self._specs

    def without(self, gone: "Excluder | None") -> "Walk":
        """This walk less the leaves ``gone`` names (the test :func:`excluder` builds); a
        stateful object whose own name is excluded is not asked to ``load_state_dict`` either."""
        if gone is None:
            return self
        out = Walk()
        tensors = iter(self.tensors)
        for k in self.key:
            t = next(tensors) if len(k) >= 4 else None
            if not gone(k[0]):
                out.key.append(k)
                if t is not None:
                    out.tensors.append(t)
        keep = lambda d: {n: v for n, v in d.items() if not gone(n)}  # noqa: E731
        out.plain, out.plain_slots, out.lanes = keep(self.plain), keep(self.plain_slots), keep(self.lanes)
        out.per_rank, out.keyed, out.keyed_slots = keep(self.per_rank), keep(self.keyed), keep(self.keyed_slots)
        out.statefuls = [s for s in self.statefuls if not gone(s[0])]
        return out

    def structure_json(self) -> dict:
        """Canonical structure (sorted by name): what the fingerprint hashes."""
        return {
            "tensors": sorted((s.to_json() for s in self.specs), key=lambda d: d["name"]),
            "plain": sorted(self.plain),
            "lanes": sorted(self.lanes),
            "per_rank": sorted(self.per_rank),
        }


_REPLICATE = Replicate()


def fingerprint(structure: dict) -> str:
    return hashlib.sha256(orjson.dumps(structure, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def escape_key(key: Any) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"state keys must be str or int, got {key!r} ({type(key).__name__})")
    s = str(key)
    if s == "":
        raise ValueError("state keys must not be empty strings")
    return s.replace("%", "%25").replace("/", "%2F")


Excluder = Callable[[str], bool]  # name -> whether load(..., exclude=...) leaves it out


def excluder(patterns: Any) -> "Excluder | None":
    """A test ``name -> bool`` for ``load(..., exclude=patterns)``: a leaf is excluded when a
    pattern (``fnmatch``: ``*`` also crosses ``/``) matches its name or the name of a
    container above it (``"data"`` and ``"data/*"`` both exclude ``data/dp_rank_0``).
    None when there are no patterns."""
    if patterns is None or patterns == ():
        return None
    if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
        raise TypeError(f"exclude must be a tuple of non-empty name patterns such as ('data/*',), got {patterns!r}")
    pats = tuple(patterns)

    def gone(name: str) -> bool:
        parts = name.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(fnmatch.fnmatchcase(p, pat) for pat in pats for p in prefixes)

    return gone


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _is_plain_sequence(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and all(isinstance(x, SCALARS) for x in obj)


def walk(state: Any, rank: int, world_size: int) -> Walk:
    """Flatten ``state``. Stateful objects are asked for their ``state_dict()`` here, on
    the calling thread."""
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    out = Walk()
    _walk_dict(state, "", out, rank, world_size)
    if out.errors:
        raise UnsupportedState(out.errors)
    return out


# what a leaf's conversion raises when the leaf cannot be checkpointed: collected, not fatal
_REFUSALS = (TypeError, ValueError, NotImplementedError)


def _walk_dict(d: dict, prefix: str, out: Walk, rank: int, world_size: int) -> None:
    # the save path's per-tensor work: plain tensors under plain string keys take the
    # short way (no call, no escaping)
    key_list, tensors = out.key, out.tensors
    dtensor = dtensor_type()  # None before torch.distributed.tensor is imported: no DTensor exists
    for key, value in d.items():
        if type(key) is str and key and "/" not in key and "%" not in key:
            name = prefix + key
        else:
            try:
                name = prefix + escape_key(key)
            except _REFUSALS as e:
                out.errors.append((f"{prefix}{key!r}", e))
                continue
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            key_list.append((name, value.dtype, value.shape, value.device))
            tensors.append(value)
        elif type(value) is dtensor:  # FSDP2's optimizer moments, get_state_dict's leaves: as short
            try:
                local, layout, shape = dtensor_leaf(value, name, rank, world_size)
            except _REFUSALS as e:
                out.errors.append((name, e))
                continue
            key_list.append((name, local.dtype, shape, layout, local.shape, local.device))
            tensors.append(local)
        elif type(value) is ShardedTensor and value.rank == rank and value.world_size == world_size:
            local = value.local  # as _walk_leaf's, without its tests (another world: it names the error)
            key_list.append((name, local.dtype, value.global_shape, value.layout, local.shape, local.device))
            tensors.append(local)
        else:
            _walk_value(value, name, d, key, out, rank, world_size)


def _walk_value(value: Any, name: str, parent: Any, key: Any, out: Walk, rank: int, world_size: int) -> None:
    try:
        _walk_leaf(value, name, parent, key, out, rank, world_size)
    except _REFUSALS as e:  # this leaf cannot be checkpointed: note it, walk on (see the module doc)
        out.errors.append((name, e))


def _walk_leaf(value: Any, name: str, parent: Any, key: Any, out: Walk, rank: int, world_size: int) -> None:
    if is_dtensor(value):  # saved and loaded as its local piece of a flexshard layout
        local, layout, shape = dtensor_leaf(value, name, rank, world_size)
        out.key.append((name, local.dtype, shape, layout, local.shape, local.device))
        out.tensors.append(local)
    elif isinstance(value, torch.Tensor):
        out.key.append((name, value.dtype, value.shape, value.device))
        out.tensors.append(value)
    elif isinstance(value, ShardedTensor):
        if value.rank != rank or value.world_size != world_size:
            raise ValueError(
                f"{name!r} is a ShardedTensor for rank {value.rank} of {value.world_size}, but this "
                f"checkpointer is rank {rank} of {world_size}; build it with the same world"
            )
        local = value.local
        out.key.append((name, local.dtype, value.global_shape, value.layout, local.shape, local.device))
        out.tensors.append(local)
    elif type(value) is bytes:
        if len(value) > MAX_BYTES_VALUE:
            raise ValueError(
                f"bytes value {name!r} is {len(value)} bytes, more than the {MAX_BYTES_VALUE} a bytes value may "
                f"hold (it travels through the save's records); save it as a uint8 tensor"
            )
        out.keyed[name] = value
        out.keyed_slots[name] = Slot(parent, key, value)
    elif isinstance(value, SCALARS) or _is_plain_sequence(value):
        out.plain[name] = value
        out.plain_slots[name] = Slot(parent, key, value)
        out.key.append((name,))
    elif isinstance(value, dict):
        _walk_dict(value, name + "/", out, rank, world_size)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk_value(item, f"{name}/{i}", value, i, out, rank, world_size)
    elif isinstance(value, ByLane):
        out.lanes[name] = value
        out.key.append((name, "lanes"))
    elif isinstance(value, PerRank):
        out.per_rank[name] = value
        out.key.append((name, "rank"))
    elif _is_stateful(value):
        sd = value.state_dict()
        if not isinstance(sd, dict):
            raise TypeError(f"{name!r}.state_dict() returned {type(sd).__name__}, expected a dict")
        out.statefuls.append((name, value, sd))
        _walk_dict(sd, name + "/", out, rank, world_size)
    elif hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        # numpy scalars: store as the Python scalar they hold
        _walk_value(value.item(), name, parent, key, out, rank, world_size)
    else:
        raise TypeError(
            f"cannot checkpoint {name!r} of type {type(value).__name__}: use tensors, DTensors, ShardedTensor, "
            f"int/float/str/bool/None (or lists of them), bytes, dicts, ByLane, PerRank, or an object "
            f"with state_dict()/load_state_dict()"
        )


# Plain values travel as JSON; orjson writes NaN and infinities as null, so they get a tag.
def encode_plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": repr(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode_plain(v) for v in value]}
    if isinstance(value, list):
        return [encode_plain(v) for v in value]
    return value


def decode_plain(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$float"} and value["$float"] in ("nan", "inf", "-inf"):
            return float(value["$float"])
        if set(value) == {"$tuple"} and isinstance(value["$tuple"], list):
            return tuple(decode_plain(v) for v in value["$tuple"])
        raise ValueError(f"unexpected object in a plain value: {value!r}")
    if isinstance(value, list):
        return [decode_plain(v) for v in value]
    if isinstance(value, SCALARS):
        return value
    raise ValueError(f"unexpected plain value {value!r}")
