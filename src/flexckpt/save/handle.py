"""A save in flight, as the caller holds it: the fence (``wait_staged``) and the result.
Both tiers hand one out (``Checkpointer.save`` and ``save_local``). ``InFlight`` holds a
checkpointer's persistent saves not yet done."""
from __future__ import annotations

import threading
import time
from typing import Any

from flexckpt.errors import SaveError


class SaveHandle:
    """One save in flight. ``wait_staged()`` is the fence after which the caller may
    change the state; ``result()`` returns once the checkpoint is committed."""

    def __init__(self, step: int, wait_commit: "Any", attempt: str = "", fence_of: "SaveHandle | None" = None) -> None:
        self.step = step
        self.attempt = attempt  # this save attempt's folder inside the step folder
        self.save_seconds = 0.0  # time spent inside save()
        self.fence_seconds = 0.0  # time spent inside wait_staged()
        self.timings: dict[str, float] = {}
        # fence_of: a save staged by another's copy (a fast-tier save that takes the bytes of
        # the persistent save of its step) shares that save's fence
        self._staged = threading.Event() if fence_of is None else fence_of._staged
        self._fence_called = threading.Event() if fence_of is None else fence_of._fence_called
        self._own_fence = fence_of is None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._wait_commit = wait_commit  # non-coordinators: poll storage for the manifest

    @property
    def trainer_wait(self) -> float:
        """Seconds the training thread spent on this save: inside save() plus at the fence."""
        return self.save_seconds + self.fence_seconds

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the state has been copied out (a failed staging also releases the
        fence; the failure is reported by :meth:`result`). Returns False on timeout."""
        t0 = time.perf_counter()
        self._fence_called.set()
        ok = self._staged.wait(timeout)
        self.fence_seconds += time.perf_counter() - t0
        return ok

    def staged(self) -> bool:
        return self._staged.is_set()

    def done(self) -> bool:
        """This rank's part is finished (on rank 0: the checkpoint is committed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this rank's part is finished, failed or not (:meth:`done`); returns
        False on timeout. Unlike :meth:`result` it neither raises the save's error (see
        :meth:`exception`) nor waits for another rank to commit."""
        return self._done.wait(timeout)

    def exception(self) -> BaseException | None:
        return self._error

    def result(self, timeout: float | None = None) -> int:
        """Wait until the checkpoint is committed; return its step or raise ``SaveError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not finished after {timeout} s")
        if self._error is not None:
            raise SaveError(f"save of step {self.step} failed: {self._error}") from self._error
        if self._wait_commit is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._wait_commit(self.step, left)
        return self.step

    def _succeed(self) -> None:
        """This rank's part is done (called by the pipeline's committer or the fast tier)."""
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self._own_fence:  # a shared fence is released by its own save's staging, never early
            self._staged.set()
        self._done.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "staged" if self.staged() else "staging"
        return f"SaveHandle(step={self.step}, {state})"


class InFlight:
    """The handles of the persistent saves not yet done on this rank: ``wait()`` waits for
    them, and retention leaves their steps alone (a save registers here before its writer
    makes a folder). Thread-safe: saves register from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handles: list[SaveHandle] = []

    def add(self, handle: SaveHandle) -> None:
        with self._lock:
            self.handles = [h for h in self.handles if not h.done()] + [handle]

    def attempts(self) -> set[tuple[int, str]]:
        """(step, attempt) of every save not yet done."""
        with self._lock:
            return {(h.step, h.attempt) for h in self.handles if not h.done()}

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save registered so far is done (errors stay on their handles)."""
        with self._lock:
            handles = list(self.handles)
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                raise TimeoutError(f"save of step {h.step} still in flight after {timeout} s")
