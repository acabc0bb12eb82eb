"""The stall timeout: a storage call that makes no progress for ``stall_timeout`` seconds is
given up, and the caller gets ``StorageStalled`` (a ``TimeoutError``).

A call runs on a helper thread while the caller waits. The call reports progress with
``progress()`` (each part written, each read filled); the caller gives up only when no
progress came for the whole timeout, so a large upload that keeps moving is never cut.
A given-up call cannot be interrupted (Python cannot stop a thread blocked in a socket
or a system call): its helper thread is a daemon and is left to finish or fail alone;
what it may still write belongs to a save that has already been reported failed.
"""
from __future__ import annotations

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
            self.fn = None  # drop what the call held (buffers) as soon as it ends
            self.done.set()


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
    threading.Thread(target=call.run, name="flexckpt-storage-call", daemon=True).start()
    while not call.done.wait(max(0.0, call.last + stall_timeout - time.monotonic())):
        if time.monotonic() - call.last >= stall_timeout:
            raise StorageStalled(
                f"storage call {what} made no progress for {stall_timeout:g} s (the stall timeout); it was "
                "given up. Check the storage endpoint, or raise Checkpointer(stall_timeout=...) for a slow one"
            )
    if call.error is not None:
        raise call.error
    return call.result
