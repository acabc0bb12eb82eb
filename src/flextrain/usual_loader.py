"""The baseline: a streaming loader as most trainers build it, for the experiments.

Documents are split across ranks by rank (document ``i`` of each source goes to rank
``i % D``, as ``split_dataset_by_node`` does); each rank tokenizes, packs and shuffles its
own stream with the same tokenizer, packing, shuffle buffer, seed and token mix as zephon
(it *is* a one-lane zephon pipeline over the rank's documents: only the split differs) and
yields ``global / D`` rows per step. Its state is per rank: the steps consumed. On a resume
at another D a careful user re-splits the documents for the new D and fast-forwards each
rank past the steps consumed, which is what :meth:`load_state_dict` does.

Its step digest is order-insensitive (SHA-256 over the sorted per-row digests), so two
runs count as seeing the same batch whenever they train on the same rows.
"""
from __future__ import annotations

import hashlib
from typing import Any

from zephon_state import InMemory, Mix, Pipeline
from zephon_state.holdout import HoldoutConfig, split
from zephon_state.storage import IoOptions

from flextrain.config import DataConfig
from flextrain.data import source

FORMAT = "flextrain-usual-loader/1"


class UsualLoader:
    def __init__(self, d: DataConfig, seed: int, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        hold = HoldoutConfig(d.heldout_fraction, seed, "train")
        sources = {}
        for name, path in d.sources.items():
            docs = split(source(name, path).load("text", IoOptions(), "count"), hold)
            sources[name] = InMemory(list(docs.texts[rank::world]), name=name)
        local = d.global_batch // world
        self.pipeline = (
            Pipeline(Mix(sources, shares=dict(d.shares)))
            .tokenize(tokenizer_id=d.tokenizer, field="text", parallelism=d.workers)
            .pack_flat(max_length=d.max_length, algorithm=d.packing)
            .shuffle(buffer_size=d.shuffle_buffer, seed=seed)
            .batch(microbatch_size=min(d.micro_batch, local), global_batch_size=local)
            .data_parallel(0, 1)
        )
        self.steps = 0

    def __iter__(self) -> "UsualLoader":
        return self

    def __next__(self):
        b = next(self.pipeline)
        if b.last_in_step:
            self.steps += 1
        return b

    @staticmethod
    def step_digests(micro: list) -> list[bytes]:
        return [hashlib.sha256(row.astype("<i4").tobytes()).digest() for b in micro for row in b.input_ids]

    @staticmethod
    def combine(digests: list[bytes]) -> str:
        return hashlib.sha256(b"".join(sorted(digests))).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "world": self.world, "lanes": {str(self.rank): {"steps": self.steps}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = {v["steps"] for v in state["lanes"].values()}
        if len(steps) != 1:
            raise ValueError(f"ranks saved different step counts {sorted(steps)}")
        target = steps.pop()
        while self.steps < target:  # re-split for this D, then skip what the run consumed
            next(self)

    def close(self) -> None:
        self.pipeline.close()
