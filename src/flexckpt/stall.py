"""The stall timeout: a storage call that makes no progress for ``stall_timeout`` seconds is
given up, and the caller gets ``StorageStalled`` (a ``TimeoutError``).

A call runs on a helper thread while the caller waits. The call reports progress with
``progress()`` (each part written, each read filled); the caller gives up only when no
progress came for the whole timeout, so a large upload that keeps moving is never cut.
A given-up call cannot be interrupted (Python cannot stop a thread blocked in a socket
or a system call): its helper thread is a daemon and is left to finish or fail alone;
what it may still write belongs to a save that has already been reported failed.
Helper threads are reused (a thread started for every call costs more than a small read;
figures: bench/RESULTS.md, "P99 and restore against the old main"). A helper returns to the idle pool
when its call ends and ends after ``IDLE_EXIT_S`` without one, so the pool holds at most as
many threads as calls recently ran at once (plus those stuck in given-up calls).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_current = threading.local()


class StorageStalled(TimeoutError):
    """A storage call made no progress for the stall timeout."""


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.last = time.monotonic()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        _current.call = self
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            self.error = e
        finally:
            _current.call = None
            self.fn = None  # drop what the call held (buffers) as soon as it ends
            self.done.set()


IDLE_EXIT_S = 2.0  # an idle helper thread ends after this long without a call
_lock = threading.Lock()
_idle: list["queue.SimpleQueue[_Call]"] = []  # inboxes of idle helper threads


def _helper(inbox: "queue.SimpleQueue[_Call]") -> None:
    while True:
        try:
            call = inbox.get(timeout=IDLE_EXIT_S)
        except queue.Empty:
            with _lock:
                if any(q is inbox for q in _idle):  # nobody took it meanwhile: end
                    _idle[:] = [q for q in _idle if q is not inbox]
                    return
            continue  # taken just now: its call is on the way
        call.run()
        del call
        with _lock:
            _idle.append(inbox)


def _forget_helpers() -> None:
    """In a forked child the parent's helper threads do not exist: start from none."""
    global _lock
    _lock = threading.Lock()
    _idle.clear()


os.register_at_fork(after_in_child=_forget_helpers)


def _start(call: _Call) -> None:
    """Hand ``call`` to an idle helper thread, or to a new one."""
    with _lock:
        inbox = _idle.pop() if _idle else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_helper, args=(inbox,), name="flexckpt-storage-call", daemon=True).start()
    inbox.put(call)


def progress() -> None:
    """Tell the watch over the current storage call that bytes moved (no-op outside one)."""
    call = getattr(_current, "call", None)
    if call is not None:
        call.last = time.monotonic()


def bounded(stall_timeout: float | None, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, given up with ``StorageStalled`` once it makes no progress for
    ``stall_timeout`` seconds (None: wait for ever). Calls nested in a bounded call run
    directly: the outer watch covers them."""
    if stall_timeout is None or getattr(_current, "call", None) is not None:
        return fn()
    call = _Call(fn)
    _start(call)
    while not call.done.wait(max(0.0, call.last + stall_timeout - time.monotonic())):
        if time.monotonic() - call.last >= stall_timeout:
            raise StorageStalled(
                f"storage call {what} made no progress for {stall_timeout:g} s (the stall timeout); it was "
                "given up. Check the storage endpoint, or raise Checkpointer(stall_timeout=...) for a slow one"
            )
    if call.error is not None:
        raise call.error
    return call.result


def bounded_all(stall_timeout: float | None, what: str, fns: list[Callable[[], T]]) -> list[T]:
    """``[fn() for fn in fns]``, the calls run at once on helper threads (reused, as
    :func:`bounded`'s) while the caller watches them all: one that makes no progress for
    ``stall_timeout`` seconds is given up with ``StorageStalled``. The first error of a
    call is raised once every call has ended. Nested in a bounded call: one after another,
    directly (the outer watch covers them)."""
    if getattr(_current, "call", None) is not None:
        return [fn() for fn in fns]
    calls = [_Call(fn) for fn in fns]
    for call in calls:
        _start(call)
    pending = list(calls)
    while pending:
        if stall_timeout is None:
            pending.pop(0).done.wait()
            continue
        now = time.monotonic()
        stuck = next((c for c in pending if not c.done.is_set() and now - c.last >= stall_timeout), None)
        if stuck is not None:
            raise StorageStalled(
                f"storage call {what} made no progress for {stall_timeout:g} s (the stall timeout); it was "
                "given up. Check the storage endpoint, or raise Checkpointer(stall_timeout=...) for a slow one"
            )
        if pending[0].done.wait(max(0.0, min(c.last for c in pending) + stall_timeout - now)):
            pending.pop(0)
    for call in calls:
        if call.error is not None:
            raise call.error
    return [call.result for call in calls]
