"""Reading a committed checkpoint a few tensors at a time, through the public
``Checkpointer`` API only (``contents()`` and ``load(..., strict=False)``), so that the
converters hold at most one batch of tensors: the largest tensor, or ``budget`` bytes of
smaller ones. Also the mapping between flexckpt names and nested keys, the check that an
output folder is new, and the converters' progress bar."""
from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from flexckpt.checkpointer import Checkpointer
from flexckpt.contents import Contents
from flexckpt.errors import CheckpointError
from flexckpt.load.pending import subset_load

DEFAULT_BUDGET = 256 << 20


def name_path(name: str) -> tuple[str, ...]:
    """The nested keys of a flexckpt name (``/``-joined, ``%2F`` and ``%25`` escaped)."""
    return tuple(p.replace("%2F", "/").replace("%25", "%") for p in name.split("/"))


def put(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def batches(names: list[str], sizes: dict[str, int], budget: int) -> Iterator[list[str]]:
    """Consecutive runs of ``names`` of at most ``budget`` bytes (a larger tensor alone)."""
    run: list[str] = []
    held = 0
    for n in names:
        if run and held + sizes[n] > budget:
            yield run
            run, held = [], 0
        run.append(n)
        held += sizes[n]
    if run:
        yield run


def open_source(url: str, step: int | None) -> tuple[Checkpointer, Contents]:
    """A single-rank reader of ``url`` and what its chosen step holds (its manifest read
    once). A damaged newest manifest, taken by default, is refused naming the step before it."""
    ck = Checkpointer(url, rank=0, world_size=1, run_id="convert", read_only=True)  # the source stays as it is
    try:
        steps = ck.steps()
        if not steps:
            run_ckpt = url.rstrip("/") + "/ckpt"  # a flextrain run folder keeps its checkpoints there
            with Checkpointer(run_ckpt, rank=0, world_size=1, run_id="convert", read_only=True) as probe:
                hint = f"; for a flextrain run folder pass {run_ckpt}" if probe.steps() else ""
            raise CheckpointError(f"no committed flexckpt checkpoint under {url}{hint}")
        try:
            return ck, ck.contents(steps[-1] if step is None else step).by_name()  # selected by name pattern
        except CheckpointError as e:
            if step is not None or len(steps) < 2:
                raise
            raise CheckpointError(f"{e}; pass --step {steps[-2]} for the step before it") from None
    except BaseException:
        ck.close()
        raise


def read_tensors(ck: Checkpointer, contents: Contents, names: list[str]) -> dict[str, torch.Tensor]:
    """The whole tensors ``names`` of ``contents.step``, read in one load."""
    state: dict = {}
    out = {}
    for n in names:
        info = contents.tensors[n]
        out[n] = torch.empty(info.shape, dtype=info.dtype)
        put(state, name_path(n), out[n])
    with subset_load():
        ck.load(state, step=contents.step, strict=False)
    return out


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled, leave=False)


def check_new_folder(path: str, what: str) -> None:
    """``path`` may not exist yet or must be an empty folder; its parent must be writable."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"{what} {path!r} already exists and is not an empty folder; choose a new folder")
    parent = os.path.dirname(os.path.abspath(path)) or "."
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {what} {path!r}: {e.strerror}; choose a writable place") from None
    if not os.access(path, os.W_OK) or not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{what} {path!r} is not writable; choose a writable place")
