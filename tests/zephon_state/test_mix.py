"""zephon_state mixing by tokens: exact quotas, realised shares on the real corpora, calibration,
epochs."""
import itertools
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from zephon_state import ConfigError, InMemory, Mix, Pipeline
from zephon_state.mix import allotment, exact_shares

CORPUS = Path(__file__).resolve().parents[2] / "src" / "flextrain" / "corpus"
PROSE, CODE = str(CORPUS / "kjv.jsonl.zst"), str(CORPUS / "python_stdlib.jsonl.zst")


def test_allotment_sums_to_n_stays_within_one_token_of_each_share_and_never_shrinks():
    for weights in ((0.7, 0.3), (1, 1, 1), (0.5, 0.25, 0.25), (0.01, 0.99)):
        shares = exact_shares(weights)
        previous = (0,) * len(shares)
        for n in range(0, 20_000, 97):
            got = allotment(n, shares)
            assert sum(got) == n
            assert all(abs(a - n * p) < 1 for a, p in zip(got, shares))
            assert all(a >= b for a, b in zip(got, previous))
            previous = got
    assert allotment(10, (Fraction(1, 3),) * 3) == (3, 3, 4)


def _mixed(shares, lanes, algorithm, global_batch, max_length=1024, window=8):
    mix = Mix({"prose": PROSE, "code": CODE}, {"prose": shares[0], "code": shares[1]})
    return (
        Pipeline(mix).tokenize(parallelism=2).pack_flat(max_length, algorithm=algorithm)
        .shuffle(window, seed=5).batch(global_batch // lanes, global_batch_size=global_batch).lanes(lanes)
    )


def _source_tokens(pipeline, min_tokens):
    counts = np.zeros(2, dtype=np.int64)
    with pipeline:
        for batch in pipeline:
            counts += [(batch.source_ids == 0).sum(), (batch.source_ids == 1).sum()]
            if counts.sum() >= min_tokens and batch.last_in_step:
                return counts, batch.step + 1


def test_wrap_mix_of_prose_and_code_meets_token_shares_exactly_at_window_ends_over_a_million_tokens():
    counts, steps = _source_tokens(_mixed((0.7, 0.3), lanes=8, algorithm="wrap", global_batch=64), 1_000_000)
    # one step = one 8-row window of 1024 tokens per lane, so every lane holds exactly its allotment
    lane_tokens = steps * 8 * 1024
    assert counts.tolist() == [8 * a for a in allotment(lane_tokens, exact_shares((0.7, 0.3)))]
    share = counts[0] / counts.sum()
    assert abs(share - 0.7) < 1e-5 and counts.sum() >= 1_000_000


def test_best_fit_mix_keeps_realised_token_shares_within_one_percent_over_a_million_tokens():
    counts, _ = _source_tokens(_mixed((0.4, 0.6), lanes=4, algorithm="best_fit", global_batch=32), 1_000_000)
    assert abs(counts[0] / counts.sum() - 0.4) < 0.01


def test_calibration_measures_prose_and_code_tokens_per_byte_about_1_8x_apart():
    with Pipeline(Mix({"prose": PROSE, "code": CODE}, {"prose": 1, "code": 1})).tokenize().pack_flat(64).batch(1) as p:
        tpb = p.calibration()
    assert tpb["prose"] == pytest.approx(0.26, abs=0.01)
    assert tpb["code"] == pytest.approx(0.45, abs=0.02)
    assert 1.6 < tpb["code"] / tpb["prose"] < 1.9


def test_a_source_that_runs_out_starts_its_next_epoch_and_the_cursor_records_it():
    texts = [f"short document number {i}" for i in range(5)]
    with Pipeline(InMemory(texts)).tokenize().pack_flat(8, window=1).batch(1) as pipeline:
        epochs = []
        for _ in itertools.islice(pipeline, 12):
            epochs.append(pipeline.state_dict()["lanes"]["0"]["sources"][0][0])
    assert epochs[0] == 0 and epochs[-1] >= 2 and epochs == sorted(epochs)


def test_mix_settings_are_checked_with_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"shares name \['code'\] but the sources are \['code', 'prose'\]"):
        Mix({"prose": PROSE, "code": CODE}, {"code": 1.0})
    with pytest.raises(ConfigError, match=r"share of 'code' is 0; shares must be positive"):
        Mix({"prose": PROSE, "code": CODE}, {"prose": 1.0, "code": 0})
    tiny = Pipeline(Mix({"a": InMemory(["x"] * 4), "b": InMemory(["y"] * 4)}, {"a": 1e-6, "b": 1}))
    with pytest.raises(ConfigError, match=r"source 'a' has share 1e-06 of a 64-token window, less than one token"):
        tiny.tokenize().pack_flat(8, window=8).batch(1).fingerprint()
    with pytest.raises(ConfigError, match=r"source 'a' has 4 documents but lanes=8"):
        Pipeline(InMemory(["x"] * 4, name="a")).tokenize().pack_flat(8).batch(8).lanes(8).fingerprint()
