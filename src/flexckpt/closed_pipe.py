"""How the command lines (``flexckpt``, ``flextrain``) end when their output's reader has
gone (``... | head``): no traceback, no message, exit status 141 as a process ended by
SIGPIPE. Standard library only; note that importing it imports the ``flexckpt`` package
(and torch), so ``flextrain``'s CLI imports it only where a command has loaded flexckpt."""
from __future__ import annotations

import os
import sys

EXIT_STATUS = 141  # 128 + SIGPIPE


def reader_gone() -> int:
    """Point stdout at /dev/null (the flush at exit must not fail again); the exit status."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_STATUS
