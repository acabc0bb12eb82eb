"""Read once, fan out (issue 29): the pure plan (:mod:`flexckpt.load.fanout`), then loads over
spawned gloo groups (HSDP, DDP, FSDP x TP with replicated norms) with fan-out forced,
bit-exact against the load without it, counting the bytes each rank read from the store
and received from peers; a chunk corrupted in transit, and a reader that fails."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexckpt.load.fanout import plan_fanout, water_fill


def _files(sizes: dict[str, list[int]]) -> tuple[dict, dict]:
    lengths = {f: np.array(s, dtype=np.int64) for f, s in sizes.items()}
    offsets = {f: np.concatenate(([0], np.cumsum(s)[:-1])).astype(np.int64) for f, s in lengths.items()}
    return offsets, lengths


def _check(plan, needs, offsets, lengths):
    """Every needed chunk read exactly once, by a rank that needs it, and received by
    every other rank that needs it; batches byte-adjacent runs; ``reads`` what each reads."""
    readers: dict[tuple[str, int], int] = {}
    got: dict[tuple[str, int], set[int]] = {}
    for b in plan.batches:
        assert b.receivers and b.reader not in b.receivers
        assert b.offset == offsets[b.file][b.first]
        assert b.length == int(lengths[b.file][b.first : b.stop].sum())
        for c in range(b.first, b.stop):
            assert (b.file, c) not in readers
            readers[(b.file, c)] = b.reader
            got[(b.file, c)] = {b.reader, *b.receivers}
    reads = [0] * len(needs)
    needed = 0
    for f in offsets:
        who: dict[int, set[int]] = {}
        for r, n in enumerate(needs):
            for c in n.get(f, ()):
                who.setdefault(int(c), set()).add(r)
        for c, rs in who.items():
            needed += int(lengths[f][c])
            if len(rs) == 1:
                assert (f, c) not in readers
                reads[next(iter(rs))] += int(lengths[f][c])
            else:
                assert got[(f, c)] == rs
                reads[readers[(f, c)]] += int(lengths[f][c])
        for r, n in enumerate(needs):
            labels = plan.labels(r, {f: np.asarray(n.get(f, []), dtype=np.int64)})[f]
            for c, lab in zip(n.get(f, []), labels):
                assert (lab == -1) == ((f, int(c)) not in readers)
    assert plan.reads == reads and plan.needed == needed
    return reads


def test_hsdp_replicas_split_each_shard_in_two_contiguous_halves():
    offsets, lengths = _files({"a": [100] * 8, "b": [100] * 8})
    needs = [{"a": np.arange(8)}, {"b": np.arange(8)}, {"a": np.arange(8)}, {"b": np.arange(8)}]
    plan = plan_fanout(needs, offsets, lengths, max_batch=400)
    got = [(b.file, b.first, b.stop, b.reader, b.receivers) for b in plan.batches]
    assert got == [("a", 0, 4, 0, (2,)), ("a", 4, 8, 2, (0,)), ("b", 0, 4, 1, (3,)), ("b", 4, 8, 3, (1,))]
    assert plan.reads == [400] * 4 and plan.needed == 1600
    assert plan.sends(2) == [1] and plan.receives(0) == {2: [1]}
    _check(plan, needs, offsets, lengths)


def test_batches_are_cut_at_max_batch_and_at_gaps():
    offsets, lengths = _files({"a": [100] * 6})
    offsets["a"][4:] += 10  # a gap before chunk 4: not one ranged read
    needs = [{"a": np.arange(6)}] * 2
    plan = plan_fanout(needs, offsets, lengths, max_batch=250)
    assert [(b.first, b.stop) for b in plan.batches] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    _check(plan, needs, offsets, lengths)


def test_chunks_one_rank_needs_are_its_own_and_shared_ones_fill_up_to_a_level():
    offsets, lengths = _files({"a": [100] * 10})
    # rank 0 alone needs chunks 0-5 (600 bytes); ranks 0 and 1 share 6-9 (400): rank 1 reads them all
    needs = [{"a": np.arange(10)}, {"a": np.arange(6, 10)}]
    plan = plan_fanout(needs, offsets, lengths, max_batch=1 << 20)
    assert [(b.first, b.stop, b.reader, b.receivers) for b in plan.batches] == [(6, 10, 1, (0,))]
    assert plan.reads == [600, 400]
    _check(plan, needs, offsets, lengths)


def test_water_fill_brings_the_least_loaded_to_one_level():
    assert water_fill([0, 0], 10) == [5.0, 5.0]
    assert water_fill([5, 0], 3) == [0.0, 3.0]
    assert water_fill([6, 0, 2], 10) == [0.0, 6.0, 4.0]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data())
def test_every_needed_chunk_is_read_once_by_a_rank_that_needs_it(data):
    world = data.draw(st.integers(1, 6))
    names = "ab"[: data.draw(st.integers(1, 2))]
    files = {f: data.draw(st.lists(st.integers(1, 50), min_size=1, max_size=12)) for f in names}
    offsets, lengths = _files(files)
    needs = []
    for _ in range(world):
        needs.append({f: np.array(sorted(data.draw(st.sets(st.integers(0, len(s) - 1)))), dtype=np.int64)
                      for f, s in files.items()})
    plan = plan_fanout(needs, offsets, lengths, max_batch=data.draw(st.integers(1, 200)))
    reads = _check(plan, needs, offsets, lengths)
    assert sum(reads) == plan.needed


def test_replicated_state_reads_within_a_chunk_of_total_over_world():
    offsets, lengths = _files({"a": [7, 100, 100, 30, 100, 100, 100, 64, 100, 3]})
    for world in (2, 3, 4):
        needs = [{"a": np.arange(10)}] * world
        plan = plan_fanout(needs, offsets, lengths, max_batch=1 << 20)
        _check(plan, needs, offsets, lengths)
        assert max(plan.reads) <= plan.needed / world + 100


def test_the_rule_says_when_a_load_fans_out():
    from flexckpt.load.fanout import wanted

    assert not wanted("auto", 1, False, "s3://b/p", "gloo")  # one rank: nothing to share
    assert not wanted(True, 1, True, "/ckpt", "gloo")
    assert wanted("auto", 4, False, "s3://b/p", "gloo")
    assert not wanted("auto", 4, True, "/ckpt", "gloo")  # a local disk: each rank reads its own
    assert not wanted("auto", 4, False, "memory://x", "gloo")
    assert wanted(True, 4, True, "/ckpt", "gloo")
    assert not wanted(False, 4, False, "s3://b/p", "gloo")
    assert not wanted("auto", 4, False, "s3://b/p", "nccl")  # the exchange is CPU-only
    assert wanted("auto", 4, False, "s3://b/p", "cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match="fanout=True needs the load's process group on gloo"):
        wanted(True, 4, False, "s3://b/p", "nccl")


def test_a_fanout_that_is_not_auto_true_or_false_is_refused(tmp_path):
    from flexckpt import Checkpointer

    with pytest.raises(ValueError, match=r"fanout must be 'auto', True or False, got 'yes'"):
        Checkpointer(str(tmp_path), fanout="yes")
    with pytest.raises(ValueError, match="got 1"):
        Checkpointer(str(tmp_path), fanout=1)


# -- loads over spawned gloo groups -----------------------------------------------------------
KINDS = ("hsdp", "ddp", "fsdp_tp", "cols", "stages")
SAVED_AS = {"cols": "hsdp"}  # "cols": the HSDP save loaded cut by columns: each chunk split between targets


def _state(kind: str, rank: int, world: int, zero: bool) -> dict:
    """HSDP (replicate 2 x shard 2), DDP (plain tensors: replicated), FSDP x TP (weights
    (S0, S1) on a (fsdp 2, tp 2) mesh, norms (S0, R): replicated over tp) or "cols" (the
    matrices (S1, R), the vectors (S0, R): replicas are consecutive ranks), or "stages" (two
    pipeline stages of two ranks, each holding its stage's layers only: a weight (S0) and
    a norm (R) on the stage's own mesh), at world 4."""
    import torch

    from flexshard import MeshLayout, ShardedTensor

    stage = rank // 2
    g = torch.Generator().manual_seed(29 + (stage if kind == "stages" else 0))
    shapes = {"w1": (40, 24), "w2": (24, 40), "norm": (40,), "bias": (24,)}
    if kind == "stages":
        shapes = {f"layers.{stage}.w": (40, 24), f"layers.{stage}.norm": (24,)}
    full = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    layouts = {
        "stages": {k: MeshLayout((2,), ("S0" if len(s) == 2 else "R",), offset=2 * stage) for k, s in shapes.items()},
        "hsdp": {k: MeshLayout((2, 2), ("R", "S0")) for k in shapes},
        "cols": {k: MeshLayout((2, 2), ("S1" if len(s) == 2 else "S0", "R")) for k, s in shapes.items()},
        "fsdp_tp": {"w1": MeshLayout((2, 2), ("S0", "S1")), "w2": MeshLayout((2, 2), ("S0", "S1")),
                    "norm": MeshLayout((2, 2), ("S0", "R")), "bias": MeshLayout((2, 2), ("S0", "R"))},
    }.get(kind)
    out = {}
    for k, t in full.items():
        if layouts is None:
            out[k] = torch.zeros_like(t) if zero else t
            continue
        box = layouts[k].box(t.shape, world, rank)
        piece = t[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))].contiguous()
        out[k] = ShardedTensor(torch.zeros_like(piece) if zero else piece, layouts[k], t.shape, rank, world)
    return out


def _local(v):
    return getattr(v, "local", v)


def _fanout_worker(rank: int, world: int, root: str) -> dict:
    import os
    import time

    import torch

    import flexckpt.load.exchange as ex
    from flexckpt import Checkpointer
    from flexckpt.catalog import read_manifest

    out: dict = {}

    def load(url, fan, kind="hsdp"):
        ck = Checkpointer(url, fanout=fan)
        state = _state(kind, rank, world, zero=True)
        ck.load(state, step=1)
        want = _state(kind, rank, world, zero=False)
        s = ck.last_load_stats
        ck.close()
        exact = all(torch.equal(_local(state[k]), _local(want[k])) for k in want)
        return {"exact": exact, "store": s.bytes_from_store - s.metadata_bytes, "peers": s.bytes_from_peers,
                "reread": s.peer_chunks_reread, "manifest": (s.manifest_bytes, s.manifest_from_peer)}

    for kind in KINDS:
        url = os.path.join(root, kind)
        ck = Checkpointer(url, chunk_bytes=512, compression="zstd" if kind == "ddp" else None)
        ck.save(1, _state(SAVED_AS.get(kind, kind), rank, world, zero=False)).result(60)
        ck.close()
        for fan in (False, True):
            out[(kind, fan)] = load(url, fan, kind)
        m = read_manifest(Checkpointer(url, read_only=True).storage, 1)
        out[(kind, "needed")] = sum(int(m.files[f].lengths.sum()) for f in m.files)
        out[(kind, "chunk")] = max(int(m.files[f].lengths.max()) for f in m.files)
    # the manifest read once too: a rank other than 0 that read it from the store would fail here
    import flexckpt.load.committed as lc

    def refused(*args):
        raise AssertionError(f"rank {rank} read the manifest from the store")

    def broken(*args):
        raise OSError("manifest read failure injected")

    real = lc.read_manifest_bytes
    lc.read_manifest_bytes = real if rank == 0 else refused
    out["manifest_once"] = load(os.path.join(root, "hsdp"), True)
    lc.read_manifest_bytes = broken if rank == 0 else refused  # rank 0 fails to read it: every rank fails, naming it
    try:
        load(os.path.join(root, "hsdp"), True)
        out["manifest_fail"] = None
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["manifest_fail"] = (type(exc).__name__, str(exc))
    lc.read_manifest_bytes = real
    # a byte flipped in the first batch on its way: its receiver reads that chunk from the store
    ex._faults["corrupt"] = lambda r, k: k == 0
    out["corrupt"] = load(os.path.join(root, "hsdp"), True)
    ex._faults.clear()
    # a rank that fails before the fan-out's gather (its state has a key the checkpoint lacks): no rank waits
    state = _state("hsdp", rank, world, zero=True)
    if rank == 3:
        state["extra"] = torch.zeros(3)
    try:
        Checkpointer(os.path.join(root, "hsdp"), fanout=True).load(state, step=1)
        out["early"] = None
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["early"] = (type(exc).__name__, str(exc))
    # a reader that fails: every rank fails, naming it, well within the peer timeout
    ex._faults["fail"] = lambda r, k: r == 2
    ex.PEER_TIMEOUT = 20.0
    t0 = time.monotonic()
    try:
        load(os.path.join(root, "hsdp"), True)
        out["fail"] = None
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["fail"] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    return out


def test_fanned_out_loads_read_each_stored_byte_once_and_are_exact(tmp_path):
    from flexshard.spawn import run_workers

    results = run_workers(_fanout_worker, 4, str(tmp_path), timeout=180)
    replicas = {"hsdp": 2, "ddp": 4, "fsdp_tp": None, "cols": None, "stages": None}
    for kind in KINDS:
        needed = results[0][(kind, "needed")]
        off = [r[(kind, False)] for r in results]
        on = [r[(kind, True)] for r in results]
        assert all(x["exact"] for x in off + on), kind
        # read once: the stored bytes of every chunk, exactly (whole chunks: every chunk is needed)
        assert sum(x["store"] for x in on) == needed, kind
        assert sum(x["peers"] for x in off) == 0
        # today: each replica reads it (FSDP x TP: the norms twice, the weights once; cols:
        # the vectors twice, the matrices' chunks four times, each cut between the columns)
        if replicas[kind]:
            assert sum(x["store"] for x in off) == replicas[kind] * needed, kind
        elif kind in ("fsdp_tp", "stages"):
            assert needed < sum(x["store"] for x in off) < 2 * needed
        else:
            assert 2 * needed < sum(x["store"] for x in off) < 4 * needed
        # what one rank did not read it received; no rank reads much more than total / W
        assert [x["store"] + x["peers"] for x in on] == [x["store"] for x in off], kind
        assert max(x["store"] for x in on) <= needed / 4 + 4 * results[0][(kind, "chunk")], kind
        # the manifest: every rank reads it without fan-out; with it, rank 0 reads it and the others receive it
        size = off[0]["manifest"][0]
        assert size > 0 and [x["manifest"] for x in off] == [(size, False)] * 4, kind
        assert [x["manifest"] for x in on] == [(size, False)] + [(size, True)] * 3, kind
    assert all(r["manifest_once"]["exact"] for r in results)
    fails = [r["manifest_fail"] for r in results]
    assert fails[0] == ("OSError", "manifest read failure injected"), fails
    assert all(f is not None and f[0] == "LoadError" and "rank 0" in f[1] and "manifest of step 1" in f[1]
               for f in fails[1:]), fails
    corrupt = [r["corrupt"] for r in results]
    assert all(x["exact"] for x in corrupt)
    assert sum(x["reread"] for x in corrupt) == 1  # the one chunk whose byte flipped
    assert sum(x["store"] for x in corrupt) > results[0][("hsdp", "needed")]
    fails = [r["fail"] for r in results]
    assert all(f is not None and "rank 2" in f[1] and f[2] < 20.0 for f in fails), fails
    assert "injected" in fails[2][1]
    early = [r["early"] for r in results]
    assert early[3][0] == "StructureMismatch" and all(e is not None and "rank 3" in e[1] for e in early[:3]), early


def _s3_worker(rank: int, world: int, url: str, opts: dict) -> dict:
    import torch

    from flexckpt import Checkpointer
    from flexckpt.catalog import read_manifest

    state = _state("ddp", rank, world, zero=False)
    ck = Checkpointer(url, storage_options=opts, chunk_bytes=512)  # fanout="auto": a remote store, gloo
    ck.save(1, state).result(60)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    ck.load(got, step=1)
    s = ck.last_load_stats
    m = read_manifest(ck.storage, 1)
    ck.close()
    return {"exact": all(torch.equal(got[k], state[k]) for k in state), "store": s.bytes_from_store - s.metadata_bytes,
            "peers": s.bytes_from_peers, "needed": sum(int(m.files[f].lengths.sum()) for f in m.files),
            "manifest_from_peer": s.manifest_from_peer}


def test_a_load_from_s3_fans_out_by_default(s3_options):
    from flexshard.spawn import run_workers

    opts, bucket = s3_options
    results = run_workers(_s3_worker, 2, f"s3://{bucket}/fan", opts, timeout=120)
    assert all(r["exact"] for r in results)
    assert sum(r["store"] for r in results) == results[0]["needed"]  # read once, not twice
    assert sum(r["peers"] for r in results) == results[0]["needed"]
    assert [r["manifest_from_peer"] for r in results] == [False, True]  # one GET of the manifest, not one a rank


def _dying_reader(rank: int, world: int, store_path: str, root: str, results) -> None:
    """Saves the HSDP state, then loads it with fan-out while rank 2 dies at its first read."""
    import os
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    import flexckpt.load.exchange as ex
    from flexckpt import Checkpointer

    url = os.path.join(root, "hsdp")
    ck = Checkpointer(url, chunk_bytes=512)
    ck.save(1, _state("hsdp", rank, world, zero=False)).result(60)
    ck.close()
    ex.PEER_TIMEOUT = 15.0
    ex._faults["fail"] = lambda r, k: r == 2 and os._exit(3)
    t0 = time.monotonic()
    try:
        Checkpointer(url, fanout=True).load(_state("hsdp", rank, world, zero=True), step=1)
        results.put((rank, None, "", time.monotonic() - t0))
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        results.put((rank, type(exc).__name__, str(exc)[:400], time.monotonic() - t0))


def test_a_reader_that_dies_fails_every_rank_and_its_receiver_names_it(tmp_path):
    """Rank 2 (a reader for rank 0) exits mid-load: rank 0 fails naming it; ranks 1 and 3,
    which share nothing with it, fail in the load's agreement with the group's error; all
    well within the peer timeout (15 s here)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_dying_reader, args=(r, 4, str(tmp_path / "store"), str(tmp_path), results), daemon=True)
             for r in range(4)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 3:
            rank, kind, message, seconds = results.get(timeout=120)
            got[rank] = (kind, message, seconds)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(4)) - {2} - set(got))} neither loaded nor failed within 120 s")
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    assert procs[2].exitcode not in (0, None)
    assert sorted(got) == [0, 1, 3]
    assert got[0][0] == "PeerFailure" and "rank 2" in got[0][1], got[0]
    assert all(kind is not None and seconds < 15.0 for kind, _, seconds in got.values()), got


# -- the device wire (Checkpointer(fanout="nccl")) on the CPU: the same exchange over a spawned
# gloo group, each message copied to and from a "device" (the CPU) around every send and
# receive, as to and from the GPU over NCCL (bench/gpu_check.py's "fanout" part: on GPUs) -----
def test_nccl_fanout_needs_an_nccl_group():
    from flexckpt.load.fanout import wanted

    assert wanted("nccl", 2, True, "/ckpt", "nccl") is True  # a local store too: asked for
    assert wanted("nccl", 1, True, "/ckpt", "nccl") is False
    with pytest.raises(ValueError, match="fanout='nccl' needs the load's process group on NCCL"):
        wanted("nccl", 2, False, "s3://b/c", "gloo")


def _wire_worker(rank: int, world: int, root: str) -> dict:
    import threading

    import torch

    import flexckpt.load.exchange as ex
    from flexckpt import Checkpointer

    log: list[tuple[str, str, int, bool]] = []  # (thread, step, bytes, a copy)

    class Logged(ex.DeviceWire):
        def out(self, t):
            got = super().out(t)
            log.append((threading.current_thread().name, "out", got.nbytes, got.data_ptr() != t.data_ptr()))
            return got

        def into(self, t):
            got = super().into(t)
            log.append((threading.current_thread().name, "into", got.nbytes, got.data_ptr() != t.data_ptr()))
            return got

        def landed(self, got, t):
            super().landed(got, t)
            log.append((threading.current_thread().name, "landed", got.nbytes, bool(torch.equal(got, t))))

    ck = Checkpointer(root, chunk_bytes=512)
    ck.save(1, _state("ddp", rank, world, zero=False)).result(60)
    ck.close()
    ex.HostWire = lambda: Logged("cpu")  # fanout_for's wire: the device wire, on the CPU
    ck = Checkpointer(root, fanout=True)
    state = _state("ddp", rank, world, zero=True)
    ck.load(state, step=1)
    s = ck.last_load_stats
    want = _state("ddp", rank, world, zero=False)
    return {"exact": all(torch.equal(_local(state[k]), _local(want[k])) for k in want), "log": log,
            "store": s.bytes_from_store - s.metadata_bytes, "peers": s.bytes_from_peers,
            "reread": s.peer_chunks_reread}


def test_the_device_wire_copies_every_message_out_and_back_around_the_same_exchange(tmp_path):
    from flexshard.spawn import run_workers

    results = run_workers(_wire_worker, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r["exact"] and r["reread"] == 0  # a chunk not copied back would fail its check and be re-read
        assert r["peers"] > 0 and r["store"] > 0
        assert all(copy for *_, copy in r["log"])  # each step a real copy (out, into) / equal bytes (landed)
        recv = [x for x in r["log"] if "-recv-" in x[0]]
        # a receiver: each message received into a wire buffer, then landed on the host, in that order
        assert [x[1] for x in recv] == ["into", "landed"] * (len(recv) // 2) and recv
        assert sum(n for _, step, n, _ in recv[3::4]) == r["peers"]  # header, data: the data's bytes
        sends = [x for x in r["log"] if "-send-" in x[0]]
        assert sends and all(x[1] == "out" for x in sends)
    # what each rank sent is what the other received (headers and data)
    assert [sum(n for t, _, n, _ in r["log"] if "-send-" in t) for r in results] == \
           [sum(n for t, s, n, _ in r["log"] if "-recv-" in t and s == "landed") for r in results[::-1]]
