"""SIGTERM/SIGINT: the first asks for a final checkpoint at the end of an agreed step, a
second exits at once. The flag travels in the step's one small all-reduce (started at the
start of the step, waited after backward), so ranks agree on the stop step without an
extra collective or stall.

The handler is installed when ``flextrain train`` starts (before torch is imported): a
signal during start-up stops the run before its first step, with nothing to save, and
exits 0 as a stop in training does (ranks agree on it before the checkpoint load, which a
stop skips, and when start-up ends)."""
from __future__ import annotations

import os
import signal
import sys


class StartupStopped(Exception):
    """A signal arrived before the first step: the run stops with nothing to save."""


class Preemption:
    def __init__(self) -> None:
        self.requested = False
        self.training = False  # False during start-up
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            print(f"flextrain: second signal {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = True
        then = ("checkpointing at the end of the step, then exiting" if self.training
                else "during start-up: stopping before the first step")
        print(f"flextrain: {signal.Signals(signum).name} received: {then}", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
