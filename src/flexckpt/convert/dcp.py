"""``torch.distributed.checkpoint`` (DCP) folders to flexckpt checkpoints and back, a few
tensors at a time: peak memory is about two batches (the largest tensor, or ``budget``
bytes of smaller ones; a batch is read, then copied once more while it is saved).

Import reads DCP's ``.metadata``, which is a pickle (and non-tensor values are
``torch.load``-ed with ``weights_only=False``): import only checkpoints you trust. That is
the converter's business; flexckpt's own load path never unpickles.

Import writes through the public ``Checkpointer``: batch k is the piece of rank k of a
world of K "ranks" played in this process, each tensor ``Owned`` by the rank of its batch,
so each batch is saved and freed before the next is read. The result loads at any world
size, like any flexckpt checkpoint. Names keep the nesting given to ``dcp.save`` (DCP's
metadata records each flattened key's path), so ``Checkpointer.load({"model": msd})``
works on the import as ``dcp.load({"model": msd}, ...)`` works on the original.

Export turns each name back into nested keys (levels keyed ``0 .. n-1`` become lists, as
``get_state_dict`` optimizer ``param_groups`` are) and saves with ``dcp.save`` through a
planner whose tensors are meta placeholders, each read from flexckpt only when DCP's
writer asks for its bytes. One file per item (``single_file_per_rank=False``): DCP's
writer keeps every tensor of a file alive until that file is closed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flexckpt.checkpointer import Checkpointer
from flexckpt.convert.offline import OfflineSave
from flexckpt.convert.tensor_stream import (
    DEFAULT_BUDGET, batches, check_new_folder, name_path, open_source, progress_bar, put, read_tensors,
)
from flexckpt.errors import CheckpointError
from flexckpt.state.structure import walk
from flexshard import Owned, ShardedTensor

DCP_METADATA = ".metadata"


@dataclass
class ConvertReport:
    step: int
    step_source: str  # where the step came from: "--step", a plain value's name, or "default"
    tensors: int = 0
    nbytes: int = 0
    batches: int = 0
    left_out: list[str] = field(default_factory=list)  # names, with why


# -- import --------------------------------------------------------------------------------------
def read_dcp_metadata(dcp_dir: str) -> Any:
    """DCP's metadata of ``dcp_dir`` (unpickled: trusted checkpoints only), after checking
    that the folder is one."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(dcp_dir):
        raise CheckpointError(f"{dcp_dir!r} is not a folder; pass the folder that torch.distributed.checkpoint.save wrote")
    if not os.path.isfile(os.path.join(dcp_dir, DCP_METADATA)):
        raise CheckpointError(
            f"{dcp_dir!r} has no {DCP_METADATA} file, so it is not a complete DCP checkpoint "
            f"(a save that did not finish, or not a DCP folder)"
        )
    try:
        return FileSystemReader(dcp_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - one clear line for any unreadable metadata
        raise CheckpointError(f"{dcp_dir}/{DCP_METADATA} is not readable DCP metadata: {type(e).__name__}: {e}") from None


def _dcp_call(what: str, fn: Callable[[], Any]) -> Any:
    """Run a DCP call; its failure (a ``CheckpointException`` wrapping each rank's error)
    becomes one ``CheckpointError`` line naming the first underlying error. DCP's warning
    that torch.distributed is not initialised is silenced: one process is what we ask for."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return fn()
    except CheckpointException as e:
        first = next(iter(e.failures.values()), (e, None))[0]
        raise CheckpointError(f"{what} failed: {type(first).__name__}: {first}") from first


def _dcp_load(dcp_dir: str, targets: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    _dcp_call(f"reading {dcp_dir}", lambda: dcp.load(targets, storage_reader=FileSystemReader(dcp_dir), no_dist=True))


def _is_plain(value: Any) -> bool:
    try:
        w = walk({"v": value}, 0, 1)
    except (TypeError, ValueError):
        return False
    return not (w.tensors or w.lanes or w.per_rank or w.keyed or w.statefuls)


def import_dcp(dcp_dir: str, url: str, step: int | None = None, *, budget: int = DEFAULT_BUDGET,
               progress: bool = False) -> ConvertReport:
    """Write the DCP checkpoint in ``dcp_dir`` as one flexckpt step under ``url``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = read_dcp_metadata(dcp_dir)
    paths = md.planner_data or {}
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    values = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    report = ConvertReport(step=0, step_source="default")

    plain: dict[str, Any] = {}
    if values:
        loaded: dict[str, Any] = {k: None for k in values}
        _dcp_load(dcp_dir, loaded)
        for k, v in loaded.items():
            if _is_plain(v):
                plain[k] = v
            else:
                report.left_out.append(f"{k} ({type(v).__name__} is not a plain value)")
    if step is not None:
        report.step, report.step_source = step, "--step"
    elif isinstance(plain.get("step"), int) and not isinstance(plain["step"], bool) and paths.get("step", ("step",)) == ("step",):
        report.step, report.step_source = plain["step"], "plain value 'step'"
    sizes = {k: _numel(m.size) * torch.empty((), dtype=m.properties.dtype).element_size() for k, m in tensors.items()}
    groups = list(batches(list(tensors), sizes, budget)) or [[]]
    world = len(groups)
    owner = {k: r for r, g in enumerate(groups) for k in g}

    def state_for(rank: int, whole: dict[str, torch.Tensor]) -> dict:
        state: dict = {}
        for k, m in tensors.items():
            shape = tuple(m.size)
            piece = (ShardedTensor.from_global(whole[k], Owned(owner[k]), rank, world, copy=False) if k in whole
                     else ShardedTensor.empty(shape, Owned(owner[k]), m.properties.dtype, rank=rank, world_size=world))
            put(state, tuple(paths.get(k, (k,))), piece)
        for k, v in plain.items():
            put(state, tuple(paths.get(k, (k,))), v)
        return state

    run_id = uuid.uuid4().hex[:16]
    bar = progress_bar(sum(sizes.values()), "import-dcp", progress)
    with contextlib.closing(bar), OfflineSave(url) as out:  # a failed batch fails the import at once, removing what it wrote
        for rank in reversed(range(world)):  # a group leader after its group (it gathers their records), rank 0 last
            whole = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype) for k in groups[rank]}
            if whole:
                _dcp_load(dcp_dir, dict(whole))
            with Checkpointer(url, rank=rank, world_size=world, run_id=run_id) as ck:
                out.started(ck.save(report.step, state_for(rank, whole)))
                if rank == 0:
                    out.result()
                else:
                    ck.wait()
                    out.check()
            del whole
            bar.update(sum(sizes[k] for k in groups[rank]))
    report.tensors, report.nbytes, report.batches = len(tensors), sum(sizes.values()), world
    return report


def _numel(size: Any) -> int:
    n = 1
    for s in size:
        n *= int(s)
    return n


# -- export --------------------------------------------------------------------------------------
def _listify(tree: Any) -> Any:
    """Dict levels keyed exactly ``"0" .. "n-1"`` become lists (how a walk names list items)."""
    if not isinstance(tree, dict):
        return tree
    out = {k: _listify(v) for k, v in tree.items()}
    if out and sorted(out) == sorted(str(i) for i in range(len(out))):
        return [out[str(i)] for i in range(len(out))]
    return out


def _streaming_planner(fetch: Callable[[str], torch.Tensor]) -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingSavePlanner(DefaultSavePlanner):
        """Tensors in the state are meta placeholders; their bytes come from ``fetch``
        when the writer asks for them."""

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return fetch(write_item.index.fqn)

    return StreamingSavePlanner()


def export_dcp(url: str, dcp_dir: str, step: int | None = None, *, budget: int = DEFAULT_BUDGET,
               progress: bool = False) -> ConvertReport:
    """Write one flexckpt step as a DCP checkpoint in the new folder ``dcp_dir``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    ck, contents = open_source(url, step)
    report = ConvertReport(step=contents.step, step_source="--step" if step is not None else "newest")
    report.left_out = [f"{n} (per-lane value)" for n in contents.lanes] + [f"{n} (per-rank value)" for n in contents.per_rank] + [
        f"{n} (bytes value)" for n in contents.keyed]
    tree: dict = {}
    for n, info in contents.tensors.items():
        put(tree, name_path(n), torch.empty(info.shape, dtype=info.dtype, device="meta"))
    for n, v in contents.plain.items():
        put(tree, name_path(n), v)
    state = _listify(tree)
    flat, mapping = flatten_state_dict(state)
    fqn_name = {fqn: "/".join(str(p).replace("%", "%25").replace("/", "%2F") for p in path) for fqn, path in mapping.items()}
    order = [fqn for fqn, v in flat.items() if isinstance(v, torch.Tensor)]
    sizes = {fqn: contents.tensors[fqn_name[fqn]].nbytes for fqn in order}
    cache: dict[str, torch.Tensor] = {}
    bar = progress_bar(sum(sizes.values()), "export-dcp", progress)

    def fetch(fqn: str) -> torch.Tensor:
        if fqn not in cache:
            cache.clear()  # the previous batch has been written
            run = next(batches(order[order.index(fqn):], sizes, budget))
            got = read_tensors(ck, contents, [fqn_name[f] for f in run])
            cache.update({f: got[fqn_name[f]] for f in run})
            report.batches += 1
        bar.update(sizes[fqn])
        return cache.pop(fqn)

    check_new_folder(dcp_dir, "DCP folder")
    try:
        _dcp_call(f"writing {dcp_dir}", lambda: dcp.save(
            state, storage_writer=FileSystemWriter(dcp_dir, single_file_per_rank=False, thread_count=1),
            planner=_streaming_planner(fetch), no_dist=True))
    except BaseException:
        shutil.rmtree(dcp_dir, ignore_errors=True)
        raise
    finally:
        bar.close()
        ck.close()
    report.tensors, report.nbytes = len(order), sum(sizes.values())
    return report
