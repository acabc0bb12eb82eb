"""SIGTERM/SIGINT: the first asks for a final checkpoint at the end of an agreed step, a
second exits at once. The flag travels in the step's one small all-reduce (started at the
start of the step, waited after backward), so ranks agree on the stop step without an
extra collective or stall."""
from __future__ import annotations

import os
import signal
import sys


class Preemption:
    def __init__(self) -> None:
        self.requested = False
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            print(f"flextrain: second signal {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = True
        print(f"flextrain: {signal.Signals(signum).name} received: checkpointing at the end of the step, then exiting",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
