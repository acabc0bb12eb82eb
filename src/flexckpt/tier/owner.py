"""Who owns a node's tier folder: a lock held for the tier's life, and the folder's identity.

Every process that uses a tier folder (the ranks of one node share it) holds a shared
``flock`` on its ``.owner.lock`` from construction to ``close()``; the kernel lets go of
it when the process dies, however it dies. A starting job removes another job's folder
only when it can take that lock exclusively (no live process holds the folder) and the
folder has been untouched for ``stale_after`` seconds, and only while it holds the lock.
Two tiers of one process (a second ``Checkpointer``) share the process's hold: the
process never sweeps a folder it holds.

``.folder-id`` names the folder itself (random, made once): ranks reporting one node name
but different folder ids are on different machines (a clash of node names).

``fast-tier.json`` in the run's persistent folder names that folder (a random id) and
counts its launches with a fast tier (:func:`this_launch`); a tier folder's name holds the
id, so a tier outlives no removal of its run folder, and launches never tie."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
import time
import uuid

import orjson

from flexckpt.storage import Storage

LOCK = ".owner.lock"
FOLDER_ID = ".folder-id"

_held: dict[str, list[int]] = {}  # real path of a tier folder -> [lock fd, holders in this process]
_mutex = threading.Lock()


def hold(root: str) -> None:
    """Make ``root`` (if need be) and hold it for this process until :func:`release`."""
    key = os.path.realpath(root)
    with _mutex:
        if key in _held:
            _held[key][1] += 1
            return
        while True:
            os.makedirs(root, exist_ok=True)
            fd = os.open(os.path.join(root, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweeper removes the folder
            try:
                same = os.stat(os.path.join(root, LOCK)).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                _held[key] = [fd, 1]
                return
            os.close(fd)  # the folder was swept while this waited: make it again


def release(root: str) -> None:
    """One holder of ``root`` in this process lets go; the last one drops the lock."""
    key = os.path.realpath(root)
    with _mutex:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            os.close(entry[0])


def remove_if_unowned(path: str, stale_after: float) -> bool:
    """Remove the tier folder ``path`` when no live process holds it and none of its files
    changed for ``stale_after`` seconds; True when removed."""
    if os.path.realpath(path) in _held:
        return False
    try:
        if time.time() - newest_change(path) < stale_after:
            return False  # looked at only: a folder in use is never touched
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # gone meanwhile, or not ours to touch
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # a live job's
            raise
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def newest_change(path: str) -> float:
    """The newest modification time of ``path`` and of every file under it."""
    newest = os.stat(path).st_mtime
    for d, _, fs in os.walk(path):
        for f in fs:
            try:
                newest = max(newest, os.stat(os.path.join(d, f)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def folder_id(root: str) -> str:
    """The random id of the tier folder ``root`` (made by whichever rank comes first)."""
    path = os.path.join(root, FOLDER_ID)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        for _ in range(100):  # another rank of the node made it a moment ago: its write lands at once
            with open(path, "rb") as f:
                got = f.read().decode()
            if got:
                return got
            time.sleep(0.01)
        return got
    made = uuid.uuid4().hex
    try:
        os.write(fd, made.encode())
    finally:
        os.close(fd)
    return made


RUN_FOLDER = "fast-tier.json"  # in the run's persistent folder: its identity and its launches with a fast tier


def this_launch(storage: Storage) -> tuple[str, int, bool]:
    """``(id, launch, written)``: the run folder ``storage``'s identity and this launch's
    number among those with a fast tier, from its ``fast-tier.json``, counted up there
    (``written``); without one (a new folder, or one removed and made again: the tiers of
    the earlier folder are not this one's), a new random id and launch 1, written with
    the first fast save (a refused start leaves the folder as it was)."""
    try:
        raw = storage.read_bytes(RUN_FOLDER, limit=1 << 16)
    except FileNotFoundError:
        return uuid.uuid4().hex, 1, False
    try:
        doc = orjson.loads(raw)
        run, launch = str(doc["id"]), int(doc["launches"]) + 1
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{storage.path(RUN_FOLDER)} is not a fast tier's record of its run folder ({exc}); remove "
                         f"it to start the fast tier afresh (its steps of this run folder are then not restored)") from None
    write_run_folder(storage, run, launch)
    return run, launch, True


def write_run_folder(storage: Storage, run: str, launches: int) -> None:
    """The run folder's record: its id and the launches with a fast tier so far."""
    storage.makedirs("")
    storage.put_atomic(RUN_FOLDER, orjson.dumps({"id": run, "launches": launches}), fsync=False)
