"""The user's code from issue 3 runs as written, and what it yields is ready for a decoder-only
transformer."""
from pathlib import Path

import numpy as np
import torch

from zephon_state import Pipeline

source = str(Path(__file__).resolve().parents[2] / "src" / "flextrain" / "corpus" / "kjv.jsonl.zst")


def test_the_issue_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path))
    seen = []

    def train_step(batch):
        seen.append(batch)

    pipeline = (
        Pipeline(source)
        .options(io_options={"cache": {"enabled": True}})
        .tokenize(tokenizer_id="gpt2", field="text", parallelism=4)
        .pack_flat(max_length=2048, algorithm="wrap")
        .shuffle(buffer_size=1024, seed=42)
        .batch(microbatch_size=8)
    )
    for batch in pipeline:
        train_step(batch.to_training())
        if len(seen) == 2:
            break
    pipeline.close()

    for batch in seen:
        assert {k: tuple(v.shape) for k, v in batch.items()} == {
            "input_ids": (8, 2048), "labels": (8, 2048), "position_ids": (8, 2048), "document_ids": (8, 2048)
        }
        ids, labels, docs = batch["input_ids"], batch["labels"], batch["document_ids"]
        same_doc = docs[:, 1:] == docs[:, :-1]
        assert torch.equal(labels[:, :-1][same_doc], ids[:, 1:][same_doc])
        assert (labels[:, :-1][~same_doc] == -100).all()
        assert (ids[labels == -100] == 50256).all()  # within a document only the EOS has no label
    assert not np.array_equal(seen[0]["input_ids"].numpy(), seen[1]["input_ids"].numpy())
