"""Who saves, and what the saving ranks agree on at construction, with no collective.

``Savers`` is a Checkpointer's world: by default every rank of the process group (or of
``torch.distributed``'s default group), or ``rank=``/``world_size=`` given by the caller,
or the ranks a caller names with ``ranks=`` (``ranks=[0]``: rank 0 saves alone, as
Lightning's DDP and other frameworks save, while the other ranks wait in the framework's
barrier). A rank outside ``ranks=`` only reads: it loads the whole checkpoint on its own.

The agreement rule: the saving ranks agree on the run id and the session (``run_ids``)
through the default process group's key-value store, never by a collective. The first
saving rank writes the ids under a key and returns at once; the others wait for that key
(up to a timeout that names the rank they wait for). So a construction on a subset never
blocks on a rank that is not there, and one on every rank agrees as a broadcast did. The
key is numbered per saving group in construction order: constructions that span several
ranks happen in the same order on each of them (as collectives must)."""
from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import re
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from flexckpt.agree import global_rank
from flexckpt.format.names import check_run_id
from flexshard import current_world

KEY_PREFIX = "flexckpt/ids"
_constructions: defaultdict[str, itertools.count] = defaultdict(itertools.count)  # saving group -> next key number


@dataclass(frozen=True)
class Savers:
    """This process's place among the ranks that save."""

    rank: int  # among the saving ranks (0 on a rank that only reads)
    world_size: int  # how many ranks save (1 on a rank that only reads)
    saves: bool  # False: a rank outside ranks=, which only reads
    from_dist: bool  # the world came from torch.distributed (not rank=/world_size=)
    global_ranks: tuple[int, ...] = ()  # the saving ranks' global ranks, with torch.distributed
    named: tuple[int, ...] | None = None  # ranks= as given (group ranks, sorted), for messages
    subset: bool = False  # ranks= leaves some ranks of the group out


def who_saves(rank: int | None, world_size: int | None, ranks: Sequence[int] | None,
              group: "dist.ProcessGroup | None") -> Savers:
    """The saving world from ``rank=``/``world_size=``, ``ranks=`` or torch.distributed."""
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank= and world_size=, or neither (to use torch.distributed's)")
    if ranks is not None and rank is not None:
        raise ValueError("pass ranks= (which ranks of the group save) or rank= and world_size= (an explicit world), "
                         "not both")
    if rank is not None:
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank!r} world_size={world_size!r}")
        return Savers(rank, world_size, True, False)
    me, size = current_world(group)
    on = dist.is_available() and dist.is_initialized()
    if ranks is None:
        return Savers(me, size, True, True, tuple(global_rank(r, group) for r in range(size)) if on else ())
    named = _check_ranks(ranks, size)
    every = tuple(global_rank(r, group) for r in named) if on else ()
    subset = len(named) < size
    if me not in named:
        return Savers(0, 1, False, True, (), named, subset)
    return Savers(named.index(me), len(named), True, True, every, named, subset)


def _check_ranks(ranks: Sequence[int], size: int) -> tuple[int, ...]:
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise ValueError(f"ranks= must be a list of group ranks, e.g. ranks=[0], got {ranks!r}")
    named = tuple(ranks)
    if not named or any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < size for r in named) \
            or len(set(named)) != len(named):
        raise ValueError(f"ranks= must name distinct ranks in [0, {size}) of the process group, got {list(named)!r}")
    if len(named) not in (1, size):
        raise ValueError(
            f"ranks={list(named)!r} names {len(named)} of {size} ranks: load agrees across the saving ranks by "
            f"collectives, which need a group of exactly them. Pass process_group=dist.new_group({sorted(named)!r}) "
            f"(made on every rank) instead, or one rank (ranks=[0]), or all of them"
        )
    return tuple(sorted(named))


def given_run_id(run_id: str | None) -> str | None:
    """The run id the caller or the launcher gives: ``run_id=``, ``FLEXCKPT_RUN_ID``, or
    torchrun's run id and restart count; None when none does."""
    if run_id is not None:
        return check_run_id(run_id)
    if os.environ.get("FLEXCKPT_RUN_ID"):
        return check_run_id(os.environ["FLEXCKPT_RUN_ID"])
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        raw = f"{elastic}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:64]
    return None


def run_ids(run_id: str | None, who: Savers, timeout: float) -> tuple[str, str]:
    """``(run id, session)``, the same on every saving rank. The session (8 hex digits)
    tells this launch's save attempts from an earlier launch's with the same run id (run
    ids repeat: torchrun's on a requeue, one passed in on every relaunch), so it is drawn
    by the first saving rank and shared through the store; with ``rank=``/``world_size=``
    and a run id given it follows from the run id, which the caller then keeps unique per
    launch."""
    given = given_run_id(run_id)
    if who.world_size == 1:
        return given or uuid.uuid4().hex[:16], uuid.uuid4().hex[:8]
    if dist.is_available() and dist.is_initialized() and (who.from_dist or given is None):
        drawn = _shared_draw(who, timeout)
        return given or drawn[:16], drawn[16:24]
    if given is None:
        raise ValueError(
            f"rank {who.rank} of {who.world_size} without torch.distributed cannot agree on a run id: "
            f"pass run_id= (the same on every rank) or set FLEXCKPT_RUN_ID"
        )
    return given, hashlib.sha256(given.encode()).hexdigest()[:8]


def _shared_draw(who: Savers, timeout: float) -> str:
    """24 hex digits drawn by the first saving rank, read by the others from the store."""
    group = ",".join(map(str, who.global_ranks)) if who.from_dist else f"world{who.world_size}"
    key = f"{KEY_PREFIX}/{group}/{next(_constructions[group])}"
    store = dist.distributed_c10d._get_default_store()
    if who.rank == 0:
        drawn = uuid.uuid4().hex[:24]
        store.set(key, drawn)
        return drawn
    first = f"global rank {who.global_ranks[0]}" if who.from_dist else "rank 0 (of rank=/world_size=)"
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch's DistStoreError: the key never came
        raise TimeoutError(
            f"rank {who.rank} of {who.world_size} saving ranks waited {timeout:.0f} s (commit_timeout) for {first} "
            f"to construct its Checkpointer (store key {key!r}): construct it on every saving rank, in the same "
            f"order, or name the ranks that save with ranks= (e.g. ranks=[0])"
        ) from exc
    return store.get(key).decode()


def await_peers(store: "dist.Store", me: int, peers: Sequence[int], timeout: float, what: str) -> None:
    """Mark global rank ``me`` present under ``store`` and wait until every rank of ``peers``
    is: the step before a group that needs them all (the fast tier's), so that a rank that
    never comes ends in a timeout naming it rather than in a silent wait."""
    store.set(f"present/{me}", b"1")
    if store.add("present", 1) == len(peers):
        store.set("all-present", b"1")
    try:
        store.wait(["all-present"], datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch's DistStoreError
        time.sleep(0.1)  # a rank that came at the deadline is not named as missing
        missing = [r for r in peers if not store.check([f"present/{r}"])]
        raise TimeoutError(
            f"{what} needs every rank: global rank(s) {missing} did not construct their Checkpointer "
            f"within {timeout:.0f} s"
        ) from exc
