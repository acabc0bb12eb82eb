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
when its call ends, before its caller is woken (so the caller's next call finds it there), and
ends after ``IDLE_EXIT_S`` without one, so the pool holds at most as many threads as calls
recently ran at once (plus those stuck in given-up calls). A call's end is signalled by
releasing a plain lock its caller waits to take (cheaper than an ``Event``: a small read pays
the hand-off both ways).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class _Current(threading.local):
    call: "_Call | None" = None  # the bounded call this thread runs, if any


_current = _Current()


class StorageStalled(TimeoutError):
    """A storage call made no progress for the stall timeout."""


class _Call:
    __slots__ = ("fn", "watch", "last", "done", "ended", "result", "error")

    def __init__(self, fn: Callable[[], Any], watch: bool = True) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.watch = watch  # False: run without a watch (the storage calls it makes start their own)
        self.last = time.monotonic()
        self.done = threading.Lock()  # held until the call ends: its caller waits to take it
        self.done.acquire()
        self.ended = False
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        _current.call = self if self.watch else None
        try:
            self.result = self.fn()  # type: ignore[misc]
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            self.error = e
        finally:
            _current.call = None
            self.fn = None  # drop what the call held (buffers) as soon as it ends

    def end(self) -> None:
        """Wake the caller: the result (or error) is in place."""
        self.ended = True
        self.done.release()

    def wait(self, timeout: float | None) -> bool:
        """Whether the call ended within ``timeout`` seconds (None: wait for it)."""
        if timeout is None:
            return self.done.acquire()
        return self.done.acquire(timeout=min(max(0.0, timeout), threading.TIMEOUT_MAX))


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
        with _lock:
            _idle.append(inbox)  # idle before the caller wakes: its next call finds this thread
        call.end()
        del call


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
    call = _current.call
    if call is not None:
        call.last = time.monotonic()


def watched() -> bool:
    """Whether this thread runs under a stall watch (a bounded call): a storage call made
    here runs directly, the outer watch covering it."""
    return _current.call is not None


def _stalled(what: str, stall_timeout: float) -> StorageStalled:
    return StorageStalled(
        f"storage call {what} made no progress for {stall_timeout:g} s (the stall timeout); it was "
        "given up. Check the storage endpoint, or raise Checkpointer(stall_timeout=...) for a slow one"
    )


def bounded(stall_timeout: float | None, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, given up with ``StorageStalled`` once it makes no progress for
    ``stall_timeout`` seconds (None: wait for ever). Calls nested in a bounded call run
    directly: the outer watch covers them."""
    if stall_timeout is None or _current.call is not None:
        return fn()
    call = _Call(fn)
    _start(call)
    while not call.wait(call.last + stall_timeout - time.monotonic()):
        if time.monotonic() - call.last >= stall_timeout:
            raise _stalled(what, stall_timeout)
    if call.error is not None:
        raise call.error
    return call.result


def bounded_all(stall_timeout: float | None, what: str, fns: list[Callable[[], T]]) -> list[T]:
    """``[fn() for fn in fns]``, the calls run at once on helper threads (reused, as
    :func:`bounded`'s) while the caller watches them all: one that makes no progress for
    ``stall_timeout`` seconds is given up with ``StorageStalled``. The first error of a
    call is raised once every call has ended. Nested in a bounded call: one after another,
    directly (the outer watch covers them). With ``stall_timeout`` None they run unwatched,
    and each storage call they make is watched by its own storage's timeout (a fast tier's
    recovery view reads the store so: no stall goes unbounded because the view has no timeout)."""
    if _current.call is not None:
        return [fn() for fn in fns]
    calls = [_Call(fn, watch=stall_timeout is not None) for fn in fns]
    for call in calls:
        _start(call)
    pending = list(calls)
    while pending:
        if stall_timeout is None:
            pending.pop(0).wait(None)
            continue
        now = time.monotonic()
        if any(not c.ended and now - c.last >= stall_timeout for c in pending):
            raise _stalled(what, stall_timeout)
        if pending[0].wait(min(c.last for c in pending) + stall_timeout - now):
            pending.pop(0)
    for call in calls:
        if call.error is not None:
            raise call.error
    return [call.result for call in calls]
