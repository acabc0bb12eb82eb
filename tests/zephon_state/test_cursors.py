"""zephon_state state: plain-JSON lane cursors of consumed batches, resume at other data-parallel
sizes (mid-window, mid-step), the fingerprint and its checks, new data phases."""
import copy
import itertools
import json
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from zephon_state import FingerprintMismatch, Mix, Pipeline, StateError

CORPUS = Path(__file__).resolve().parents[2] / "src" / "flextrain" / "corpus"
PROSE, CODE = str(CORPUS / "kjv.jsonl.zst"), str(CORPUS / "python_stdlib.jsonl.zst")


def _pipeline(rank=0, size=1, *, algorithm="wrap", buffer_size=8, seed=42, shares=(0.6, 0.4), microbatch=2,
              global_batch=16, lanes=8, phase="main", parallelism=1):
    mix = Mix({"prose": PROSE, "code": CODE}, {"prose": shares[0], "code": shares[1]})
    return (
        Pipeline(mix).options(chunk_bytes=1 << 14, data_phase=phase)
        .tokenize(parallelism=parallelism).pack_flat(64, algorithm=algorithm).shuffle(buffer_size, seed=seed)
        .batch(microbatch, global_batch_size=global_batch).lanes(lanes).data_parallel(rank, size)
    )


def _steps(ranks, n):
    """The next ``n`` global batches (rank order) from pipelines standing at a step boundary."""
    out = []
    for _ in range(n):
        out.append(np.concatenate([b.input_ids for p in ranks for b in itertools.islice(p, p.topology.microbatches)]))
    return out


def _union(ranks):
    """What the checkpointer hands back: one state with every rank's lanes, via JSON."""
    states = [orjson.loads(orjson.dumps(p.state_dict())) for p in ranks]
    union = copy.deepcopy(states[0])
    for s in states[1:]:
        assert {k: v for k, v in s.items() if k != "lanes"} == {k: v for k, v in states[0].items() if k != "lanes"}
        union["lanes"].update(s["lanes"])
    return union


def test_state_dict_is_plain_json_with_one_small_cursor_per_hosted_lane_keyed_by_lane():
    sizes = {}
    for buffer_size in (8, 512):
        with _pipeline(1, 2, buffer_size=buffer_size) as p:
            list(itertools.islice(p, 3))
            state = p.state_dict()
        assert json.loads(json.dumps(state)) == state  # stdlib json: no numpy scalars anywhere
        assert sorted(state["lanes"]) == ["4", "5", "6", "7"]
        assert len(state["fingerprint"]) == 64 and state["format"] == "zephon_state/1"
        sizes[buffer_size] = {k: len(json.dumps(v)) for k, v in state["lanes"].items()}
        assert all(n < 200 for n in sizes[buffer_size].values())
    assert sizes[8].keys() == sizes[512].keys()
    assert [state["lanes"][str(k)]["sequences"] for k in range(4, 8)] == [2, 2, 2, 0]
    assert state["lanes"]["4"] == {"version": 2, "window": 0, "emitted": 2, "sequences": 2,
                                   "sources": [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]}


def _version_1(state):
    """The state as the cursor format before resume points wrote it: no 'version', four counts."""
    old = copy.deepcopy(state)
    for cursor in old["lanes"].values():
        del cursor["version"]
        cursor["sources"] = [s[:4] for s in cursor["sources"]]
    return old


def test_state_describes_the_batches_received_not_the_ones_prefetched():
    with _pipeline(0, 1, microbatch=2) as p:
        first = next(p)
        deadline = time.monotonic() + 20
        while not p._resources.producer._queue.full() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p._resources.producer._queue.full()  # two steps are prepared behind the caller
        lanes = p.state_dict()["lanes"]
    assert first.lane_ids.tolist() == [0, 0]
    assert [lanes[str(k)]["sequences"] for k in range(8)] == [2, 0, 0, 0, 0, 0, 0, 0]
    assert lanes["0"]["window"] == 0 and lanes["0"]["emitted"] == 2


@pytest.mark.parametrize("algorithm", ["wrap", "best_fit"])
def test_restore_at_other_data_parallel_sizes_mid_window_yields_the_next_50_global_batches(algorithm, monkeypatch):
    reference = [_pipeline(r, 2, algorithm=algorithm) for r in range(2)]
    want = _steps(reference, 73)[23:]
    for p in reference:
        p.close()
    saving = [_pipeline(r, 2, algorithm=algorithm) for r in range(2)]
    _steps(saving, 23)
    state = _union(saving)
    for p in saving:
        p.close()
    assert sorted(state["lanes"], key=int) == [str(k) for k in range(8)]
    assert any(c["emitted"] > 0 for c in state["lanes"].values())  # mid-window: 46 rows into 8-row windows
    for source in (0, 1):  # lanes resume inside documents of both sources (a part of 1,024+ characters)
        assert any(c["sources"][source][4] > 0 and c["sources"][source][2] > c["sources"][source][5] > 0
                   for c in state["lanes"].values()), source
    for size, saved, steps in ((1, state, 50), (4, state, 50), (2, _version_1(state), 20)):
        # at size 4 documents are cut into other parts than the saving run's: the same tokens
        monkeypatch.setattr("zephon_state.lane._MIN_PART_CHARS", 3000 if size == 4 else 1024)
        ranks = [_pipeline(r, size, algorithm=algorithm) for r in range(size)]
        for p in ranks:
            p.load_state_dict(saved)
        got = _steps(ranks, steps)
        for p in ranks:
            p.close()
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want[:steps]], f"size {size}"


def test_resume_mid_step_at_the_same_size_continues_with_the_next_microbatch():
    with _pipeline(0, 1) as p:
        batches = list(itertools.islice(p, 13))
    with _pipeline(0, 1) as p:
        list(itertools.islice(p, 11))
        state = p.state_dict()
    with _pipeline(0, 1, parallelism=2) as p:
        p.load_state_dict(state)
        a, b = next(p), next(p)
    assert (a.step, a.microbatch, b.microbatch) == (1, 3, 4)
    assert a.input_ids.tobytes() == batches[11].input_ids.tobytes()
    assert b.input_ids.tobytes() == batches[12].input_ids.tobytes()


def test_a_mid_step_state_resumes_at_another_size_unless_it_splits_a_microbatch():
    with _pipeline(0, 1) as p:
        step0 = _steps([p], 1)[0]  # rows 2k, 2k+1 come from lane k
    ranks = [_pipeline(r, 2) for r in range(2)]
    for p in ranks:
        next(p)  # each rank received one microbatch: lanes 0 and 4
    state = _union(ranks)
    for p in ranks:
        p.close()
    with _pipeline(0, 1) as p:
        p.load_state_dict(state)
        rest = list(itertools.islice(p, 6))
    assert [b.microbatch for b in rest] == [2, 3, 4, 5, 6, 7] and rest[-1].step == 0
    assert [int(b.lane_ids[0]) for b in rest] == [1, 2, 3, 5, 6, 7]
    for b in rest:
        lane = int(b.lane_ids[0])
        assert b.input_ids.tobytes() == step0[2 * lane : 2 * lane + 2].tobytes()
    with _pipeline(0, 1, microbatch=8) as p:
        with pytest.raises(StateError, match=r"taken 4 rows into step 0 .* microbatches of 8; save at a step boundary"):
            p.load_state_dict(state)


def test_fingerprint_mismatch_names_the_field_both_values_and_the_fix():
    with _pipeline(seed=42) as p:
        state = p.state_dict()
    with _pipeline(seed=7) as p:
        with pytest.raises(FingerprintMismatch) as err:
            p.load_state_dict(state)
    message = str(err.value)
    assert "seed: saved 42, now 7 (pass the saved seed to .shuffle(seed=...))" in message
    assert "new data phase" in message and "load_state_dict(state, new_phase=True)" in message


def test_batch_deciding_settings_change_the_fingerprint_and_performance_settings_do_not():
    def fp(**kw):
        with _pipeline(**kw) as p:
            return p.fingerprint()

    base = fp()
    deciding = [
        {"seed": 1}, {"algorithm": "best_fit"}, {"buffer_size": 16}, {"shares": (0.5, 0.5)},
        {"global_batch": 32}, {"lanes": 4}, {"phase": "anneal"},
    ]
    assert len({base, *(fp(**kw) for kw in deciding)}) == len(deciding) + 1
    with _pipeline().pack_flat(128) as p:
        assert p.fingerprint() != base
    with _pipeline().options(bad_records="raise") as p:
        assert p.fingerprint() != base
    swapped = Pipeline(Mix({"code": CODE, "prose": PROSE}, {"code": 0.4, "prose": 0.6}))
    with swapped.options(chunk_bytes=1 << 14).tokenize().pack_flat(64).shuffle(8, seed=42).batch(2, 16).lanes(8) as p:
        assert p.fingerprint() != base
    for kw in ({"parallelism": 2}, {"rank": 1, "size": 4}, {"microbatch": 4}):
        assert fp(**kw) == base
    with _pipeline().options(prefetch=5, readahead_windows=3.0, chunk_bytes=1 << 16) as p:
        assert p.fingerprint() == base


def test_a_state_saved_with_one_bundled_tokenizer_is_refused_with_the_other():
    """The fingerprint covers the tokenizer by its JSON's digest: GPT-2's cursors do not load
    into a pipeline reading the 4,096-token BPE of flextrain's ``blocks`` preset."""
    from zephon_state import InMemory

    def pipeline(tokenizer_id):
        texts = [f"document number {i} " * 3 for i in range(20)]
        return Pipeline(Mix({"m": InMemory(texts)}, {"m": 1.0})).tokenize(tokenizer_id).pack_flat(16).batch(2)

    with pipeline("gpt2") as p:
        state = p.state_dict()
    with pipeline("corpus-bpe-4096") as p:
        assert p.fingerprint() != state["fingerprint"]
        with pytest.raises(FingerprintMismatch, match=r"tokenizer\.sha256: saved '[0-9a-f.]+', now '91dfd2a9ea12540e"):
            p.load_state_dict(state)


def test_a_new_data_phase_starts_from_the_beginning_and_needs_a_new_phase_name():
    with _pipeline() as p:
        list(itertools.islice(p, 4))
        state = p.state_dict()
    with _pipeline(shares=(0.2, 0.8), phase="anneal") as p:
        with pytest.raises(FingerprintMismatch, match=r"shares\[0\]: saved 0.6, now 0.2"):
            p.load_state_dict(state)
        p.load_state_dict(state, new_phase=True)
        after = p.state_dict()
        assert after["phases"] == [{"data_phase": "main", "fingerprint": state["fingerprint"]}]
        assert all(c["sequences"] == 0 for c in after["lanes"].values())
        assert next(p).step == 0
    with _pipeline(shares=(0.2, 0.8)) as p:
        with pytest.raises(StateError, match=r"new_phase=True but the data phase is still 'main'"):
            p.load_state_dict(state, new_phase=True)


def test_load_state_dict_rejects_a_missing_lane_or_a_malformed_cursor():
    with _pipeline(0, 2) as p:
        state = p.state_dict()
    with _pipeline(0, 1) as p:
        with pytest.raises(StateError, match=r"no cursor for lane 4, which rank 0 of 1 hosts .*union of every rank's 'lanes'"):
            p.load_state_dict(state)
        broken = copy.deepcopy(state)
        broken["lanes"]["0"]["sources"][1] = [0, -1, 0, 0, 0, 0]
    with _pipeline(0, 2) as p:
        with pytest.raises(StateError, match=r"cursor of lane 0 is invalid: 'sources\[1\].index' must be an int in \[0, 2\*\*53\), got -1"):
            p.load_state_dict(broken)


def test_start_produces_in_the_background_and_a_later_load_starts_over_from_the_state():
    with _pipeline() as a, _pipeline() as b:
        _steps([a], 1)
        state = _union([a])
        after = _steps([a], 1)
        b.start()  # producing from the beginning ...
        b.load_state_dict(state)  # ... until the state says where to stand
        assert all(np.array_equal(x, y) for x, y in zip(_steps([b], 1), after))
