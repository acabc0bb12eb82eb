"""What a node holds of the fast tier, and the choice of the step to restore (pure).

A node's tier folder mirrors a checkpoint's layout: ``step-N/ATTEMPT/rNNNNN.data`` (and
``.table``, ``.values``) for each saved rank whose files the node holds, its own or a
partner's copy. A saved rank's files count only once its marker
``ATTEMPT/rNNNNN-wWWWWW.done`` exists: a JSON document (the rank's record, whose line
holds its table's and values' xxh3, the lengths of its files, the number of chunks, the
run lineage and structure fingerprint), written after the files (a copy's files checked
on receipt: :func:`check_copy`) and renamed into place.

Ranks may save different structures (pipeline stages, each holding its own keys): a
marker carries its rank's structure when the rank is saved rank 0 or the lowest rank of
the meshes its stage's tensors live on, so a step holds one structure per stage, and a
step is restored only when the union of its saved structures matches the union of the
target ranks' (names, dtypes and global shapes; layouts may differ)."""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from flexckpt.checksum import checksum, digest
from flexckpt.chunktable import parse_table
from flexckpt.names import data_name, parse_step_dir, step_dir, table_name, values_name
from flexckpt.storage import Storage
from flexckpt.structure import excluder, fingerprint

_DONE = re.compile(r"^r(\d{5})-w(\d{5})\.done$")
MAX_DONE_BYTES = 64 << 20


def done_name(attempt: str, rank: int, world: int) -> str:
    return f"{attempt}/r{rank:05d}-w{world:05d}.done"


@dataclass(frozen=True)
class Held:
    """One saved rank's complete files of one fast-tier save, on one node."""

    step: int
    attempt: str
    rank: int
    world: int
    doc: dict  # the marker: record, files, lineage, fingerprint


def scan(storage: Storage) -> list[Held]:
    """Every complete saved-rank bundle under a node's tier folder (files present with
    the lengths their marker names)."""
    out = []
    for name in storage.list_names(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        for attempt in storage.list_names(name):
            for f in storage.list_names(f"{name}/{attempt}"):
                m = _DONE.match(f)
                if not m:
                    continue
                try:
                    doc = orjson.loads(storage.read_bytes(f"{name}/{attempt}/{f}", limit=MAX_DONE_BYTES))
                    ok = all(storage.size(f"{name}/{rel}") == n for rel, n in file_lengths(doc).items())
                except Exception:  # noqa: BLE001 - a damaged or partial bundle is not held
                    ok = False
                if ok:
                    out.append(Held(step, attempt, int(m.group(1)), int(m.group(2)), doc))
    return out


def attempt_order(attempt: str) -> int:
    return int(attempt.rsplit(".", 1)[-1])


def _newness(key: tuple) -> tuple[int, int, int, int]:
    """How new a held save is: its launch first (numbered in the run folder; a launch that
    saves to the tier either restored from it, its steps following the restored one, or
    went on from elsewhere, and then the earlier launches' steps are another branch), then
    its branch in the launch (counted up by each load the tier did not serve), then its
    step, then its attempt. Never a tie broken by a listing's order."""
    return key[3], key[4], key[0], attempt_order(key[1])


@dataclass
class Decision:
    """The step to restore, and from where. ``source == "tier"``: ``holders[r]`` lists the
    gathered-inventory indices (ranks of this launch) whose nodes hold saved rank ``r``."""

    source: str  # "tier", "persistent" or "none"
    step: int | None
    attempt: str | None = None
    world: int = 0
    holders: dict[int, list[int]] = field(default_factory=dict)
    docs: dict[int, dict] = field(default_factory=dict)
    reason: str = ""
    missing: list[int] = field(default_factory=list)  # saved ranks no node holds: the store's same step serves them
    other_structure: bool = False  # a complete step of this lineage was saved with another structure than the target's


def compat_union(structures: list[dict]) -> str:
    """What must match between the ranks' saved states and the states a load fills, at any
    world size and pipeline degree: the union of the ranks' tensor names, dtypes and global
    shapes, and of their value names (layouts may differ: an ``Owned`` tensor's owner
    depends on the world size, a stage's mesh on the stage count). Of one structure: that
    structure's."""
    tensors = sorted({(t["name"], t.get("dtype"), tuple(t.get("shape") or ())) for st in structures for t in st["tensors"]})
    names = {kind: sorted({n for st in structures for n in st[kind]}) for kind in ("plain", "lanes", "per_rank")}
    return fingerprint({"tensors": tensors, **names})


def compat_fingerprint(structure: dict) -> str:
    return compat_union([structure])


def without(structure: dict, gone: Any) -> dict:
    """A structure less the names ``gone`` (an :func:`~flexckpt.structure.excluder`) takes out."""
    return {"tensors": [t for t in structure["tensors"] if not gone(t["name"])],
            **{kind: [n for n in structure[kind] if not gone(n)] for kind in ("plain", "lanes", "per_rank")}}


def saved_compat(docs: dict[int, dict], exclude: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """``(compat_union of a step's saved structures, "")`` from its markers, or ``(None,
    why)`` when a stage's structure is in none of them. With ``exclude`` (a load's), the
    names it takes out are left out of each saved structure first."""
    gone = excluder(exclude)
    fps = {d.get("fingerprint") for d in docs.values()}
    if len(fps) == 1 and gone is None:
        return next(iter(fps)), ""
    if len(fps) == 1:  # saved rank 0's marker carries the structure every rank saved
        first = docs.get(0, {}).get("structure")
        if not isinstance(first, dict):
            return None, f"tier step {next(iter(docs.values())).get('step')}: saved rank 0's marker is not held"
        return compat_union([without(first, gone)]), ""
    carried = {d["line"][0]: d["structure"] for d in docs.values() if isinstance(d.get("structure"), dict) and d.get("line")}
    need: dict[str, dict] = {}
    for r in sorted(docs):
        line = docs[r].get("line") or [None]
        if line[0] not in carried:
            return None, (f"tier step {docs[r].get('step')}: the structure of saved rank {r} (its pipeline stage's) is "
                          f"in no marker of the step")
        need[line[0]] = carried[line[0]] if gone is None else without(carried[line[0]], gone)
    return compat_union(list(need.values())), ""


def choose(
    inventories: list[list[Held]], lineage: str, fingerprint: str, persistent: list[int], exclude: tuple[str, ...] = ()
) -> Decision:
    """The newest step complete across the surviving nodes (every saved rank held by some
    node, same lineage and fingerprint), or partly held when the persistent store holds the
    same step (its ``missing`` ranks come from the store; the load checks that the store's
    step is the same save), or the newest persistent step, whole, when that is newer or no
    tier step qualifies. Steps are never mixed. ``fingerprint`` is the target's structure
    less what ``exclude`` takes out, and so is each step's saved one."""
    found: dict[tuple, dict[int, list[int]]] = {}  # by (step, attempt, world, launch, branch)
    docs: dict[tuple, dict[int, dict]] = {}
    foreign = 0
    for who, held in enumerate(inventories):
        for h in held:
            if h.doc.get("lineage") != lineage:
                foreign += 1
                continue
            key = (h.step, h.attempt, h.world, int(h.doc.get("launch", 0)), int(h.doc.get("branch", 0)))
            found.setdefault(key, {}).setdefault(h.rank, []).append(who)
            docs.setdefault(key, {})[h.rank] = h.doc
    complete = [k for k, ranks in found.items() if len(ranks) == k[2] and set(ranks) == set(range(k[2]))]
    other_structure = False
    whys = []  # the fingerprint is the union of the target ranks' structures; a step's, of its saved ranks'
    for k in sorted(complete, key=_newness):
        fp, why = saved_compat(docs[k], exclude)
        if fp != fingerprint:
            other_structure = True
            complete.remove(k)
            foreign += sum(len(v) for v in found.pop(k).values())
            if why:
                whys.append(why)
    newest_persistent = max(persistent) if persistent else None
    partial = sorted((k for k in found if k not in complete), key=_newness)
    note = ""
    if partial:
        k = partial[-1]
        missing = sorted(set(range(k[2])) - set(found[k]))
        note = f"; tier step {k[0]} lacks the files of saved rank(s) {missing[:10]} on every surviving node"
    if foreign:
        note += f"; {foreign} bundle(s) of another lineage or structure ignored"
    if whys:
        note += f"; {whys[-1]}"
    # a partial step the store holds too, with this state's structure (the store's step must
    # be the same save: checked at load)
    mixable = [k for k in partial if k[0] in persistent and saved_compat(docs[k], exclude)[0] == fingerprint]
    if complete or mixable:
        best = max(complete + mixable, key=_newness)
        if newest_persistent is None or best[0] >= newest_persistent:
            holders = {r: sorted(set(hs)) for r, hs in found[best].items()}
            if best in complete:
                return Decision("tier", best[0], best[1], best[2], holders, docs[best],
                                f"fast tier step {best[0]} is complete across the surviving nodes{note}")
            missing = sorted(set(range(best[2])) - set(found[best]))
            return Decision("tier", best[0], best[1], best[2], holders, docs[best],
                            f"fast tier step {best[0]} lacks saved rank(s) {missing[:10]} on every surviving node; "
                            f"the persistent store holds step {best[0]}: those parts come from it{note}", missing)
        return Decision("persistent", newest_persistent,
                        reason=f"persistent step {newest_persistent} is newer than tier step {best[0]}{note}", other_structure=other_structure)
    if newest_persistent is not None:
        return Decision("persistent", newest_persistent,
                        reason=f"no fast-tier step is complete; loading persistent step {newest_persistent} whole{note}", other_structure=other_structure)
    return Decision("none", None, reason=f"no fast-tier step is complete and nothing is persistent{note}", other_structure=other_structure)


def remove_bundle(storage: Storage, step: int, doc_name: str, files: list[str]) -> None:
    """One saved rank's files of one step: the marker first (a half-removed bundle is never
    complete), then the files, then the folders if empty (another rank's files may share them)."""
    folder = step_dir(step)
    storage.remove(f"{folder}/{doc_name}")
    for rel in files:
        storage.remove(f"{folder}/{rel}")
    for rel in (f"{folder}/{doc_name.rsplit('/', 1)[0]}", folder):
        try:
            os.rmdir(storage.path(rel))
        except OSError:
            pass


REMOVED = ".removed"  # a node's tier folder: step folders set aside, their files being removed


def set_aside(root: str, keep: int, tag: str | None = None) -> list[str]:
    """Move every step folder of the tier folder ``root`` but ``keep`` into ``root/.removed``
    (a rename each: at once, and no scan sees them again); returns their new paths, for
    :func:`remove_paths` to delete off the critical path (unlinking a step's files, which
    frees their tmpfs pages, takes time a recovery's ``load()`` must not wait for).
    ``tag`` keeps two calls' names apart (default: this process and the clock). Only while
    no rank of the node writes."""
    tag = tag or f"{os.getpid()}-{time.monotonic_ns()}"
    out = []
    for n in os.listdir(root):
        s = parse_step_dir(n)
        if s is not None and s != keep:
            os.makedirs(os.path.join(root, REMOVED), exist_ok=True)
            dst = os.path.join(root, REMOVED, f"{n}.{tag}")
            os.rename(os.path.join(root, n), dst)
            out.append(dst)
    return out


def set_aside_before(root: str) -> list[str]:
    """What an earlier process set aside and did not finish removing (it was killed)."""
    try:
        return [os.path.join(root, REMOVED, n) for n in os.listdir(os.path.join(root, REMOVED))]
    except FileNotFoundError:
        return []


def remove_paths(paths: list[str]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def file_lengths(doc: dict) -> dict[str, int]:
    """The files a marker names, with their lengths, in order. A marker written before
    the per-file xxh3 was dropped (``[length, xxh3]`` a file) still reads: its checksum
    is ignored, as it always was."""
    out = {}
    for rel, v in doc["files"].items():
        n = v[0] if isinstance(v, list) and len(v) == 2 else v
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"marker of step {doc.get('step')} rank {doc.get('rank')}: file {rel!r} has length {v!r}; "
                             f"expected a non-negative int")
        out[rel] = n
    return out


def check_copy(doc: dict, files: "list[tuple[str, Any]]") -> None:
    """A received copy's files against its marker, each byte hashed once: the table and the
    values against the marker's line (xxh3 and length), the data file's length against
    the line and each of its chunks against the table. ValueError naming the file."""
    _fp, table_ck, table_len, data_len, values_ck, values_len = doc["line"]
    rank, attempt = doc["rank"], doc["attempt"]
    got = {rel: memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b) for rel, b in files}
    where = f"copy of step {doc['step']} rank {rank}"
    table = got.get(table_name(attempt, rank))
    if table is None or len(table) != table_len or checksum(table) != table_ck:
        raise ValueError(f"{where}: its chunk table is not the one its marker names")
    values = got.get(values_name(attempt, rank), memoryview(b""))
    if len(values) != values_len or (values_len and checksum(values) != values_ck):
        raise ValueError(f"{where}: its per-rank values are not those its marker names")
    data = got.get(data_name(attempt, rank), memoryview(b""))
    if len(data) != data_len:
        raise ValueError(f"{where}: its data file is {len(data)} bytes, its marker says {data_len}")
    t = parse_table(bytes(table), where, rank=rank, attempt=attempt, chunks=int(doc["chunks"]))
    if int(t.stored_lengths.sum()) != data_len:
        raise ValueError(f"{where}: its chunk table covers {int(t.stored_lengths.sum())} bytes, its data file is {data_len}")
    pos = 0
    for n, want in zip(t.stored_lengths.tolist(), t.checksums.tolist()):
        if digest(data[pos : pos + n]) != want:
            raise ValueError(f"{where}: the data chunk at byte {pos} does not match its checksum in the chunk table")
        pos += n
