"""The fast tier: checkpoints every few steps in node-local memory (a tmpfs such as
``/dev/shm``) with a copy on a peer node, restored after a node failure at any world size.

``LocalTier`` is the configuration a ``Checkpointer(url, local=LocalTier(...))`` takes;
``FastTier`` (``fast.py``) is the runtime it composes, given a host and the save
pipeline's staging (``seam``). Modules: ``placement`` (node identity, partner rule),
``inventory`` (what a node holds, which step to restore), ``transport`` (copies and a
recovery's byte ranges over the tier's own gloo group), ``fetchplan`` (which byte ranges a
recovering rank asks of which peer), ``view`` (the files a recovery's load reads: the
node's, a peer's ranges, the store's), ``owner`` (the lock a live tier folder is held by,
and the folder's and the run folder's identity), ``save`` (a fast save's staging, files
and marker), ``keep`` (what a process keeps of the node's folder, pruned to keep_last),
``recover`` (the recovery's steps)."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalTier:
    """Args:
        dir: node-local folder (``/dev/shm/flexckpt`` by default); each run lineage gets a
            folder of its own inside it. ``{node}`` in it is replaced by the node's name.
        every: a fast save every ``every`` steps (the trainer asks; see ``Checkpointer.save_local``).
        replicas: copies on other nodes (0: none; capped at the node count minus one).
        keep_last: fast-tier steps kept on each node.
        timeout: seconds a transfer may take before its pair is given up.
        lineage: names the run across restarts (default: ``FLEXCKPT_RUN_ID`` or torchrun's
            ``TORCHELASTIC_RUN_ID``, with the persistent URL); a tier of another lineage is
            never loaded, and removed at start once no live process holds it (``owner``) and
            it has been untouched for ``stale_after`` seconds.
        state_bytes: if given, the space check runs at construction (else at the first save).
    """

    dir: str = "/dev/shm/flexckpt"
    every: int = 1
    replicas: int = 1
    keep_last: int = 2
    timeout: float = 60.0
    lineage: str | None = None
    stale_after: float = 60.0
    state_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, lo in (("every", 1), ("replicas", 0), ("keep_last", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"LocalTier.{name} must be an int >= {lo}, got {v!r}")
        if not self.timeout > 0:
            raise ValueError(f"LocalTier.timeout must be > 0 seconds, got {self.timeout!r}")
        if not isinstance(self.dir, str) or not self.dir:
            raise ValueError(f"LocalTier.dir must be a folder path, got {self.dir!r}")

    def resolved_lineage(self, url: str) -> str:
        return self.lineage or os.environ.get("FLEXCKPT_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or url


__all__ = ["LocalTier"]
