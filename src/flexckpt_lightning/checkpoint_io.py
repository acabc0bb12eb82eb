"""Lightning's ``CheckpointIO`` on flexckpt: the whole checkpoint dict, no pickle.

Paths and steps: each Lightning checkpoint path (``.../epoch=0-step=4.ckpt``, ``last.ckpt``)
is a flexckpt URL of its own, a folder holding one committed step, the checkpoint's
``global_step``. ``ModelCheckpoint`` keeps naming, top-k and ``last`` as it does with files:
saving a path again (``last.ckpt`` at a later step, or ``save_last`` at the step just saved
under another name) commits the new step there and retention (``keep_last=1``) removes the
older one; ``remove_checkpoint`` removes the folder; ``ckpt_path="last"`` finds the newest
``last*.ckpt`` folder as it finds files.

Who saves: Lightning calls ``save_checkpoint`` on global rank 0 only (single device, DDP),
with rank 0's whole state; that process saves it alone, as a one-rank checkpoint
(``rank=0, world_size=1``: no collective, nothing asked of the other ranks), and every rank
loads it whole. Sharded state (``ModelParallelStrategy``) does not come through here, see
:mod:`flexckpt_lightning.model_parallel`.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from flexckpt import Checkpointer, LoadError, SaveError, SaveHandle
from flexckpt.integration import check_options

log = logging.getLogger("flexckpt.lightning")


def checkpoint_step(checkpoint: dict[str, Any]) -> int:
    """The flexckpt step of a Lightning checkpoint dict: its ``global_step``."""
    step = checkpoint.get("global_step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"the checkpoint's global_step must be an int >= 0, got {step!r}")
    return step


def load_device(map_location: Any) -> str | torch.device:
    """The device a load puts tensors on: ``map_location`` when it names one, else the CPU
    (a function or a dict of device renames is Lightning's torch.load form; flexckpt loads
    onto one device, and Lightning moves the state where it belongs)."""
    if isinstance(map_location, (str, torch.device)):
        return map_location
    return "cpu"


class FlexCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints through flexckpt (see the module docstring).

    Args:
        async_save: return from ``save_checkpoint`` once the state is copied out (the
            fence), and write and commit in the background (default); False returns once
            the checkpoint is committed. A failed background save is raised at the next
            save, load or removal, or at teardown.
        checkpointer_options: passed to each path's ``Checkpointer`` (``compression``,
            ``storage_options``, ``chunk_bytes``...). ``keep_last`` is 1: a path holds one
            checkpoint; how many paths are kept is ``ModelCheckpoint``'s ``save_top_k``.
    """

    def __init__(self, *, async_save: bool = True, **checkpointer_options: Any) -> None:
        super().__init__()
        check_options(checkpointer_options, type(self).__name__)
        for key in ("keep_last", "rank", "world_size", "read_only", "local"):
            if key in checkpointer_options:
                raise ValueError(f"FlexCheckpointIO sets {key} itself: drop {key}={checkpointer_options[key]!r}")
        self.async_save = bool(async_save)
        self.options = checkpointer_options
        self._open: dict[str, Checkpointer] = {}  # url -> the Checkpointer of a path with saves in flight
        self._handles: dict[str, SaveHandle] = {}  # url -> the newest save of that path
        self._lock = threading.Lock()  # AsyncCheckpointIO calls save_checkpoint from its thread

    # -- the CheckpointIO contract -----------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("FlexCheckpointIO takes storage options at construction (storage_options=...), "
                            "not per save")
        url = os.fspath(path)
        step = checkpoint_step(checkpoint)
        with self._lock:
            self._raise_failed()
            ckpt = self._open.get(url)
            if ckpt is None:
                ckpt = self._open[url] = Checkpointer(url, rank=0, world_size=1, keep_last=1, **self.options)
            handle = ckpt.save(step, checkpoint)
            self._handles[url] = handle
        if self.async_save:
            handle.wait_staged()  # Lightning's tensors may change once this returns
        else:
            handle.result()
        self._close_finished()

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        url = os.fspath(path)
        self._finish(url)
        if os.path.isfile(url):
            raise LoadError(f"{url} is a file (torch.save's format, read by unpickling), not a flexckpt checkpoint "
                            f"folder: flexckpt never unpickles; load it without FlexCheckpointIO once, or start anew")
        reader = Checkpointer(url, rank=0, world_size=1, read_only=True, **self.options)
        try:
            return reader.load_dict(device=load_device(map_location))
        finally:
            reader.close()

    def remove_checkpoint(self, path: Any) -> None:
        url = os.fspath(path)
        self._finish(url)
        if os.path.islink(url):  # ModelCheckpoint(save_last="link"): the link goes, not what it names
            os.remove(url)
            return
        fs = get_filesystem(url, **(self.options.get("storage_options") or {}))
        if fs.exists(url):
            fs.rm(url, recursive=True)
            log.debug("removed checkpoint %s", url)

    def teardown(self) -> None:
        """Wait for every save in flight; raise the first that failed."""
        for url in list(self._open):
            self._finish(url, raise_failed=False)
        self._raise_failed()

    # -- saves in flight ---------------------------------------------------------------------------
    def _finish(self, url: str, raise_failed: bool = True) -> None:
        """Wait for the saves of ``url``, close its Checkpointer, and raise a failed save."""
        with self._lock:
            ckpt = self._open.pop(url, None)
        if ckpt is not None:
            ckpt.wait()
            ckpt.close()
        if raise_failed:
            self._raise_failed()

    def _close_finished(self) -> None:
        with self._lock:
            done = [u for u, c in self._open.items() if self._handles.get(u) is None or self._handles[u].done()]
            closing = [self._open.pop(u) for u in done]
        for ckpt in closing:
            ckpt.close()

    def _raise_failed(self) -> None:
        failed = [(u, h) for u, h in self._handles.items() if h.done() and h.exception() is not None]
        for url, _ in failed:
            self._handles.pop(url, None)
        if failed:
            url, handle = failed[0]
            raise SaveError(f"checkpoint {url}: save of step {handle.step} failed: {handle.exception()}") \
                from handle.exception()
        for url in [u for u, h in self._handles.items() if h.done()]:
            self._handles.pop(url, None)
