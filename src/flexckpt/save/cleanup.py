"""Cleanup of the store: what no manifest names and no live save can still need goes.
Retention after a commit (older committed steps beyond ``keep_last``, the leftovers of
unfinished saves, the committed step's other attempts), a failed attempt's files at once
(a full disk must not stop every later save), and the attempts of earlier launches at
start-up. Never another live job's files: anything written since this job started
(``since``) is a live job's and stays.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection

from flexckpt.catalog import committed_attempt, committed_steps, read_manifest, written_since
from flexckpt.format.names import (
    MANIFEST,
    attempt_run_id,
    committed_name,
    data_name,
    failed_name,
    launch_of,
    parse_step_dir,
    step_dir,
    table_name,
)
from flexckpt.storage import Storage

log = logging.getLogger("flexckpt")


def apply_retention(
    storage: Storage, keep_last: int | None, newest: int, attempt: str, since: float, stale_after: float,
    in_flight: Collection[tuple[int, str]] = (), pinned: Collection[int] = (),
) -> None:
    """After the commit of step ``newest`` by ``attempt``: delete committed checkpoints
    beyond the newest ``keep_last`` (manifest first, then data), never a ``pinned`` step
    (a trainer's best one), never the step just
    committed and never another job launch's step committed after ``since`` (when this job
    started: a live job's); then the leftovers of uncommitted saves in older steps (see
    :func:`remove_leftovers`), and the just-committed step's attempt folders that its
    manifest does not name (see :func:`remove_other_attempts`). A step with a save of this
    job in flight (``in_flight``: its ``(step, attempt)`` pairs, saves not yet reported done)
    is left alone whole: it goes, if it must, at a later commit."""
    busy = {s for s, _ in in_flight}
    steps = committed_steps(storage)
    doomed = [s for s in (steps[:-keep_last] if keep_last else []) if s != newest and s not in pinned]
    for s in doomed:
        if s in busy:
            log.info("retention: kept step %d, a save of it is in flight; it goes at a later commit", s)
            continue
        if _committed_by_live_job(storage, s, attempt, since):
            log.warning("retention: kept step %d, committed by another job after this one started", s)
            continue
        storage.remove(f"{step_dir(s)}/{MANIFEST}")
        storage.remove_tree(step_dir(s))
        log.info("retention: removed step %d", s)
    if keep_last and newest in steps[:-keep_last]:
        log.warning("retention: step %d is not among the newest keep_last=%d steps (newer: %s); it goes at the next "
                    "commit", newest, keep_last, [s for s in steps if s > newest][:10])
    committed = set(steps)
    for name in storage.list_names(""):
        s = parse_step_dir(name)
        if s is not None and s < newest and s not in committed and s not in busy:
            remove_leftovers(storage, s, attempt, stale_after)
    remove_other_attempts(storage, newest, attempt, since, keep={a for s, a in in_flight if s == newest})


def _committed_by_live_job(storage: Storage, step: int, attempt: str, since: float) -> bool:
    if not written_since(storage, f"{step_dir(step)}/{MANIFEST}", since):
        return False
    try:
        manifest = read_manifest(storage, step)
    except (OSError, ValueError):
        return True  # unreadable, and written since this job started: not this job's to judge
    return manifest.attempt is None or launch_of(manifest.attempt) != launch_of(attempt)


def remove_leftovers(storage: Storage, step: int, attempt: str, stale_after: float) -> None:
    """In the folder of uncommitted ``step`` (older than the step just committed): attempt
    folders of this run id whose save failed (they hold its failure marker), and anything
    untouched for ``stale_after`` seconds (commit_timeout). Never a save in flight, of this
    job (a smaller step saved while a larger one commits) or of another: the folder goes
    when it is empty."""
    folder = step_dir(step)
    run_id = attempt_run_id(attempt)
    for name in storage.list_names(folder):
        rel = f"{folder}/{name}"
        owner = attempt_run_id(name)
        failed = owner == run_id and storage.exists(f"{folder}/{failed_name(name)}")
        age = storage.age(rel)
        if failed or (age is not None and age >= stale_after):
            if owner is not None:
                storage.remove_tree(rel)
            else:
                storage.remove(rel)
            log.info("removed the leftovers of an unfinished save: %s", rel)
    _remove_if_empty(storage, folder)


def _remove_if_empty(storage: Storage, folder: str) -> None:
    """A local folder, if empty (rmdir: a save that creates a folder in it meanwhile keeps
    it). On an object store a prefix with no objects does not exist."""
    if storage.local:
        try:
            os.rmdir(storage.path(folder))
        except OSError:
            pass


def remove_other_attempts(storage: Storage, step: int, attempt: str, since: float,
                          keep: Collection[str] = ()) -> None:
    """Attempt folders of the just-committed step other than the committed ``attempt``:
    this job launch's own earlier attempts, and those of jobs that ended before it started
    (``since``); never a folder written to since then (another live job's: its files stay,
    whatever happens to its saves), never one in ``keep`` (this job's saves of the step still
    in flight). The manifest just written names only ``attempt``. Version-1 files of earlier
    jobs go too."""
    folder = step_dir(step)
    session = launch_of(attempt)
    for name in storage.list_names(folder):
        if name in (MANIFEST, attempt) or name in keep or name.startswith("."):
            continue
        owner = attempt_run_id(name)
        if owner is not None and launch_of(name) != session and written_since(storage, f"{folder}/{name}", since):
            continue
        if owner is not None:
            storage.remove_tree(f"{folder}/{name}")
        else:
            storage.remove(f"{folder}/{name}")


def remove_attempt(storage: Storage, step: int, attempt: str) -> None:
    """All of a failed attempt (an offline tool's, see :mod:`flexckpt.convert.offline`): its folder
    with data, tables, records and marker, and the step's folder when that leaves it empty.
    Never the attempt the step's manifest names."""
    if committed_attempt(storage, step) == attempt:
        return
    storage.remove_tree(f"{step_dir(step)}/{attempt}")
    _remove_if_empty(storage, step_dir(step))


# -- reclaiming the files of failed saves (a full disk must not stop every later save) ---------
def reclaim_failed(storage: Storage, step: int, attempt: str, rank: int | None) -> None:
    """Delete a failed attempt's files at once: rank ``rank``'s data file and chunk table,
    or (``rank`` None: the coordinator, whose commit failed) every data file and table in
    the attempt's folder. The failure marker and records stay (small; the other ranks read
    the marker). Nothing is deleted if the step's manifest names this attempt."""
    if committed_attempt(storage, step) == attempt:
        return
    folder = f"{step_dir(step)}/{attempt}"
    if rank is not None:
        doomed = [f"{step_dir(step)}/{data_name(attempt, rank)}", f"{step_dir(step)}/{table_name(attempt, rank)}"]
    else:
        doomed = [f"{folder}/{n}" for n in storage.list_names(folder) if n.endswith((".data", ".table", ".tmp"))]
    for rel in doomed:
        storage.remove(rel)


def reclaim_at_start(storage: Storage, run_id: str, stale_after: float, since: float, launch: str = "") -> list[str]:
    """At start-up (the coordinator): remove attempt folders that no manifest names and no
    live save can still need, i.e. those of an earlier launch of this run id in steps older
    than the newest commit, and any (of any job) untouched for ``stale_after`` seconds
    (commit_timeout). Never a folder written since ``since`` (when this job started: another
    live job's), never one of this launch (``launch``, ``RUN.SESSION``: the batches of one
    import are ranks that start one after another, each a Checkpointer of its own), never
    the attempt a step's manifest names, never version-1 files. Step folders left empty and
    without a manifest go too. A step whose folder holds only the attempt its ``committed``
    marker names costs its listing and that marker's check, no manifest read. Returns what
    was removed."""
    removed: list[str] = []
    steps = sorted(s for s in (parse_step_dir(n) for n in storage.list_names("")) if s is not None)
    committed = set(committed_steps(storage))
    newest = max(committed, default=-1)
    now = time.time()
    for s in steps:
        folder = step_dir(s)
        names = storage.list_names(folder)
        keep = None
        if MANIFEST in names:
            attempts = [n for n in names if attempt_run_id(n) is not None]
            if len(attempts) == 1 and storage.exists(f"{folder}/{committed_name(attempts[0])}"):
                continue  # only the attempt the step's commit marked: nothing to reclaim, no manifest read
            keep = committed_attempt(storage, s)
            if keep is None:  # version 1, or a manifest that does not parse: touch nothing here
                continue
        for name in names:
            owner = attempt_run_id(name)
            if owner is None or name == keep or launch_of(name) == launch:
                continue
            age = storage.age(f"{folder}/{name}")
            if age is None or now - age >= since:
                continue  # written since this job started: another live job's
            if age >= stale_after or (owner == run_id and s < newest):
                storage.remove_tree(f"{folder}/{name}")
                removed.append(f"{folder}/{name}")
        if s not in committed and not storage.list_names(folder):
            storage.remove_tree(folder)
    return removed
