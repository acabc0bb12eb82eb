"""The read plan of a load: for each target piece (its layout at the current world
size), the saved pieces that intersect it, turned into the stored chunks to fetch and the
byte copies to make from each. Pieces on both sides are parts of boxes
(:mod:`flexshard.box`): a flat range is the whole tensor's box. Each shared stretch that is
contiguous in both the saved piece and the target is one run; a chunk is fetched once,
whatever the runs in it, and adjacent chunks in one request. Pure: no processes, no I/O
(the chunk entries come in, read by :func:`flexckpt.format.tables.file_entries`).

A load plans over columns (a file's chunks, the runs cut at their bounds, each touched
chunk tiled by segments, the fetch loop's plain lists), never one object a chunk or a copy.
It is the one read planner, in three steps: :func:`gather_runs`, :func:`file_plans` over
the chunk entries, :func:`requests_of`. The load takes them one by one (the entries it read
in between; a fanned-out load exchanges its file plans before it cuts its requests); the
fast tier's range planning (:mod:`flexckpt.tier.peer_ranges`) and the restore prediction
(:mod:`flexckpt.restore_plan`) through :func:`plan_requests`, the short form, which takes
the entries from ``manifest.files`` (give it a mapping that holds them, as the tier's
planning-only view does: a version-2 manifest's own reads any table it lacks)."""
from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import numpy as np

from flexckpt.errors import ManifestError
from flexckpt.format.manifest import FileEntry, Manifest, PlanPieces, SavedTensor
from flexckpt.format.names import data_name
from flexckpt.state.dtypes import itemsize
from flexshard import FlatRange, MeshLayout, Part, runs
from flexshard.box import whole


class _Runs:
    """The runs a load wants from one file: raw byte start, length, target, byte position
    in the target. A flat piece of a version-1 or mesh-layout tensor adds its one run as
    plain ints; an n-D box adds its runs (one a row, maybe thousands) as arrays; the flat
    wants of version-2 tensors come as columns (:class:`_PlanSpans`)."""

    def __init__(self) -> None:
        self.ints: tuple[list[int], ...] = ([], [], [], [])
        self.arrays: list[tuple[np.ndarray, ...]] = []
        self.spans: list[np.ndarray] | None = None

    def add_flat(self, target: int, raw_offset: int, start: int, stop: int, want: FlatRange | Part, size: int) -> int:
        """The one run two flat ranges of a tensor share at most: elements ``[start, stop)``,
        stored at raw byte ``raw_offset``, against ``want`` (stored from byte 0 of target
        ``target``); ``size`` bytes an element. Returns the elements it adds."""
        lo, hi = max(start, want.start), min(stop, want.stop)
        if lo >= hi:
            return 0
        starts, lengths, dest, pos = self.ints
        starts.append(raw_offset + (lo - start) * size)
        lengths.append((hi - lo) * size)
        dest.append(target)
        pos.append((lo - want.start) * size)
        return hi - lo

    def columns(self) -> list[np.ndarray]:
        cols = [np.array(c, dtype=np.int64) for c in self.ints]
        if self.spans is not None:  # in target order, as one loop over the targets would have added them
            if len(cols[0]):
                cols = [np.concatenate([a, b]) for a, b in zip(self.spans, cols)]
                order = np.argsort(cols[2], kind="stable")
                cols = [c[order] for c in cols]
            else:
                cols = self.spans
        if self.arrays:
            cols = [np.concatenate([c, *(a[k] for a in self.arrays)]) for k, c in enumerate(cols)]
        return cols


class _PlanSpans:
    """The flat wants of version-2 tensors of one plan (a :class:`PlanPieces`): their
    writers' flat spans found, clipped to the wants, checked and split by file as columns,
    for all the wants at once. A row split's writers (most tensors: ``Shard``,
    ``BlockShard``) are computed for every want together (:func:`_row_writers`); another
    layout's are :meth:`WritePlan.flat_spans`' tuples."""

    def __init__(self, source: PlanPieces) -> None:
        self.source = source
        self.targets: list[int] = []
        self.saved: list[SavedTensor] = []
        self.wants: list[FlatRange | Part] = []

    def runs(self, by_file: dict[str, _Runs], sizes: dict) -> tuple[int, int] | None:
        """Adds the runs to ``by_file``; the first target whose writers do not cover its
        want and the elements they hold of it, if any. (Columns by C-level maps over the
        wants: a Python step a want would cost more than the rest.)"""
        plan, m = self.source.plan, len(self.wants)
        spec = list(map(self.source.index.__getitem__, map(_NAME, self.saved)))
        geo = list(map(plan.geometry.__getitem__, spec))
        dtypes = list(map(_DTYPE, self.saved))
        for d in set(dtypes) - sizes.keys():
            sizes[d] = itemsize(d)
        size = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, m)
        want_lo = np.fromiter(map(_START, self.wants), np.int64, m)
        want_hi = np.fromiter(map(_STOP, self.wants), np.int64, m)
        span = np.fromiter([g.span if g.kind == "rows" else 0 for g in geo], np.int64, m)  # 0: spans listed
        of, rank, start, stop = _row_writers(want_lo, want_hi, span, np.fromiter(map(_N, geo), np.int64, m),
                                             plan.world_size)
        listed = np.flatnonzero(span == 0).tolist()
        if listed:
            spans: list[tuple[int, int, int]] = []  # (rank, start, stop) of the listed wants' writers, in order
            counts = []
            for k in listed:
                got = plan.flat_spans(spec[k], self.wants[k].start, self.wants[k].stop)
                counts.append(len(got))
                spans += got
            cols = np.fromiter(itertools.chain.from_iterable(spans), np.int64, 3 * len(spans)).reshape(-1, 3)
            of_listed = np.repeat(np.array(listed, dtype=np.int64), counts)
            if len(of):  # each want's spans together, in want order
                order = np.argsort(np.concatenate((of, of_listed)), kind="stable")
                of, rank, start, stop = (np.concatenate(c)[order] for c in ((of, of_listed), (rank, cols[:, 0]),
                                                                            (start, cols[:, 1]), (stop, cols[:, 2])))
            else:
                of, rank, start, stop = of_listed, cols[:, 0], cols[:, 1], cols[:, 2]
        t = np.array(self.targets, dtype=np.int64)[of]
        i, lo_want, size = np.array(spec, dtype=np.int64)[of], want_lo[of], size[of]
        lo, hi = np.maximum(start, lo_want), np.minimum(stop, want_hi[of])
        n_el = np.maximum(hi - lo, 0)
        held = np.concatenate(([0], np.cumsum(n_el)))[np.cumsum(np.bincount(of, minlength=m))]
        found = held - np.concatenate(([0], held[:-1]))  # elements each want's writers hold
        short = np.flatnonzero(found != want_hi - want_lo)
        keep = np.flatnonzero(n_el > 0)
        order = keep[np.argsort(rank[keep], kind="stable")]  # by file, each in target order
        ends = [*(np.flatnonzero(rank[order[1:]] != rank[order[:-1]]) + 1).tolist(), len(order)]
        offsets, attempt = plan.offsets, self.source.attempt
        begin = 0
        for end in ends if len(order) else ():
            part = order[begin:end]
            begin = end
            r = int(rank[part[0]])
            raw = np.fromiter(map(offsets(r).__getitem__, i[part].tolist()), np.int64, len(part))
            sz = size[part]
            file = data_name(attempt, r)
            acc = by_file.get(file)
            if acc is None:
                acc = by_file[file] = _Runs()
            acc.spans = [raw + (lo[part] - start[part]) * sz, n_el[part] * sz, t[part], (lo[part] - lo_want[part]) * sz]
        if len(short):
            k = int(short[0])
            return self.targets[k], int(found[k])
        return None


_NAME, _DTYPE, _START, _STOP, _N = (operator.attrgetter(a) for a in ("name", "dtype", "start", "stop", "n"))


def _row_writers(lo: np.ndarray, hi: np.ndarray, span: np.ndarray, n: np.ndarray, world: int) -> tuple[np.ndarray, ...]:
    """The writers of flat wants ``[lo, hi)`` of row-split tensors (those with a ``span``,
    elements a rank; ``n`` elements in all): :meth:`WritePlan.flat_spans` of them all, as
    columns (the want, the rank, its flat range), in want order. Rank ``k`` writes elements
    ``[k * span, min((k + 1) * span, n))``."""
    rows = np.flatnonzero(span)
    lo, hi, span, n = lo[rows], hi[rows], span[rows], n[rows]
    first = lo // span
    count = np.maximum(np.minimum(world, -(-hi // span)) - first, 0)
    of = np.repeat(rows, count)
    within = np.arange(len(of)) - np.repeat(np.cumsum(count) - count, count)
    rank = np.repeat(first, count) + within
    span, n = np.repeat(span, count), np.repeat(n, count)
    start = rank * span
    return of, rank, start, np.minimum(start + span, n)


def gather_runs(targets: list[tuple[SavedTensor, FlatRange | Part]]) -> dict[str, list[np.ndarray]]:
    """The runs ``targets`` want, by data file: four int64 columns (raw byte start, length,
    target index, byte position in the target). Needs only the manifest's plan, not the
    files' chunk tables (:func:`cut_runs` then cuts them at the chunks' bounds)."""
    by_file: dict[str, _Runs] = {}
    sizes: dict = {}
    plans: dict[int, _PlanSpans] = {}  # the flat wants of version-2 tensors, by plan
    src = acc_plan = None
    short: tuple[int, int] | None = None
    for t, (saved, want) in enumerate(targets):
        if (saved.pieces is None and want.stop > want.start and not isinstance(saved.layout, MeshLayout)
                and (isinstance(want, FlatRange) or want.box.sizes == saved.shape)):
            # version 2, a flat range of a flat layout wanted: each writer's piece a flat range, one run at most
            if saved.source is not src:
                src = saved.source
                acc_plan = plans.get(id(src)) or plans.setdefault(id(src), _PlanSpans(src))  # type: ignore[arg-type]
            acc_plan.targets.append(t)
            acc_plan.saved.append(saved)
            acc_plan.wants.append(want)
            continue
        shape = saved.shape
        size = sizes.get(saved.dtype) or sizes.setdefault(saved.dtype, itemsize(saved.dtype))
        flat_want = isinstance(want, FlatRange) or want.box.sizes == shape
        if isinstance(want, FlatRange):
            want = Part(whole(shape), want.start, want.stop)
        found = 0
        for piece in saved.pieces_in(want):  # version 2: only the writers of the wanted part, recomputed
            acc = by_file.get(piece.file)
            if acc is None:
                acc = by_file[piece.file] = _Runs()
            if flat_want and piece.box is None:  # two flat ranges of the tensor share at most one run
                found += acc.add_flat(t, piece.raw_offset, piece.start, piece.stop, want, size)
                continue
            shared = runs(Part(piece.box or whole(shape), piece.start, piece.stop), want)
            if len(shared):
                found += int(shared[:, 2].sum())
                acc.arrays.append((piece.raw_offset + shared[:, 0] * size, shared[:, 2] * size,
                                   np.full(len(shared), t, dtype=np.int64), shared[:, 1] * size))
        if found != len(want) and short is None:
            short = (t, found)
    for acc_plan in plans.values():
        got = acc_plan.runs(by_file, sizes)
        if got is not None and (short is None or got < short):
            short = got
    if short is not None:  # the first target in order whose want the checkpoint does not cover
        t, found = short
        _not_covered(targets[t][0], targets[t][1], found)
    return {file: acc.columns() for file, acc in by_file.items()}


def _not_covered(saved: SavedTensor, want: FlatRange | Part, found: int) -> None:
    if isinstance(want, FlatRange):
        want = Part(whole(saved.shape), want.start, want.stop)
    raise ManifestError(
        f"tensor {saved.name!r}: the checkpoint's pieces hold {found} of the {len(want)} elements wanted "
        f"({want}); the checkpoint does not cover every element exactly once"
    )


def cut_runs(file: str, entry: FileEntry, starts: np.ndarray, nbytes: np.ndarray, dest: np.ndarray,
             dest_pos: np.ndarray) -> tuple[np.ndarray, ...]:
    """The runs wanted from ``file`` (``nbytes`` raw bytes at ``starts``, landing at byte
    ``dest_pos`` of target ``dest``) cut at its chunks' bounds, as copies: chunk index,
    byte position in the chunk, length, target, byte position in the target; ordered by
    chunk, and within a chunk in the order the runs came."""
    if not len(starts):
        return tuple(np.empty(0, dtype=np.int64) for _ in range(5))
    offsets = entry.raw_offsets
    ends = offsets + entry.raw_lengths
    stops = starts + nbytes
    first = np.maximum(np.searchsorted(offsets, starts, "right") - 1, 0)
    count = np.searchsorted(offsets, stops, "left") - first  # the chunks each run touches
    run = np.repeat(np.arange(len(starts)), count)
    chunk = first[run] + np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)
    order = np.argsort(chunk, kind="stable")
    run, chunk = run[order], chunk[order]
    lo = np.maximum(starts[run], offsets[chunk])
    hi = np.minimum(stops[run], ends[chunk])
    if (hi <= lo).any() or int((hi - lo).sum()) != int(nbytes.sum()):
        raise ManifestError(f"data file {file}: the bytes a load wants are not all inside its chunks; the "
                            f"checkpoint's chunk table does not match its plan")
    return chunk, lo - offsets[chunk], hi - lo, dest[run], dest_pos[run] + lo - starts[run]


SINK = -1  # a segment's buffer: bytes read only to be checksummed (the part of a chunk no target wants)


@dataclass(frozen=True, eq=False)
class FilePlan:
    """What a load reads of one data file, as columns. ``ids``: the chunks it touches, in
    file order. Each chunk's raw bytes are tiled, in order, by segments: a stretch of a
    target (``seg_dest`` >= 0, at byte ``seg_pos``) or of the sink (:data:`SINK`, at byte
    ``seg_pos`` of the file's bytes nobody wants); chunk ``k``'s are rows
    ``seg_first[k]:seg_first[k + 1]``. ``copy_*``: the copies (chunk ``k``'s are rows
    ``copy_first[k]:copy_first[k + 1]``, by position in the chunk), for compressed chunks."""

    file: str
    entry: FileEntry
    ids: np.ndarray
    seg_first: np.ndarray
    seg_dest: np.ndarray
    seg_pos: np.ndarray
    seg_len: np.ndarray
    copy_first: np.ndarray
    copy_chunk_pos: np.ndarray
    copy_nbytes: np.ndarray
    copy_dest: np.ndarray
    copy_dest_pos: np.ndarray

    @property
    def direct(self) -> np.ndarray:
        """Per touched chunk: every byte of it lands in targets (one segment a copy, no sink)."""
        return np.diff(self.seg_first) == np.diff(self.copy_first)


def file_plan(file: str, entry: FileEntry, columns: list[np.ndarray]) -> FilePlan:
    """:func:`gather_runs`' runs of ``file`` cut at its chunks' bounds (:func:`cut_runs`),
    and each touched chunk tiled by segments (:class:`FilePlan`). Copies of one chunk must
    not overlap."""
    chunk, chunk_pos, nbytes, dest, dest_pos = cut_runs(file, entry, *columns)
    n = len(chunk)
    new_chunk = np.ones(n, dtype=bool)
    new_chunk[1:] = chunk[1:] != chunk[:-1]
    if not new_chunk.all():  # a chunk of several copies: they go by position in it (cut_runs gave them by chunk)
        order = np.lexsort((chunk_pos, chunk))
        chunk, chunk_pos, nbytes, dest, dest_pos = (c[order] for c in (chunk, chunk_pos, nbytes, dest, dest_pos))
    last_in_chunk = np.ones(n, dtype=bool)
    last_in_chunk[:-1] = new_chunk[1:]
    ends = chunk_pos + nbytes
    prev_end = np.zeros(n, dtype=np.int64)
    prev_end[1:] = ends[:-1]
    gap = chunk_pos - np.where(new_chunk, 0, prev_end)  # raw bytes before each copy that no copy wants
    if (gap < 0).any():
        k = int(np.flatnonzero(gap < 0)[0])
        raise ManifestError(f"data file {file}: two runs a load wants overlap in the chunk at raw byte "
                            f"{int(entry.raw_offsets[chunk[k]])}; the checkpoint's pieces overlap")
    tail = np.where(last_in_chunk, entry.raw_lengths[chunk] - ends, 0)  # after a chunk's last copy
    ids, copy_start = chunk[new_chunk], np.flatnonzero(new_chunk)
    copy_first = np.append(copy_start, n).astype(np.int64)
    if new_chunk.all() and not gap.any() and not tail.any():  # each chunk whole in one target: a segment a copy
        return FilePlan(file, entry, ids, copy_first, dest, dest_pos, nbytes, copy_first, chunk_pos, nbytes, dest,
                        dest_pos)
    # segments, three slots a copy: the gap before it, itself, the chunk's tail after it
    lens = np.empty((n, 3), dtype=np.int64)
    lens[:, 0], lens[:, 1], lens[:, 2] = gap, nbytes, tail
    dests = np.full((n, 3), SINK, dtype=np.int64)
    dests[:, 1] = dest
    poss = np.zeros((n, 3), dtype=np.int64)
    poss[:, 1] = dest_pos
    keep = lens.reshape(-1) > 0
    lens, dests, poss = lens.reshape(-1)[keep], dests.reshape(-1)[keep], poss.reshape(-1)[keep]
    sink = dests == SINK
    sink_lens = np.where(sink, lens, 0)
    poss = np.where(sink, np.cumsum(sink_lens) - sink_lens, poss)
    # a chunk's first segment: its first copy's gap, or the copy itself (never empty)
    kept_before = np.cumsum(keep) - keep
    seg_start = kept_before[3 * copy_start + (gap[copy_start] == 0)]
    return FilePlan(file, entry, ids, np.append(seg_start, len(lens)).astype(np.int64), dests, poss, lens, copy_first,
                    chunk_pos, nbytes, dest, dest_pos)


class Scatter(NamedTuple):
    """A file's requests as the fetch loop walks them, in plain lists (indexed a chunk at a
    time: numpy scalars would cost more than the lists). Places: where the bytes are read
    to, in file order, adjacent segments of one buffer merged (never across a group or a
    request), a sink place at its byte in its request's sink. Per touched chunk: its
    checksum, its stored offset, whether it has several segments, and its first segment."""

    place_dest: list[int]
    place_pos: list[int]
    place_len: list[int]
    checks: list[int]
    offsets: list[int]
    multi: list[bool]
    multi_before: list[int]  # multi-segment chunks before each touched chunk (one more entry)
    sunk_before: list[int]  # chunks with a sink segment (not direct) before each touched chunk (the same)
    first_dest: list[int]
    first_pos: list[int]
    first_len: list[int]
    seg_first: list[int]
    seg_dest: list[int]
    seg_pos: list[int]
    seg_len: list[int]


class Request(NamedTuple):
    """One ranged read of consecutive stored chunks of one file: touched chunks
    ``[first, stop)`` of ``plan`` (indices into ``plan.ids``), stored bytes
    ``[offset, offset + length)``; ``sink_bytes``: the bytes of its chunks no target wants
    (read into a scratch buffer of its own, to be checksummed); ``groups``: where a local
    read cuts it (each group's touched-chunk end and place end), its places starting at
    ``place_start``."""

    plan: FilePlan
    first: int
    stop: int
    offset: int
    length: int
    scatter: Scatter | None = None
    compressed: bool = False  # some chunk of it is (then it is read whole into scratch, chunk by chunk)
    sink_bytes: int = 0
    place_start: int = 0
    groups: tuple[tuple[int, int], ...] = ()


def plan_requests(manifest: Manifest, targets: list[tuple[SavedTensor, FlatRange | Part]],
                  max_bytes: int, group_bytes: int | None = None) -> list[Request]:
    """The reads a load of ``targets`` makes (a saved tensor and the part of it wanted,
    stored contiguously in the target; or a flat range of it; every wanted element must be
    in the checkpoint exactly once): the chunks it touches, each once, in file order,
    merged into ranged reads (:func:`requests_of`), without an object a chunk. With
    ``group_bytes``, each request also carries its :class:`Scatter` and its read groups."""
    return requests_of(file_plans(gather_runs(targets), manifest.files), max_bytes, group_bytes)


def file_plans(by_file: dict[str, list[np.ndarray]], entries: Mapping[str, FileEntry]) -> list[FilePlan]:
    """The :class:`FilePlan` of each file of ``by_file`` (:func:`gather_runs`' runs), in file
    order, over ``entries``, the chunk entries of (at least) those files (a fanned-out load
    learns every rank's chunks from them before it cuts its requests)."""
    return [file_plan(file, entries[file], by_file[file]) for file in sorted(by_file)]


def requests_of(plans: list[FilePlan], max_bytes: int, group_bytes: int | None = None,
                labels: "dict[str, np.ndarray] | None" = None) -> list[Request]:
    """The requests of ``plans`` (:func:`file_plans`): each file's touched chunks merged
    into ranged reads (:func:`_reads`); with ``group_bytes``, each also carries its
    :class:`Scatter` and its read groups (:func:`_scatter`). ``labels``: per file, a label for
    each touched chunk; a request never holds chunks of two labels (a fanned-out load labels
    each chunk with the batch it comes in, :mod:`flexckpt.load.fanout`)."""
    out: list[Request] = []
    for plan in plans:
        reads = _reads(plan, max_bytes, None if labels is None else labels.get(plan.file))
        out += [Request(plan, *r) for r in reads] if group_bytes is None else _scatter(plan, reads, group_bytes)
    return out


def _reads(plan: FilePlan, max_bytes: int, labels: np.ndarray | None) -> list[tuple[int, int, int, int]]:
    """``plan``'s touched chunks merged into ranged reads: runs of chunks touching in the
    file (and of one label, where ``labels`` gives each touched chunk one), cut where a
    request would pass ``max_bytes`` (one chunk may). Each a tuple: first and stop touched
    chunk, stored offset, length."""
    if not len(plan.ids):
        return []
    offsets = plan.entry.offsets[plan.ids]
    ends = offsets + plan.entry.lengths[plan.ids]
    cut = offsets[1:] != ends[:-1]
    if labels is not None:
        cut |= labels[1:] != labels[:-1]
    breaks = np.flatnonzero(cut) + 1
    first, stop = np.concatenate(([0], breaks)), np.append(breaks, len(offsets))  # the runs of touching chunks
    start = offsets[first]
    length = ends[stop - 1] - start
    if (length <= max_bytes).all():  # each run one request
        return list(zip(first.tolist(), stop.tolist(), start.tolist(), length.tolist()))
    starts, stops = offsets.tolist(), ends.tolist()
    out: list[tuple[int, int, int, int]] = []
    for a, b in zip(first.tolist(), stop.tolist()):
        while a < b:
            start = starts[a]
            if stops[b - 1] - start <= max_bytes:
                end = b
            else:
                end = max(a + 1, bisect.bisect_right(stops, start + max_bytes, a, b))
            out.append((a, end, start, stops[end - 1] - start))
            a = end
    return out


def _group_ends(lengths: "list[int] | np.ndarray", stops: list[int], group_bytes: int) -> tuple[list[int], list[int]]:
    """Where a local read cuts requests of chunks of stored ``lengths`` (consecutive
    requests from chunk 0, ending at ``stops``) into groups: after the first chunk that
    brings a group to ``group_bytes``, and after a request's last. Every group's end (an
    index into ``lengths``), in order, and where each request's ends begin in them (one
    more entry). Where a group from each chunk would end is one array call; then one step a
    group, in the requests longer than one group."""
    n = len(lengths)
    cum = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    after = np.searchsorted(cum, cum[:-1] + group_bytes, "left")  # a group from chunk k ends after chunk after[k] - 1
    nxt = np.append(np.maximum(after, np.arange(1, n + 1)), n + 1)  # (at least one chunk: a group_bytes of 0)
    ends_at = np.array(stops, dtype=np.int64)
    firsts = np.concatenate(([0], ends_at[:-1]))
    one = nxt[firsts] >= ends_at  # the request is one group
    if one.all():
        return list(stops), list(range(len(stops) + 1))
    nxt_l = nxt.tolist()
    ends: list[int] = []
    bounds = [0]
    for k, stop, whole in zip(firsts.tolist(), stops, one.tolist()):
        if not whole:
            while True:
                k = nxt_l[k]
                if k >= stop:
                    break
                ends.append(k)
        ends.append(stop)
        bounds.append(len(ends))
    return ends, bounds


def _scatter(plan: FilePlan, reads: list[tuple[int, int, int, int]], group_bytes: int) -> list[Request]:
    """The requests of ``reads`` (of ``plan``, in order, as :func:`_reads` gives them) with
    their read groups (:func:`_group_ends`) and the file's :class:`Scatter`: every list the
    fetch loop needs, built in one vectorized pass."""
    if not reads:
        return []
    entry, ids = plan.entry, plan.ids
    seg_first, dest, pos, seg_len = plan.seg_first, plan.seg_dest, plan.seg_pos, plan.seg_len
    n = len(ids)
    stops = [r[1] for r in reads]
    ends, bounds = _group_ends(entry.lengths[ids], stops, group_bytes)  # requests from chunk 0, one after another
    cut_chunks = [0, *ends[:-1]]  # each group's first chunk
    one_each = len(seg_len) == n  # one segment a chunk: its first is all of it
    sink = None if one_each else dest == SINK  # (a chunk of one segment has no sink: it is the chunk's copy)
    if sink is not None and sink.any():  # a request's sink starts at 0: sink positions counted from its first segment's
        sink_before = np.concatenate(([0], np.cumsum(np.where(sink, seg_len, 0))))  # at each segment
        req_segs = seg_first[[r[0] for r in reads] + [n]]
        pos = np.where(sink, pos - np.repeat(sink_before[req_segs[:-1]], np.diff(req_segs)), pos)
        sinks = sink_before[seg_first].tolist()
        sunk = np.add.reduceat(sink, seg_first[:-1]) > 0
        sunk_before = np.concatenate(([0], np.cumsum(sunk))).tolist()
    else:  # every chunk lands whole in targets (a load at the saved layout, or gathering whole pieces)
        sinks = sunk_before = [0] * (n + 1)
    # a place starts where a segment does not continue the one before in the same buffer,
    # and at every group's first segment
    start = np.ones(len(seg_len), dtype=bool)
    start[1:] = (dest[1:] != dest[:-1]) | (pos[1:] != pos[:-1] + seg_len[:-1])
    start[seg_first[cut_chunks]] = True
    firsts = np.flatnonzero(start)
    place_len = np.add.reduceat(seg_len, firsts) if len(firsts) else seg_len
    # the place each group ends at (the next one's first, or the end)
    place_end = np.searchsorted(firsts, seg_first[ends], "left").tolist()
    if one_each:
        heads = dest.tolist(), pos.tolist(), seg_len.tolist()
        multi, multi_before, segs = [False] * n, [0] * (n + 1), ([], [], [], [])
    else:
        multi_a = np.diff(seg_first) > 1
        first = seg_first[:-1]
        heads = dest[first].tolist(), pos[first].tolist(), seg_len[first].tolist()
        multi, multi_before = multi_a.tolist(), np.concatenate(([0], np.cumsum(multi_a))).tolist()
        segs = (seg_first.tolist(), dest.tolist(), pos.tolist(), seg_len.tolist())
    lists = Scatter(dest[firsts].tolist(), pos[firsts].tolist(), place_len.tolist(), entry.checksums[ids].tolist(),
                    entry.offsets[ids].tolist(), multi, multi_before, sunk_before, *heads, *segs)
    codecs = entry.codec_ids[ids] != 0
    packed = np.concatenate(([0], np.cumsum(codecs))).tolist() if codecs.any() else [0] * (n + 1)
    groups, place_start = list(zip(ends, place_end)), [0, *place_end]  # a request's first place: its first group's
    make = Request._make  # (half the time of Request(...): a resharding load makes hundreds)
    return [make((plan, a, b, offset, length, lists, packed[b] > packed[a], sinks[b] - sinks[a], place_start[g],
                  tuple(groups[g:h])))
            for (a, b, offset, length), g, h in zip(reads, bounds, bounds[1:])]
