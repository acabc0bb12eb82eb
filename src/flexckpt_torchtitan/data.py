"""zephon_state as torchtitan 0.3.0's data loader.

In the user's config function (nothing else changes):

    dataloader=ZephonDataLoader.Config(dataset_path="/data/train.jsonl", lanes=8, global_batch_size=64)

The global batch is ``dataloader.global_batch_size`` rows of ``training.seq_len`` tokens; it
must equal ``training.global_batch_size`` (torchtitan hands a loader only its local batch and
the data-parallel degree, so it is given here too, and the flexckpt manager checks the two
agree). ``dataset_path`` is a JSON Lines or text file, a glob, or a folder of such files (as
torchtitan's own loader takes it). The loader runs as rank ``dp_rank`` of ``dp_world_size``
of the batch (data-parallel) mesh, so tensor- and pipeline-parallel peers read the same
lanes. Each ``next()`` is one microbatch of ``local_batch_size`` rows, ``(input_dict,
labels)`` with ``input_dict`` holding ``input`` and ``positions`` (per document, for
torchtitan's document masks) and ``labels`` the next tokens with -100 after each document's end.

At start (before step 1) the loader checks that the lanes split evenly over the
data-parallel degree and the global batch over the lanes, naming sizes that work. Its state
is the position the trainer has consumed (not what the pipeline prefetched): one cursor per
lane, each under its own key, so a checkpoint that keeps one copy of each key (torchtitan's
DCP manager) keeps every rank's lanes; the flexckpt manager saves them as one
``flexckpt.ByLane`` value (:meth:`ZephonDataLoader.by_lane`). Either way a resume at another
data-parallel degree that divides the lane count continues with the same global batches.
A data plan changed on purpose (another global batch, lane count or source) is a new data
phase: ``dataloader.data_phase`` names it, and a resume with a new name starts the data from
its beginning in new orders while the model and optimizer resume.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from torchtitan.components.dataloader import BaseDataLoader

from flexckpt import ByLane
from zephon_state import ConfigError, FingerprintMismatch, JsonLines, Mix, Pipeline, TextFiles, Topology
from zephon_state.fingerprint import mismatch_message


_JSON_LINES = (".jsonl", ".json", ".ndjson")
_TEXT = (".txt",)
_COMPRESSED = ("", ".gz", ".zst", ".zstd")

# how a torchtitan user changes each fingerprinted value (zephon's own message names its API)
_FIXES = {
    "sources": "read the same files, with the same content, in the same order (dataloader.dataset_path or .sources)",
    "shares": "pass the saved dataloader.shares",
    "tokenizer": "use the saved tokenizer (dataloader.tokenizer_path)",
    "seed": "pass the saved dataloader.seed",
    "data_phase": "pass the saved dataloader.data_phase",
    "max_length": "pass the saved training.seq_len",
    "packing": "pass the saved dataloader.packing",
    "window": "pass the saved dataloader.shuffle_buffer",
    "shuffle": "pass the saved dataloader.shuffle_buffer",
    "global_batch": "pass the saved training.global_batch_size and dataloader.global_batch_size",
    "lanes": "pass the saved dataloader.lanes",
    "version": "resume with the zephon_state version that wrote the checkpoint",
}
_NEW_PHASE = ("--dataloader.data_phase <new name>: the data then starts from its beginning in new orders, "
              "and the model and optimizer resume")


def _kind(name: str) -> str | None:
    """"jsonl" or "text" for a file name zephon reads, else None."""
    for suffix in _COMPRESSED:
        if suffix and not name.endswith(suffix):
            continue
        stem = name[: len(name) - len(suffix)] if suffix else name
        if stem.endswith(_JSON_LINES):
            return "jsonl"
        if stem.endswith(_TEXT):
            return "text"
    return None


def _folder_source(path: str) -> Any:
    """``path`` as zephon reads it: a file or glob as it is, a folder (local or a URL) as the
    files it holds in name order (JSON Lines, or text files: one kind), as torchtitan's
    loader takes a folder."""
    fs, inner = fsspec.core.url_to_fs(path)
    if not fs.isdir(inner):
        return path
    entries = sorted(e["name"] for e in fs.ls(inner, detail=True) if e["type"] == "file")
    files = {os.path.basename(e): e for e in entries if not os.path.basename(e).startswith(".")}
    kinds = {f: _kind(f) for f in files}
    found = set(kinds.values())
    if not files or None in found or len(found) > 1:
        other = [f for f, k in kinds.items() if k is None] or list(files)
        raise ValueError(
            f"ZephonDataLoader: dataloader.dataset_path={path!r} is a folder holding {len(files)} files"
            + (f" ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''})" if files else "")
            + "; it reads a folder of JSON Lines files (.jsonl, .json, .ndjson) or of text files (.txt), "
            "each optionally .gz or .zst, one kind per folder: pass a glob such as "
            f"{path.rstrip('/') + '/*.jsonl'!r}, or name each file in dataloader.sources")
    full = [fs.unstrip_protocol(e) if "://" in path else e for e in files.values()]
    name = os.path.basename(inner.rstrip("/"))
    return JsonLines(full, name=name) if found == {"jsonl"} else TextFiles(full, name=name)


class ZephonDataLoader(BaseDataLoader):
    """torchtitan's ``BaseDataLoader`` over a zephon_state pipeline (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        sources: dict[str, str] = field(default_factory=dict)
        """Named sources (``name -> path``: a JSON Lines or text file, a glob, or a folder of them);
        default: ``dataset_path``."""

        shares: dict[str, float] = field(default_factory=dict)
        """Token shares, one per source (needed with more than one source)."""

        text_field: str = "text"
        """The field of each JSON record that holds the text."""

        tokenizer_path: str = ""
        """A tokenizer id or a tokenizer.json (folder); default: torchtitan's tokenizer folder."""

        lanes: int = 8
        """Lanes: a multiple of every data-parallel degree to run at, dividing the global batch."""

        global_batch_size: int = -1
        """Rows per optimizer step: required, equal to training.global_batch_size."""

        shuffle_buffer: int = 64
        """Rows each lane shuffles together."""

        seed: int = 0
        packing: str = "wrap"
        """How documents are packed into rows: "wrap" or "best_fit"."""

        workers: int = 1
        """Tokenizer threads."""

        data_phase: str = "main"
        """The data phase; a resume under a new name starts the data afresh (a changed data plan)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,  # unused: the lane cursors are exact at every step
    ) -> None:
        g = config.global_batch_size
        if g < 1:
            raise ValueError(
                f"ZephonDataLoader needs dataloader.global_batch_size (now {g}), the rows of one optimizer step: "
                f"set it to training.global_batch_size (torchtitan hands a data loader only its local batch, "
                f"{local_batch_size}, and the data-parallel degree, {dp_world_size}), e.g. "
                f"--dataloader.global_batch_size {local_batch_size * dp_world_size} for one microbatch per rank")
        try:
            self.topology = Topology(config.lanes, g, local_batch_size, dp_rank, dp_world_size)
        except ConfigError as e:
            raise ValueError(
                f"ZephonDataLoader (dataloader.lanes={config.lanes}, global batch {g}, data-parallel degree "
                f"{dp_world_size}, local batch {local_batch_size}): {e}"
            ) from None
        paths = dict(config.sources) or ({"data": config.dataset_path} if config.dataset_path else {})
        if not paths:
            raise ValueError("ZephonDataLoader needs dataloader.dataset_path or dataloader.sources (name -> path)")
        paths = {name: _folder_source(path) for name, path in paths.items()}
        tokenizer_id = config.tokenizer_path or getattr(tokenizer, "tokenizer_path", "") or "gpt2"
        # a path is read by its suffix (JSON lines or text files) by zephon_state's as_source
        if len(paths) == 1 and not config.shares:
            data: Any = next(iter(paths.values()))
        else:
            data = Mix(paths, shares=dict(config.shares))
        self.data_phase = config.data_phase
        self.pipeline = (
            Pipeline(data)
            .options(data_phase=config.data_phase)
            .tokenize(tokenizer_id=tokenizer_id, field=config.text_field, parallelism=config.workers)
            .pack_flat(max_length=seq_len, algorithm=config.packing)
            .shuffle(buffer_size=config.shuffle_buffer, seed=config.seed)
            .batch(microbatch_size=local_batch_size, global_batch_size=g)
            .lanes(config.lanes)
            .data_parallel(rank=dp_rank, size=dp_world_size)
        )
        self.pipeline.topology  # noqa: B018 - resolve the plan now, at start, not in step 1
        self.step_digests: list[dict[int, bytes]] = []  # per step: lane -> digest, the lanes hosted here
        self._pending: dict[int, bytes] = {}

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            batch = next(self.pipeline)
            self._pending.update(batch.lane_digests)
            if batch.last_in_step:
                self.step_digests.append(self._pending)
                self._pending = {}
            t = batch.to_training()
            yield {"input": t["input_ids"], "positions": t["position_ids"]}, t["labels"]

    def state_dict(self) -> dict[str, Any]:
        """Each lane's cursor under its own key (JSON text): ``{"lanes": {lane: cursor},
        "zephon": the rest, equal on every rank}``."""
        state = self.pipeline.state_dict()
        lanes = state.pop("lanes")
        return {"lanes": {lane: json.dumps(cursor, sort_keys=True) for lane, cursor in lanes.items()},
                "zephon": json.dumps(state, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict`` (``lanes`` as saved here, or a ``ByLane`` of cursors);
        a saved ``data_phase`` other than this loader's starts a new data phase."""
        if not state_dict:
            return
        state = json.loads(state_dict["zephon"])
        lanes = state_dict["lanes"]
        state["lanes"] = lanes.values if isinstance(lanes, ByLane) else {k: json.loads(v) for k, v in lanes.items()}
        plan = state.get("plan")
        saved_phase = plan.get("data_phase") if isinstance(plan, dict) else None
        new_phase = saved_phase is not None and saved_phase != self.data_phase
        if not new_phase and state.get("fingerprint") != self.pipeline.fingerprint():
            raise FingerprintMismatch(mismatch_message(plan, self.pipeline.plan_fields(), fixes=_FIXES,
                                                       new_phase=_NEW_PHASE))
        self.pipeline.load_state_dict(state, new_phase=new_phase)
        self._pending = {}

    def by_lane(self) -> "ByLaneState":
        """This loader's state as the flexckpt manager saves it."""
        return ByLaneState(self)

    def close(self) -> None:
        self.pipeline.close()


class ByLaneState:
    """A :class:`ZephonDataLoader`'s state with its lane cursors as one ``flexckpt.ByLane``
    value: flexckpt merges every rank's lanes into one mapping and hands each rank the union."""

    def __init__(self, loader: ZephonDataLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict()
        return {"lanes": ByLane({k: json.loads(v) for k, v in state["lanes"].items()}), "zephon": state["zephon"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)
