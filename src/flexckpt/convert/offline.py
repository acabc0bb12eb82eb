"""The saves of an offline tool (``import-dcp``, ``reshard``): every rank of one save is a
``Checkpointer`` in one process. Such a save fails whole and at once: the first rank whose
write fails fails it (the process's other ranks learn of it in memory, see
:func:`flexckpt.save.commit.mark_failed`, even when the store cannot take its failure marker),
and what the save wrote under the URL is removed, with the URL's folder when the tool made
it: a failed import leaves nothing behind."""
from __future__ import annotations

import contextlib
import os
from types import TracebackType

from flexckpt.save.cleanup import remove_attempt
from flexckpt.save.handle import SaveHandle
from flexckpt.storage import Storage


class OfflineSave:
    """``with OfflineSave(url) as out:`` around the writers' whole life (their
    Checkpointers closed inside): :meth:`started` for each rank's save, :meth:`result` at
    the end; leaving on an exception removes what they wrote."""

    def __init__(self, url: str) -> None:
        self.storage = Storage(url)
        self.made_root = self.storage.local and not os.path.exists(self.storage.root)
        self.handles: list[SaveHandle] = []

    def started(self, handle: SaveHandle) -> None:
        """A rank's save is under way; raises ``SaveError`` at once if any rank's failed."""
        self.handles.append(handle)
        self.check()

    def check(self) -> None:
        for h in self.handles:
            if h.exception() is not None:
                h.result()  # raises the rank's error as SaveError

    def result(self) -> None:
        """Every rank's save committed, or the first failure (a rank waiting for the commit
        learns of another's failure at once)."""
        self.check()
        for h in self.handles:
            h.result()

    def remove(self) -> None:
        """What the saves wrote under the URL: each attempt's folder (never a committed
        one), its step's folder if that leaves it empty, and the URL's folder if the tool
        made it and nothing else is there."""
        for step, attempt in sorted({(h.step, h.attempt) for h in self.handles}):
            with contextlib.suppress(Exception):  # noqa: BLE001 - the failure being raised says more
                remove_attempt(self.storage, step, attempt)
        if self.made_root:
            with contextlib.suppress(OSError):
                os.rmdir(self.storage.root)

    def __enter__(self) -> "OfflineSave":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.remove()
