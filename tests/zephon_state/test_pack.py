"""zephon_state packing: wrap and best fit, labels, position and document ids, the block-causal mask."""
import itertools

import numpy as np
import torch

from zephon_state import InMemory, Pipeline, block_causal_mask, load_tokenizer
from zephon_state.accumulator import TokenizedDocument
from zephon_state.cursor import SourceState
from zephon_state.pack import best_fit_bins, pack_best_fit, pack_wrap
from zephon_state.shuffle import epoch_order, phase_key
from zephon_state.stream import SourceStream

E = 99  # EOS in the hand-made documents
X = -100  # IGNORE


class _Docs:
    """Stands in for an accumulator: hands out fixed documents in order."""

    def __init__(self, *docs):
        self._docs = iter([TokenizedDocument(np.asarray(d, np.int32), 0, i) for i, d in enumerate(docs)])

    def next_document(self):
        return next(self._docs)


def test_wrap_cuts_every_max_length_tokens_and_labels_the_next_token_of_the_same_document():
    stream = SourceStream(0, _Docs([10, 11, 12, E], [20, 21, E], [30, E], [40, E]), SourceState(), 0)
    pieces = stream.take_exactly(8)
    assert stream.state() == SourceState(epoch=0, index=2, offset=1, tokens=8)
    rows = pack_wrap(pieces, 4)
    assert rows.input_ids.tolist() == [[10, 11, 12, E], [20, 21, E, 30]]
    assert rows.labels.tolist() == [[11, 12, E, X], [21, E, X, E]]  # 30 continues: its label is its EOS
    assert rows.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert rows.document_ids.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    assert rows.source_ids.tolist() == [[0] * 4, [0] * 4]


def test_best_fit_bins_place_each_item_largest_first_in_the_fullest_bin_that_fits():
    assert best_fit_bins([5, 4, 3, 3, 2, 1], 8) == ([0, 1, 0, 1, 2, 1], [0, 0, 5, 4, 0, 7], 3)


def test_best_fit_keeps_short_documents_whole_and_cuts_long_ones_into_max_length_pieces():
    d = [50, 51, 52, 53, 54, 55, 56, 57, E]
    docs = ([10, 11, 12, E], [20, 21, E], [30, E], d, [60, E])
    quota = SourceStream(0, _Docs(*docs), SourceState(), 0)
    assert [len(p) for p in quota.take_pieces(12, 4)] == [4, 3, 2, 4]  # stops once the quota is met...
    assert quota.state() == SourceState(epoch=0, index=3, offset=4, tokens=13)  # ...at a piece boundary
    pieces = SourceStream(0, _Docs(*docs), SourceState(), 0).take_pieces(18, 4)
    assert [len(p) for p in pieces] == [4, 3, 2, 4, 4, 1]
    rows = pack_best_fit(pieces, 4, pad_id=E)
    assert rows.input_ids.tolist() == [[10, 11, 12, E], [50, 51, 52, 53], [54, 55, 56, 57], [20, 21, E, E], [30, E, E, E]]
    assert rows.labels.tolist() == [[11, 12, E, X], [51, 52, 53, 54], [55, 56, 57, E], [21, E, X, X], [E, X, X, X]]
    assert rows.document_ids.tolist() == [[0] * 4, [0] * 4, [0] * 4, [0, 0, 0, 1], [0, 0, -1, -1]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 0]]
    assert rows.source_ids[4].tolist() == [0, 0, -1, -1]


TEXTS = [f"Document {i}: " + "word " * (3 + 2 * i) for i in range(6)]


def _lane_rows(pipeline, n):
    with pipeline:
        return np.concatenate([b.input_ids for b in itertools.islice(pipeline, n)])


def test_wrap_without_shuffle_emits_the_documents_with_eos_in_each_epochs_order():
    rows = _lane_rows(Pipeline(InMemory(TEXTS)).tokenize().pack_flat(8, window=2).batch(2), 12)
    tok = load_tokenizer("gpt2")
    expected = []
    for epoch in range(3):
        order = epoch_order(0, phase_key("main"), 0, epoch, len(TEXTS))
        expected.extend(tok.encode([TEXTS[i] for i in order])[0].tolist())
    assert rows.ravel().tolist() == expected[: rows.size]
    assert epoch_order(0, phase_key("main"), 0, 0, 6).tolist() != epoch_order(0, phase_key("main"), 0, 1, 6).tolist()


def test_best_fit_rows_hold_whole_documents_and_padding_only_at_the_end():
    pipeline = Pipeline(InMemory(TEXTS)).tokenize().pack_flat(32, algorithm="best_fit", window=4).shuffle(4, seed=3).batch(4)
    tok = load_tokenizer("gpt2")
    flat, lengths = tok.encode(TEXTS)
    documents = {tuple(d) for d in np.split(flat, np.cumsum(lengths)[:-1]).__iter__()}
    with pipeline:
        for batch in itertools.islice(pipeline, 6):
            for ids, docs, labels in zip(batch.input_ids, batch.document_ids, batch.labels):
                for k in range(docs.max() + 1):
                    assert tuple(ids[docs == k]) in documents
                pad = docs == -1
                assert not pad.any() or pad[np.argmax(pad):].all()
                assert (labels[pad] == X).all()


def test_to_training_gives_int64_ids_labels_positions_and_int32_document_ids():
    with Pipeline(InMemory(TEXTS)).tokenize().pack_flat(16).batch(2) as pipeline:
        batch = next(pipeline)
    out = batch.to_training()
    assert sorted(out) == ["document_ids", "input_ids", "labels", "position_ids"]
    assert [out[k].dtype for k in ("input_ids", "labels", "position_ids", "document_ids")] == [torch.int64] * 3 + [torch.int32]
    assert all(v.shape == (2, 16) for v in out.values())
    assert out["input_ids"].tolist() == batch.input_ids.tolist()


def test_block_causal_mask_lets_a_token_see_only_earlier_tokens_of_its_own_document():
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1, -1]]))
    assert mask.shape == (1, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]
