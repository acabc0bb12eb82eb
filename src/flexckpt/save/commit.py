"""The commit side of a save: records gathered through storage, checked against each
other, the manifest written (the commit), and a failure announced to the attempt's other
ranks. No collective and no barrier: ranks meet only through storage. What is committed
is read back through :mod:`flexckpt.catalog`; retention and reclaim are in
:mod:`flexckpt.save.cleanup`.

Every file of a save attempt lives in the attempt's folder (``step-N/RUN.SESSION.K/``), so
records, failure markers and data of another attempt (an earlier try of the same step, a
requeued job, another job on the same URL) are never mistaken for this one's.

Gathering takes fewer than W reads on the coordinator: rank ``r`` writes its record under
its group (``GROUP`` consecutive ranks); each group's first rank (its leader) waits for
its group's records, merges them and writes one group record; rank 0 reads the group
records. With W <= GROUP rank 0 reads the records itself.
"""
from __future__ import annotations

import base64
import binascii
import errno
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import orjson

from flexckpt.catalog import written_since
from flexckpt.errors import SaveError, expected_failure
from flexckpt.format.checksum import checksum
from flexckpt.format.manifest import RECORD_FORMAT, VERSION, Manifest, RankEntry, SavedTensor
from flexckpt.format.manifest_parse import parse_record
from flexckpt.format.names import (
    GROUP,
    MANIFEST,
    attempt_run_id,
    committed_name,
    failed_name,
    group_name,
    keyed_name,
    launch_of,
    parse_step_dir,
    record_name,
    step_dir,
)
from flexckpt.format.write_plan import PlanRules, WritePlan
from flexckpt.state.structure import TensorSpec
from flexckpt.storage import Storage

log = logging.getLogger("flexckpt")


class AnnouncedFailure(SaveError):
    """Another rank announced (by the attempt's failure marker) that this save failed."""


READ_CONCURRENCY = 64  # records read in parallel (an object store serves these at once)


# -- records -----------------------------------------------------------------------------------
def record_doc(
    *, run_id: str, attempt: str, step: int, world_size: int, entries: dict[int, list], lanes: dict[str, Any],
    structure: bytes | None = None, keyed: dict[str, list] | None = None, structures: dict[str, dict] | None = None,
) -> bytes:
    """A record: one rank's line (``entries[rank] = [fingerprint, table checksum, table
    bytes, stored bytes, values checksum, values bytes]``) and lanes, or a group's, merged by its leader. Lane values may
    be already-encoded JSON (bytes), spliced in without re-encoding. ``structure`` (a
    rank's first save with a structure, in a world of at most GROUP ranks or when the rank
    is a pipeline stage's) lets rank 0 name the keys that differ if the fingerprints do, or
    build the union of the stages' structures (:mod:`flexckpt.save.stage_union`). ``keyed`` holds the bytes values by key:
    ``[lowest rank holding it, base64 of the bytes]`` (see :func:`keyed_entries`).
    ``structures`` (a group's record): the structures its ranks' records carried, one per
    fingerprint (a pipeline stage's ranks share one), for rank 0's union of them."""
    extra: dict[str, Any] = {"structure": orjson.Fragment(structure)} if structure is not None else {}
    if structures:
        extra["structures"] = structures
    return orjson.dumps({**extra,
        "format": RECORD_FORMAT,
        "version": VERSION,
        "run_id": run_id,
        "attempt": attempt,
        "step": step,
        "world_size": world_size,
        "ranks": {str(r): e for r, e in entries.items()},
        "lanes": {k: orjson.Fragment(v) if isinstance(v, bytes) else v for k, v in lanes.items()},
        "keyed": keyed or {},
    })


def keyed_entries(rank: int, values: dict[str, bytes]) -> dict[str, list]:
    """A rank's bytes values as its record carries them: ``key -> [rank, base64]``."""
    return {k: [rank, base64.b64encode(v).decode("ascii")] for k, v in values.items()}


def wait_for(
    storage: Storage,
    folder: str,
    names: dict[str, int],
    timeout: float,
    max_delay: float,
    what: str,
    failed: Callable[[], str | None] | None = None,
) -> dict[int, dict]:
    """Wait until every object of ``names`` (file name in ``folder`` -> key) exists, then
    read them (up to READ_CONCURRENCY at once): listings of one folder, never W reads."""
    pending = dict(names)
    found: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    delay = 0.001

    def read(name: str) -> dict:
        return parse_record(storage.read_bytes(f"{folder}/{name}"), f"{what} {folder}/{name}")

    # an object store answers many reads at once; a local folder needs no threads for them
    workers = min(READ_CONCURRENCY, len(names)) if storage.parallel_reads and len(names) > 1 else 1
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flexckpt-gather") as pool:
        while pending:
            present = set(storage.list_names(folder)) & set(pending)
            ready = sorted(present)
            docs = pool.map(read, ready) if workers > 1 else map(read, ready)
            for name, doc in zip(ready, docs):
                found[pending.pop(name)] = doc
            if not pending:
                break
            message = failed() if failed else None
            if message is not None:
                raise AnnouncedFailure(message)
            if time.monotonic() > deadline:
                keys = sorted(pending.values())
                raise SaveError(
                    f"{what}s {keys[:20]}{' ...' if len(keys) > 20 else ''} missing in {folder} after {timeout:.0f} s "
                    f"(commit_timeout); is every rank calling save() for this step? (to save from some ranks "
                    f"only, name them: Checkpointer(url, ranks=[0]))"
                )
            time.sleep(delay)
            delay = min(delay * 2, max_delay)
    return found


def merge_records(
    docs: list[dict], *, step: int, run_id: str, attempt: str, world_size: int,
    structures: dict[str, dict] | None = None, keyed: dict[str, list] | None = None,
) -> tuple[dict[int, list], dict[str, dict]]:
    """Rank lines and lanes of several records, checked to belong to this attempt.
    Structures that records carry go to ``structures``, bytes values to ``keyed``.

    A lane or a bytes value saved by several ranks (the TP/PP peers of one data-parallel
    replica all hold it) is kept once: its copies must be equal, else the save fails naming
    the key."""
    entries: dict[int, list] = {}
    lanes: dict[str, dict] = {}
    keyed = {} if keyed is None else keyed
    for doc in docs:
        if structures is not None and isinstance(doc.get("structure"), dict) and len(doc["ranks"]) == 1:
            structures[str(next(iter(doc["ranks"].values()))[0])] = doc["structure"]
        if structures is not None and isinstance(doc.get("structures"), dict):  # a group's, one per fingerprint
            for fp, st in doc["structures"].items():
                if isinstance(st, dict):
                    structures.setdefault(fp, st)
        for key, want in (("run_id", run_id), ("attempt", attempt), ("step", step), ("world_size", world_size)):
            if doc[key] != want:
                raise SaveError(f"step {step}: a record has {key}={doc[key]!r}, expected {want!r}")
        for r, e in doc["ranks"].items():
            if not r.isdigit() or not 0 <= int(r) < world_size or int(r) in entries:
                raise SaveError(f"step {step}: a record has a bad or repeated rank {r!r}")
            if not (isinstance(e, list) and len(e) == 6 and isinstance(e[0], str)):
                raise SaveError(f"step {step}: the record line of rank {r} is malformed")
            entries[int(r)] = e
        for path, mapping in doc["lanes"].items():
            if not isinstance(mapping, dict):
                raise SaveError(f"step {step}: lanes of {path!r} are not keyed by lane")
            merged = lanes.setdefault(path, {})
            for lane, v in mapping.items():
                if lane in merged and _canonical(merged[lane]) != _canonical(v):
                    raise SaveError(
                        f"step {step}: lane {lane!r} of {path!r} was saved by several ranks with different values; "
                        f"a lane hosted by several ranks (peers of one replica) must hold the same value on each"
                    )
                merged[lane] = v
        raw = doc.get("keyed", {})
        if not isinstance(raw, dict):
            raise SaveError(f"step {step}: a record's bytes values are not keyed by name")
        for key, v in raw.items():
            if not (isinstance(v, list) and len(v) == 2 and type(v[0]) is int and isinstance(v[1], str)):
                raise SaveError(f"step {step}: the record entry of bytes value {key!r} is malformed")
            have = keyed.get(key)
            if have is None:
                keyed[key] = v
            elif have[1] != v[1]:  # base64 is canonical: equal text, equal bytes
                a, b = sorted((have[0], v[0]))
                raise SaveError(
                    f"step {step}: bytes value {key!r} was saved by ranks {a} and {b} with different contents; a key "
                    f"saved by several ranks (peers of one data-parallel replica) must hold the same bytes on each, "
                    f"so give each rank's value a key of its own (e.g. by data-parallel rank)"
                )
            elif v[0] < have[0]:
                keyed[key] = v
    return entries, lanes


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def lead_group(
    storage: Storage, *, step: int, run_id: str, attempt: str, world_size: int, rank: int,
    own: bytes, timeout: float, max_delay: float, structures: dict[str, dict] | None = None,
) -> bytes:
    """A group leader's part: wait for the group's other records, merge them with its own
    (``own``), and return the group record (rank 0 keeps it; other leaders write it)."""
    folder = f"{step_dir(step)}/{attempt}/rec/g{rank // GROUP:05d}"
    members = range(rank + 1, min(rank + GROUP, world_size))
    names = {record_name(attempt, r).rsplit("/", 1)[1]: r for r in members}
    found = wait_for(storage, folder, names, timeout, max_delay, "record of rank",
                     failed=lambda: failure_message(storage, step, attempt))
    docs = [parse_record(own, "own record")] + [found[r] for r in sorted(found)]
    keyed: dict[str, list] = {}
    seen: dict[str, dict] = {}
    entries, lanes = merge_records(docs, step=step, run_id=run_id, attempt=attempt, world_size=world_size,
                                   structures=seen, keyed=keyed)
    if structures is not None:
        structures.update(seen)
    return record_doc(run_id=run_id, attempt=attempt, step=step, world_size=world_size, entries=entries, lanes=lanes,
                      keyed=keyed, structures=seen)


def gather(
    storage: Storage, *, step: int, run_id: str, attempt: str, world_size: int, own: bytes,
    timeout: float, max_delay: float, structures: dict[str, dict] | None = None,
    keyed: dict[str, list] | None = None,
) -> tuple[dict[int, list], dict[str, dict]]:
    """Rank 0's part: its group's records, then every other group's record (bytes values,
    each once, to ``keyed``)."""
    group0 = lead_group(storage, step=step, run_id=run_id, attempt=attempt, world_size=world_size, rank=0,
                        own=own, timeout=timeout, max_delay=max_delay, structures=structures)
    groups = range(1, -(-world_size // GROUP))
    docs = [parse_record(group0, "group 0")]
    if groups:
        folder = f"{step_dir(step)}/{attempt}/grp"
        names = {group_name(attempt, g).rsplit("/", 1)[1]: g for g in groups}
        found = wait_for(storage, folder, names, timeout, max_delay, "record of group",
                         failed=lambda: failure_message(storage, step, attempt))
        docs += [found[g] for g in sorted(found)]
    entries, lanes = merge_records(docs, step=step, run_id=run_id, attempt=attempt, world_size=world_size,
                                   keyed=keyed, structures=structures)
    missing = sorted(set(range(world_size)) - set(entries))
    if missing:
        raise SaveError(f"step {step}: no record of ranks {missing[:20]}")
    return entries, lanes


def check_fingerprints(
    entries: dict[int, list], step: int, fingerprint: str, structure: dict, structures: dict[str, dict]
) -> None:
    for r in sorted(entries):
        theirs = entries[r][0]
        if theirs != fingerprint:
            other = structures.get(theirs)
            detail = (describe_difference(structure, other) if other is not None
                      else f"its structure hashes to {theirs}, rank 0's to {fingerprint}")
            raise SaveError(f"step {step}: rank {r} saved a different state structure than rank 0: {detail}")


def describe_difference(ours: dict, theirs: dict) -> str:
    """Which keys differ between two canonical structures (rank 0 vs another rank)."""
    parts = []
    mine = {t["name"]: t for t in ours.get("tensors", [])}
    other = {t.get("name"): t for t in theirs.get("tensors", []) if isinstance(t, dict)}
    only_0 = sorted(set(mine) - set(other))
    only_r = sorted(k for k in set(other) - set(mine) if isinstance(k, str))
    changed = sorted(k for k in set(mine) & set(other) if mine[k] != other[k])
    if only_0:
        parts.append(f"tensors only on rank 0: {only_0[:10]}")
    if only_r:
        parts.append(f"tensors only on the other rank: {only_r[:10]}")
    for k in changed[:10]:
        parts.append(f"tensor {k!r}: rank 0 has {mine[k]}, the other rank has {other[k]}")
    for kind in ("plain", "lanes", "per_rank"):
        a, b = set(ours.get(kind, [])), set(theirs.get(kind, []))
        if a != b:
            parts.append(f"{kind} keys differ: only on rank 0 {sorted(a - b)[:10]}, only on the other {sorted(b - a)[:10]}")
    return "; ".join(parts) or "the structures hash differently"


class SavedPlan(NamedTuple):
    """What a manifest records of a write plan (a ``WritePlan`` has the same three fields):
    the tensors, the world size, the plan rules."""

    specs: tuple[TensorSpec, ...]
    world_size: int
    rules: PlanRules


def build_manifest(
    *,
    step: int,
    run_id: str,
    attempt: str,
    plan: WritePlan | SavedPlan,
    fingerprint: str,
    codec: str,
    entries: dict[int, list],
    plain: dict[str, Any],
    lanes: dict[str, dict],
    per_rank_keys: list[str],
    keyed: dict[str, tuple[int, int, str]] | None = None,
    tree: Any = None,
) -> Manifest:
    """The manifest of attempt ``attempt`` of ``step``: ``plan``'s tensors at its world size
    and rules, each rank's entry from its record line in ``entries``, and the values;
    ``to_bytes()`` is the document committed. The committer and the fast tier's recovery
    both build theirs here."""
    ranks = []
    for r in range(plan.world_size):
        _fp, check, table_nbytes, stored, values_check, values_nbytes = entries[r]
        ranks.append(RankEntry(check, table_nbytes, stored, values_check, values_nbytes))
    tensors = {s.name: SavedTensor(s.name, s.dtype, s.shape, s.layout) for s in plan.specs}
    return Manifest(
        step, run_id, plan.world_size, time.time(), fingerprint, {}, tensors, plain, lanes,
        {k: None for k in per_rank_keys}, VERSION, attempt, plan.rules, codec, tuple(ranks), keyed=keyed or {},
        tree=tree,
    )


def write_keyed(storage: Storage, step: int, attempt: str, keyed: dict[str, list], fsync: bool) -> dict:
    """Rank 0, before the commit: the bytes values, each once, one after the other in key
    order in the attempt's ``keyed.values`` file; returns the manifest's index of it,
    ``key -> (offset, length, xxh3-64)``."""
    index: dict[str, tuple[int, int, str]] = {}
    parts = []
    pos = 0
    for key in sorted(keyed):
        try:
            data = base64.b64decode(keyed[key][1], validate=True)
        except (binascii.Error, ValueError):
            raise SaveError(f"step {step}: the record of rank {keyed[key][0]} holds bytes value {key!r} malformed") from None
        index[key] = (pos, len(data), checksum(data))
        parts.append(data)
        pos += len(data)
    if index:
        storage.put_atomic(f"{step_dir(step)}/{keyed_name(attempt)}", b"".join(parts), fsync=fsync)
    return index


# -- the commit --------------------------------------------------------------------------------
def other_live_job(storage: Storage, attempt: str, since: float, step: int, listed: set[str]) -> str | None:
    """An attempt folder of another job launch (another run id, or the same run id
    launched again) written to after ``since`` (when this job started): two jobs are
    saving into one URL, whatever their step numbers. (A job that ended before this one
    started, e.g. the one this job was requeued from, is not live: its steps may be saved
    again.) Looks in ``step``'s folder (the step being committed) and in every step folder
    not in ``listed`` (those an earlier check of this job listed; the folders listed now are
    added when nothing is found): one listing of the root, one per such folder, and one age
    per other launch's folder in them; not one listing per step kept at every commit."""
    ours, current = launch_of(attempt), step_dir(step)
    names = [n for n in storage.list_names("") if parse_step_dir(n) is not None]
    listed.intersection_update(names)  # a folder removed since (retention) is listed again if it comes back
    checked = []
    for step_name in names:
        if step_name in listed and step_name != current:
            continue
        for name in storage.list_names(step_name):
            if attempt_run_id(name) is None or launch_of(name) == ours:
                continue
            if written_since(storage, f"{step_name}/{name}", since):
                return f"{step_name}/{name}"
        checked.append(step_name)
    listed.update(checked)
    return None


def commit(storage: Storage, manifest: Manifest, fsync: bool) -> None:
    """Write the manifest last, atomically: this is the commit. Then the attempt's
    ``committed`` marker, which the other ranks wait for."""
    folder = step_dir(manifest.step)
    storage.put_atomic(f"{folder}/{MANIFEST}", manifest.to_bytes(), fsync=fsync)
    storage.put_atomic(f"{folder}/{committed_name(manifest.attempt)}", b"", fsync=False)


# failures announced by a writer of this process: (filesystem, root, step, attempt) -> message.
# The ranks of an offline tool (import-dcp, reshard) are writers of one process: they learn of
# a failure here at once, whether or not the store took its marker.
_FAILED_HERE: dict[tuple[str, str, int, str], str] = {}
_FAILED_LOCK = threading.Lock()


def _here_key(storage: Storage, step: int, attempt: str) -> tuple[str, str, int, str]:
    return (type(storage.fs).__name__, storage.root, step, attempt)


def mark_failed(storage: Storage, step: int, attempt: str, message: str) -> None:
    """Tell the other ranks of this attempt (who wait for its marker) that it will not
    commit: at once to those of this process, and through the attempt's failure marker to
    the others. Where the message does not fit (a full disk) the marker is written empty
    (a name takes no data block); where even that fails, the ranks of other processes
    wait out commit_timeout, and the log says so."""
    with _FAILED_LOCK:
        _FAILED_HERE[_here_key(storage, step, attempt)] = message
        while len(_FAILED_HERE) > 1024:  # a long job's old failures: their waiters are long done
            del _FAILED_HERE[next(iter(_FAILED_HERE))]
    rel = f"{step_dir(step)}/{failed_name(attempt)}"
    try:
        storage.makedirs(f"{step_dir(step)}/{attempt}")
        try:
            storage.put_atomic(rel, message.encode(), fsync=False)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            storage.put_atomic(rel, b"", fsync=False)
    except Exception as exc:  # noqa: BLE001 - best effort; the save already failed
        log.error("flexckpt: could not write the failure marker of step %d (%s): ranks in other processes wait "
                  "for this save up to commit_timeout", step, exc, exc_info=not expected_failure(exc))


def failure_message(storage: Storage, step: int, attempt: str) -> str | None:
    here = _FAILED_HERE.get(_here_key(storage, step, attempt))
    if here is not None:
        return f"save of step {step} failed on another rank: {here}"
    rel = f"{step_dir(step)}/{failed_name(attempt)}"
    if not storage.exists(rel):
        return None
    try:
        msg = storage.read_bytes(rel, limit=1 << 20).decode(errors="replace")
    except OSError:
        msg = "(the marker could not be read)"
    return f"save of step {step} failed on another rank: {msg or '(its message did not fit on the disk)'}"
