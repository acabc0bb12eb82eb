"""SaveHandle's public wait: what an integration waits on instead of the handle's event."""
from __future__ import annotations

import threading

from flexckpt.save.handle import SaveHandle


def test_wait_returns_false_until_the_save_finishes_and_does_not_raise_its_error():
    handle = SaveHandle(7, None)
    assert handle.wait(timeout=0.01) is False and not handle.done()
    error = OSError("disk full")
    threading.Timer(0.05, handle._fail, (error,)).start()  # the writer thread's failure path
    assert handle.wait(timeout=10) is True
    assert handle.done() and handle.exception() is error
