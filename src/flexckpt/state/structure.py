"""Walking a training state: nested dicts (and lists) of tensors, ShardedTensors, plain
values, ``bytes`` values (addressed by key), per-lane and per-rank values, and objects
with ``state_dict()`` / ``load_state_dict()``.

A walk turns the state into flat, named leaves. Names are ``/``-joined keys (``%`` and
``/`` inside a key are escaped; an int key whose str form the same dict also holds as a
str key has its first character escaped too: ``{1: a, "1": b}`` names them ``%31`` and
``1``). Users see key paths, never names (:mod:`flexckpt.state.tree`). The walk also records the
*container tree* (:attr:`Walk.tree`): which dicts, lists and tuples hold the leaves, with
their keys in order, so that a state comes back without a template. The *structure* is what every rank must agree on: tensor
names, dtypes, global shapes and layouts, and the names of plain, per-lane and per-rank
values (never their contents). ``bytes`` values are not part of it: ranks hold different
sets of keys (each data-parallel replica its own), see :mod:`flexckpt.state.values`.

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

from flexckpt.errors import UnsupportedState
from flexckpt.state.dtensor import dtensor_leaf, dtensor_type, is_dtensor
from flexckpt.state.dtypes import dtype_name
from flexckpt.state.plain import MAX_INT, MIN_INT, SCALARS, decode_plain, encode_plain, is_plain_atom
from flexckpt.state.values import MAX_BYTES_VALUE, ByLane, PerRank
from flexshard import Layout, Replicate, ShardedTensor

__all__ = ["SCALARS", "decode_plain", "encode_plain"]  # plain values live in flexckpt.state.plain

MAX_TREE_DEPTH = 100  # dicts, lists and tuples nested in a state (checked at save, and in a manifest)


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
    plain_json: dict[str, Any] = field(default_factory=dict)  # the same, encoded (flexckpt.state.plain)
    plain_slots: dict[str, Slot] = field(default_factory=dict)
    lanes: dict[str, ByLane] = field(default_factory=dict)
    per_rank: dict[str, PerRank] = field(default_factory=dict)
    keyed: dict[str, bytes] = field(default_factory=dict)  # bytes values, by key
    keyed_slots: dict[str, Slot] = field(default_factory=dict)
    errors: list[tuple[str, BaseException]] = field(default_factory=list)  # leaves that cannot be checkpointed
    tree: Any = None  # the container tree (see flexckpt.state.tree): ["d", keys, kids] of the state
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
        raise TypeError(f"key {key!r} is a {type(key).__name__}; state keys must be str or int: use str(key)")
    s = str(key)
    if s == "":
        raise ValueError("state keys must not be empty strings")
    return s.replace("%", "%25").replace("/", "%2F")


def child_name(d: Any, key: Any) -> str:
    """The name part of ``d[key]`` (``d`` a dict): its escaped key, and for an int key
    whose str form ``d`` also holds as a key, with its first character escaped as well."""
    if type(key) is not int:
        return escape_key(key)
    if not MIN_INT <= key <= MAX_INT:
        raise ValueError(f"int key {key} does not fit in 64 bits; use str keys")
    s = str(key)
    # {1: a, "1": b}: told apart ("%31" and "1"); the names of every other dict unchanged
    return f"%{ord(s[0]):02X}{s[1:]}" if s in d else s


Excluder = Callable[[str], bool]  # name -> whether load(..., exclude=...) leaves it out


def path_pattern(path: tuple) -> str:
    """An ``exclude`` pattern matching exactly the leaf or container at ``path`` (and so
    all below it): its parts escaped as names are, ``fnmatch``'s special characters
    bracketed."""
    if not isinstance(path, tuple) or not path or not all(
            (type(p) is str and p) or type(p) is int for p in path):
        raise TypeError(f"a key path is a non-empty tuple of non-empty str and int keys, got {path!r}")
    name = "/".join(str(p).replace("%", "%25").replace("/", "%2F") for p in path)
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def excluder(patterns: Any) -> "Excluder | None":
    """A test ``name -> bool`` for ``load(..., exclude=patterns)``: a leaf is excluded when a
    pattern (``fnmatch``: ``*`` also crosses ``/``) matches its name or the name of a
    container above it (``"data"`` and ``"data/*"`` both exclude ``data/dp_rank_0``). A
    pattern is the ``/``-joined keys, with ``%`` and ``/`` inside a key written ``%25`` and
    ``%2F``; a key path (a tuple of keys, ``("a/b", 0)``) may stand for a pattern and
    excludes that key and all below it. None when there are no patterns."""
    if patterns is None or patterns == ():
        return None
    if isinstance(patterns, str) or not all(
            (isinstance(p, str) and p) or isinstance(p, tuple) for p in patterns):
        raise TypeError(f"exclude must be a tuple of non-empty name patterns or key paths, such as ('data/*',) or "
                        f"(('opt', 'state'),), got {patterns!r}")
    pats = tuple(path_pattern(p) if isinstance(p, tuple) else p for p in patterns)

    def gone(name: str) -> bool:
        parts = name.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(fnmatch.fnmatchcase(p, pat) for pat in pats for p in prefixes)

    return gone


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _is_plain_sequence(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and all(isinstance(x, SCALARS) or is_plain_atom(x) for x in obj)


def walk(state: Any, rank: int, world_size: int) -> Walk:
    """Flatten ``state``. Stateful objects are asked for their ``state_dict()`` here, on
    the calling thread."""
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    out = Walk()
    out.tree = _walk_dict(state, "", out, rank, world_size, 0)
    if out.errors:
        raise UnsupportedState(out.errors)
    return out


def check_state(state: dict, rank: int = 0, world_size: int = 1) -> None:
    """``Checkpointer.check`` without a Checkpointer (a framework's hook that checks before
    it knows where checkpoints go): raise ``UnsupportedState`` naming every leaf of
    ``state`` that rank ``rank`` of ``world_size`` could not save. No I/O, no collective."""
    walk(state, rank, world_size)


# what a leaf's conversion raises when the leaf cannot be checkpointed: collected, not fatal
_REFUSALS = (TypeError, ValueError, NotImplementedError)


def _walk_dict(d: dict, prefix: str, out: Walk, rank: int, world_size: int, depth: int) -> list:
    """Walks ``d``; returns its node of the container tree, ``["d", keys, kids]``."""
    # the save path's per-tensor work: plain tensors under plain string keys take the
    # short way (no call, no escaping)
    key_list, tensors = out.key, out.tensors
    keys: list = []
    kids: list = []  # a node each key: 0 for a leaf
    dtensor = dtensor_type()  # None before torch.distributed.tensor is imported: no DTensor exists
    for key, value in d.items():
        if type(key) is str and key and "/" not in key and "%" not in key:
            name = prefix + key
        else:
            try:
                name = prefix + child_name(d, key)
            except _REFUSALS as e:
                out.errors.append((f"{prefix}{key!r}", e))
                continue
        keys.append(key)
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            key_list.append((name, value.dtype, value.shape, value.device))
            tensors.append(value)
            kids.append(0)
        elif type(value) is dtensor:  # FSDP2's optimizer moments, get_state_dict's leaves: as short
            try:
                local, layout, shape = dtensor_leaf(value, name, rank, world_size)
            except _REFUSALS as e:
                out.errors.append((name, e))
                continue
            key_list.append((name, local.dtype, shape, layout, local.shape, local.device))
            tensors.append(local)
            kids.append(0)
        elif type(value) is ShardedTensor and value.rank == rank and value.world_size == world_size:
            local = value.local  # as _walk_leaf's, without its tests (another world: it names the error)
            key_list.append((name, local.dtype, value.global_shape, value.layout, local.shape, local.device))
            tensors.append(local)
            kids.append(0)
        else:
            kids.append(_walk_value(value, name, d, key, out, rank, world_size, depth))
    return ["d", keys, kids]


def _walk_value(value: Any, name: str, parent: Any, key: Any, out: Walk, rank: int, world_size: int,
                depth: int) -> Any:
    """Walks one value of a container; returns its node of the container tree (0: a leaf)."""
    try:
        return _walk_leaf(value, name, parent, key, out, rank, world_size, depth)
    except _REFUSALS as e:  # this leaf cannot be checkpointed: note it, walk on (see the module doc)
        out.errors.append((name, e))
    except RecursionError:
        out.errors.append((name, ValueError("nested deeper than Python's recursion limit; flatten it")))
    return 0


def _walk_leaf(value: Any, name: str, parent: Any, key: Any, out: Walk, rank: int, world_size: int,
               depth: int) -> Any:
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
    elif isinstance(value, dict):
        _check_depth(depth)
        return _walk_dict(value, name + "/", out, rank, world_size, depth + 1)
    elif isinstance(value, ByLane):
        out.lanes[name] = value
        out.key.append((name, "lanes"))
    elif isinstance(value, PerRank):
        out.per_rank[name] = value
        out.key.append((name, "rank"))
    elif isinstance(value, SCALARS) or is_plain_atom(value) or _is_plain_sequence(value):
        out.plain_json[name] = encode_plain(value)  # refuses what JSON cannot carry, now
        out.plain[name] = value
        out.plain_slots[name] = Slot(parent, key, value)
        out.key.append((name,))
    elif isinstance(value, (list, tuple)):
        _check_depth(depth)
        kids = [_walk_value(item, f"{name}/{i}", value, i, out, rank, world_size, depth + 1)
                for i, item in enumerate(value)]
        return ["l" if isinstance(value, list) else "t", kids]
    elif _is_stateful(value):
        sd = value.state_dict()
        if not isinstance(sd, dict):
            raise TypeError(f"{name!r}.state_dict() returned {type(sd).__name__}, expected a dict")
        _check_depth(depth)
        out.statefuls.append((name, value, sd))
        return _walk_dict(sd, name + "/", out, rank, world_size, depth + 1)
    elif hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        # numpy scalars: store as the Python scalar they hold
        return _walk_value(value.item(), name, parent, key, out, rank, world_size, depth)
    else:
        raise TypeError(
            f"cannot checkpoint {name!r} of type {type(value).__name__}: use tensors, DTensors, ShardedTensor, "
            f"plain values (None, bool, int, float, str, torch.dtype, torch.device, pathlib paths, enums, classes, "
            f"dataclasses of plain fields), bytes, dicts, lists, tuples, ByLane, PerRank, or an object with "
            f"state_dict()/load_state_dict() (flexckpt never pickles)"
        )
    return 0


def _check_depth(depth: int) -> None:
    if depth >= MAX_TREE_DEPTH:
        raise ValueError(f"dicts, lists and tuples nested deeper than {MAX_TREE_DEPTH} levels cannot be "
                         f"checkpointed; flatten the state")


