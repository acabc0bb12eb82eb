"""zephon_state as torchtitan 0.3.0's data loader.

In the user's config function (nothing else changes):

    dataloader=ZephonDataLoader.Config(dataset_path="/data/train.jsonl", lanes=8)

The global batch is torchtitan's ``training.global_batch_size`` rows of ``training.seq_len``
tokens; the loader runs as rank ``dp_rank`` of ``dp_world_size`` of the batch (data-parallel)
mesh, so tensor- and pipeline-parallel peers read the same lanes. Each ``next()`` is one
microbatch of ``local_batch_size`` rows, ``(input_dict, labels)`` with ``input_dict`` holding
``input`` and ``positions`` (per document, for torchtitan's document masks) and ``labels``
the next tokens with -100 after each document's end.

At start (before step 1) the loader checks that the lanes split evenly over the
data-parallel degree and the global batch over the lanes, naming sizes that work. Its state
is the position the trainer has consumed (not what the pipeline prefetched): lane cursors
saved by lane (``flexckpt.ByLane``), so a resume at another data-parallel degree that divides
the lane count continues with the same global batches.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from flexckpt import ByLane
from zephon_state import ConfigError, Mix, Pipeline, Topology


def _training_global_batch() -> int | None:
    """``training.global_batch_size`` of the Trainer that is building this loader (its
    ``gradient_accumulation_steps`` is set just before). torchtitan 0.3.0 hands a loader the
    local batch and the dp degree only; the global batch is what zephon's plan is made of."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if hasattr(owner, "gradient_accumulation_steps") and hasattr(getattr(owner, "config", None), "training"):
            return int(owner.config.training.global_batch_size)
        frame = frame.f_back
    return None


class ZephonDataLoader(BaseDataLoader):
    """torchtitan's ``BaseDataLoader`` over a zephon_state pipeline (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        sources: dict[str, str] = field(default_factory=dict)
        """Named sources (``name -> path`` of JSON lines or text files); default: ``dataset_path``."""

        shares: dict[str, float] = field(default_factory=dict)
        """Token shares, one per source (needed with more than one source)."""

        text_field: str = "text"
        """The field of each JSON record that holds the text."""

        tokenizer_path: str = ""
        """A tokenizer id or a tokenizer.json (folder); default: torchtitan's tokenizer folder."""

        lanes: int = 8
        """Lanes: a multiple of every data-parallel degree to run at, dividing the global batch."""

        global_batch_size: int = -1
        """-1: training.global_batch_size (or local batch x dp degree when that is -1)."""

        shuffle_buffer: int = 64
        """Rows each lane shuffles together."""

        seed: int = 0
        packing: str = "wrap"
        """How documents are packed into rows: "wrap" or "best_fit"."""

        workers: int = 1
        """Tokenizer threads."""

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
        if g == -1:
            g = _training_global_batch() or -1
        if g == -1:
            g = local_batch_size * dp_world_size
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
        tokenizer_id = config.tokenizer_path or getattr(tokenizer, "tokenizer_path", "") or "gpt2"
        # a path is read by its suffix (JSON lines or text files) by zephon_state's as_source
        if len(paths) == 1 and not config.shares:
            data: Any = next(iter(paths.values()))
        else:
            data = Mix(paths, shares=dict(config.shares))
        self.pipeline = (
            Pipeline(data)
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
        state = self.pipeline.state_dict()
        lanes = state.pop("lanes")
        return {"lanes": ByLane(dict(lanes)), "zephon": json.dumps(state, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        state = json.loads(state_dict["zephon"])
        state["lanes"] = state_dict["lanes"].values
        self.pipeline.load_state_dict(state)
        self._pending = {}

    def close(self) -> None:
        self.pipeline.close()
