"""Read once, fan out: at a load, each stored chunk that several target ranks need is read
from the store by one of them (the *reader*) and sent to the others over the load's
process group (:mod:`flexckpt.load.exchange`). This module is the plan: pure functions over
the chunk ids each rank needs, no processes, no I/O.

The unit fanned out is the checksummed chunk; chunks travel in *batches*: consecutive,
byte-adjacent chunks of one file with the same reader and the same receivers, at most
``max_batch`` stored bytes (one chunk may be more). A batch is exactly one read request
in the load of every rank that needs it (:func:`flexckpt.load.read_plan.requests_of` cuts a rank's
requests where the chunks' labels change: :meth:`FanoutPlan.labels`).

Who reads: a chunk one rank needs, that rank. The chunks a set of ranks share are given
out among them by *water filling*, set by set (the largest first): each rank of the set is
given a contiguous stretch (in file order) bringing the set's ranks to one level of bytes
read (those already given count), so that a rank reads at most that level plus one chunk
of the set. With the replicas of a shard sharing its chunks (HSDP, DDP, TP-replicated
tensors), every rank reads the stored bytes once over W, within a chunk a set.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    """Chunks ``[first, stop)`` of ``file`` (stored bytes ``[offset, offset + length)``),
    read by ``reader`` and sent to each of ``receivers`` (ranks of the load's group)."""

    file: str
    first: int
    stop: int
    offset: int
    length: int
    reader: int
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class FanoutPlan:
    """The batches, in (file, first chunk) order, which is also the order of the messages
    between every (reader, receiver) pair; ``reads``: the stored bytes each rank reads
    (its own chunks and the batches it reads); ``needed``: the stored bytes of every chunk
    some rank needs, once."""

    batches: list[Batch]
    reads: list[int]
    needed: int

    def labels(self, rank: int, files: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """For the chunks ``files[f]`` of each file ``f`` that ``rank`` needs (ascending):
        the index of the batch each is in, or -1 (the rank reads it for itself alone)."""
        out = {f: np.full(len(ids), -1, dtype=np.int64) for f, ids in files.items()}
        for k, b in enumerate(self.batches):
            if b.file in out and (b.reader == rank or rank in b.receivers):
                lo, hi = np.searchsorted(files[b.file], [b.first, b.stop])
                out[b.file][lo:hi] = k
        return out

    def sends(self, rank: int) -> list[int]:
        """The batches ``rank`` reads and sends, in order."""
        return [k for k, b in enumerate(self.batches) if b.reader == rank]

    def receives(self, rank: int) -> dict[int, list[int]]:
        """The batches ``rank`` receives, by reader, each reader's in order."""
        out: dict[int, list[int]] = {}
        for k, b in enumerate(self.batches):
            if rank in b.receivers:
                out.setdefault(b.reader, []).append(k)
        return out


def plan_fanout(needs: list[dict[str, np.ndarray]], offsets: dict[str, np.ndarray], lengths: dict[str, np.ndarray],
                max_batch: int) -> FanoutPlan:
    """The fan-out of a load. ``needs[r]``: for each data file, the chunk ids rank ``r``
    needs (ascending, no repeats); ``offsets``/``lengths``: each file's chunks' stored
    offsets and lengths. Every chunk some rank needs is read by exactly one rank that needs
    it; a chunk several ranks need goes in a batch to the others."""
    world = len(needs)
    reads = np.zeros(world, dtype=np.int64)
    needed = 0
    shared: dict[tuple[int, ...], list[tuple[str, int]]] = {}  # needers -> their chunks, in file order
    for file in sorted({f for n in needs for f in n}):
        ids = [np.asarray(n.get(file, ()), dtype=np.int64) for n in needs]
        ranks = np.repeat(np.arange(world), [len(i) for i in ids])
        chunk = np.concatenate(ids)
        if not len(chunk):
            continue
        order = np.lexsort((ranks, chunk))
        chunk, ranks = chunk[order], ranks[order]
        size = lengths[file]
        starts = np.flatnonzero(np.append(True, chunk[1:] != chunk[:-1]))
        counts = np.diff(np.append(starts, len(chunk)))
        needed += int(size[chunk[starts]].sum())
        solo = counts == 1
        np.add.at(reads, ranks[starts[solo]], size[chunk[starts[solo]]])
        for s, c in zip(starts[~solo].tolist(), counts[~solo].tolist()):
            shared.setdefault(tuple(ranks[s : s + c].tolist()), []).append((file, int(chunk[s])))
    reads = reads.tolist()
    given: dict[tuple[str, int], int] = {}  # chunk -> its reader
    total = {key: sum(int(lengths[f][c]) for f, c in chunks) for key, chunks in shared.items()}
    for key in sorted(shared, key=lambda k: (-total[k], k)):
        quota = water_fill([reads[r] for r in key], total[key])
        edge = np.cumsum(quota)  # rank key[i] takes the chunks whose middle falls before edge[i]
        at, i = 0, 0
        for f, c in shared[key]:
            n = int(lengths[f][c])
            while i < len(key) - 1 and at + n / 2 > edge[i]:
                i += 1
            given[(f, c)] = key[i]
            reads[key[i]] += n
            at += n
    return FanoutPlan(_batches(shared, given, offsets, lengths, max_batch), reads, needed)


def water_fill(loads: list[int], amount: int) -> list[float]:
    """How much of ``amount`` each of ``len(loads)`` ranks takes so that those that take
    any end at one level, the least loaded first (``loads``: what each holds already)."""
    low = sorted(loads)
    filled, level = 0, 0.0
    for k, x in enumerate(low):
        filled += x
        level = (filled + amount) / (k + 1)
        if k + 1 == len(low) or level <= low[k + 1]:
            break
    return [max(0.0, level - x) for x in loads]


def _batches(shared: dict[tuple[int, ...], list[tuple[str, int]]], given: dict[tuple[str, int], int],
             offsets: dict[str, np.ndarray], lengths: dict[str, np.ndarray], max_batch: int) -> list[Batch]:
    out: list[Batch] = []
    for key, chunks in shared.items():
        run: list[int] = []  # chunk ids of the batch being built
        for f, c in [*chunks, ("", -1)]:
            if run:
                file, reader = run_file, given[(run_file, run[0])]
                end = int(offsets[file][run[-1]] + lengths[file][run[-1]])
                start = int(offsets[file][run[0]])
                joins = (f == file and c == run[-1] + 1 and given[(f, c)] == reader and int(offsets[f][c]) == end
                         and end + int(lengths[f][c]) - start <= max_batch)
                if joins:
                    run.append(c)
                    continue
                out.append(Batch(file, run[0], run[-1] + 1, start, end - start, reader,
                                 tuple(r for r in key if r != reader)))
                run = []
            if c >= 0:
                run, run_file = [c], f
    out.sort(key=lambda b: (b.file, b.first))
    return out


FANOUT_MODES = ("auto", True, False, "nccl")


def wanted(mode: "str | bool", world: int, local: bool, url: str, backend: str | None) -> bool:
    """Whether a load fans out: never for one rank; ``"auto"``: when the store is remote
    (not a local folder, nor ``memory://``, which is each process's own) and the load's
    group runs on gloo (the exchange sends CPU tensors); ``True``: whenever there are
    ranks to share with (an NCCL group is refused: the chunks travel as CPU tensors);
    ``"nccl"``: likewise, over an NCCL group (the chunks travel as device tensors: the
    exchange's :class:`flexckpt.load.exchange.DeviceWire`), any other group refused."""
    if world <= 1 or mode is False:
        return False
    if mode == "nccl":
        if "nccl" not in str(backend):
            raise ValueError(f"fanout='nccl' needs the load's process group on NCCL (the chunks travel as CUDA "
                             f"tensors); this group's backend is {backend!r}: pass process_group= an NCCL group, "
                             f"or fanout=True for a gloo one")
        return True
    if "gloo" not in str(backend):  # "gloo", or a group with gloo for its CPU tensors ("cpu:gloo,cuda:nccl")
        if mode is True:
            raise ValueError(f"fanout=True needs the load's process group on gloo (the chunks travel as CPU tensors); "
                             f"this group's backend is {backend!r}: pass process_group= a gloo group, or fanout='auto'")
        return False
    return mode is True or not (local or url.startswith("memory://"))
