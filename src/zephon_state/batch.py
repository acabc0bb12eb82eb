"""What iterating a pipeline yields: one microbatch of packed rows, ready for a decoder-only
transformer through ``to_training()``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from .cursor import LaneCursor


@dataclass(frozen=True, eq=False)
class Batch:
    """One microbatch: ``[rows, max_length]`` arrays.

    - ``input_ids`` (int32): token ids.
    - ``labels`` (int32): the next token of the same document, ``-100`` after a document's last
      token (its EOS) and on padding; use them as they are (no shift) with
      ``F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)``.
    - ``position_ids`` (int32): position within the document's segment in this row.
    - ``document_ids`` (int32): index of the segment within the row, ``-1`` on padding; token i
      may attend to token j iff ``j <= i`` and both have the same document id
      (``block_causal_mask``).
    - ``source_ids`` (int16): index of each token's source in the plan (``-1`` on padding).
    - ``lane_ids`` (int32, ``[rows]``): the lane each row came from.

    ``step`` counts global batches from 0; a rank's step is ``microbatches`` microbatches.
    ``lane_digests`` holds, for every lane whose whole step contribution this rank assembled,
    SHA-256 of it (see ``zephon_state.digest``); gather them from all ranks and pass them to
    ``global_batch_digest``.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    source_ids: np.ndarray
    lane_ids: np.ndarray
    step: int
    microbatch: int
    microbatches: int
    lane_digests: Mapping[int, bytes]
    lane_cursors: Mapping[int, LaneCursor] = field(repr=False)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_in_step(self) -> bool:
        """True on the microbatch after which the optimizer steps."""
        return self.microbatch == self.microbatches - 1

    def to_training(self, device: "torch.device | str | None" = None) -> dict[str, torch.Tensor]:
        """``input_ids``, ``labels`` and ``position_ids`` as int64 and ``document_ids`` as int32
        tensors of shape ``[rows, max_length]``, on ``device`` (CPU by default)."""
        out = {
            "input_ids": torch.from_numpy(self.input_ids).long(),
            "labels": torch.from_numpy(self.labels).long(),
            "position_ids": torch.from_numpy(self.position_ids).long(),
            "document_ids": torch.from_numpy(np.ascontiguousarray(self.document_ids)),
        }
        if device is not None:
            out = {k: v.to(device) for k, v in out.items()}
        return out


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask ``[rows, 1, T, T]`` (True = may attend) for
    ``torch.nn.functional.scaled_dot_product_attention``: causal within each document, nothing
    across documents. Padding (-1) attends only to padding, so no row of the mask is empty."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None, :, :]
