"""The fast tier (flexckpt.tier): node-local checkpoints with a copy on a peer node,
restored after a node loss at another world size without reading the persistent store.

Nodes are emulated on one machine: each node is a folder and a set of ranks
(``FLEXCKPT_NODE`` names a rank's node). A "kill" leaves the ranks' files exactly as a
SIGKILL would (no close, no clean-up at exit); torchrun then restarts every worker. Three
launches: the killed runs (4 ranks), every 2-rank restart (``restarted_at_two``), and the
4 -> 3 rank restart."""
import atexit
import inspect
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from flexckpt import Checkpointer
from flexckpt.storage import RangeReader, Storage
from flexckpt.tier import LocalTier
from flexckpt.tier.inventory import REMOVED, Held, choose, remove_paths, scan, set_aside, set_aside_before
from flexckpt.tier.placement import nodes_of, partners, sources
from flexshard import Shard, ShardedTensor
from flexshard.spawn import run_workers
from scenario_group import run_scenarios
from tier_states import LANES, SHAPES, global_tensor, make_state

TIMEOUT = 240  # whole launches; a loaded 2-core machine starts 4 ranks in ~30 s


def tier(root: str, node: str, replicas: int = 1) -> LocalTier:
    return LocalTier(dir=os.path.join(root, node), every=1, replicas=replicas, keep_last=2, timeout=90,
                     lineage="tier-test", stale_after=0)


# -- pure rules ---------------------------------------------------------------------------------
def test_partners_live_on_other_nodes_and_sources_invert_them():
    nodes = nodes_of(["a", "a", "b", "b", "c", "c"])
    assert nodes == [[0, 1], [2, 3], [4, 5]]
    assert [partners(r, nodes, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert partners(0, nodes, 2) == [2, 4]
    assert partners(0, nodes, 5) == [2, 4]  # capped at the other nodes
    assert [sources(r, nodes, 1) for r in range(6)] == [[4], [5], [0], [1], [2], [3]]
    assert partners(0, nodes_of(["a", "a"]), 1) == []


def _held(step, rank, world=2, lineage="L", fp="F"):
    return Held(step, "run.0000abcd.1", rank, world, {"lineage": lineage, "fingerprint": fp})


def test_choose_takes_newest_complete_step_never_mixing_steps():
    inv = [[_held(7, 0), _held(8, 0), _held(7, 1)], [_held(7, 1)]]  # step 8 lacks rank 1
    d = choose(inv, "L", "F", [5])
    assert (d.source, d.step, d.holders) == ("tier", 7, {0: [0], 1: [0, 1]})
    assert "tier step 8 lacks the files of saved rank(s) [1]" in d.reason
    d = choose([[_held(8, 0)], []], "L", "F", [5])
    assert (d.source, d.step) == ("persistent", 5) and "loading persistent step 5 whole" in d.reason
    # a step partly held, and the same step in the store: the store serves only the missing ranks
    d = choose([[_held(8, 0), _held(7, 0)], [_held(7, 1)]], "L", "F", [5, 8])
    assert (d.source, d.step, d.holders, d.missing) == ("tier", 8, {0: [0]}, [1])
    assert "lacks saved rank(s) [1] on every surviving node; the persistent store holds step 8" in d.reason
    assert choose([[_held(8, 0)], []], "L", "F", [7, 8, 9]).source == "persistent"  # the store's newer step wins
    assert choose([[_held(7, 0), _held(7, 1)]], "L", "F", [9]).source == "persistent"
    d = choose([[_held(7, 0, lineage="other"), _held(7, 1, lineage="other")]], "L", "F", [])
    assert d.source == "none" and "another lineage" in d.reason
    assert choose([[_held(7, 0, fp="G"), _held(7, 1, fp="G")]], "L", "F", []).source == "none"


# -- multi-process runs -------------------------------------------------------------------------
_CALLS: list = []  # one list a process: the wrappers are installed once and outlive a scenario


def _count_calls() -> list:
    """Every torch.distributed function and ProcessGroup method call from now on: (thread, name, group)."""
    calls = _CALLS
    calls.clear()
    depth = threading.local()  # only the outermost call: torch.distributed's functions call each other

    def record(name, group, fn, a, k):
        if getattr(depth, "n", 0) == 0:
            calls.append((threading.current_thread().name, name, group))
        depth.n = getattr(depth, "n", 0) + 1
        try:
            return fn(*a, **k)
        finally:
            depth.n -= 1

    for module in (dist, dist.distributed_c10d):
        for name, fn in list(vars(module).items()):
            if not inspect.isfunction(fn) or not fn.__module__.startswith("torch.distributed") or hasattr(fn, "_c"):
                continue

            def wrapper(*a, __fn=fn, __name=name, **k):
                return record(__name, k.get("group"), __fn, a, k)

            wrapper._c = True
            setattr(module, name, wrapper)
    PG = torch._C._distributed_c10d.ProcessGroup
    for name in ("allreduce", "allgather", "broadcast", "barrier", "send", "recv", "reduce", "gather", "scatter",
                 "alltoall", "reduce_scatter", "allgather_coalesced", "all_gather_single"):
        orig = getattr(PG, name)
        if hasattr(orig, "_c"):
            continue

        def method(self, *a, __orig=orig, __name=name, **k):
            calls.append((threading.current_thread().name, "PG." + __name, self))  # every one, nested too
            return __orig(self, *a, **k)

        method._c = True
        setattr(PG, name, method)
    return calls


def _train(rank, world, url, root, nodes, steps, every_persistent):
    """Fast save every step, persistent every few; at the last step, wait until this node
    holds its partners' copies, then die as a kill would (no close, no clean-up)."""
    os.environ["FLEXCKPT_NODE"] = nodes[rank]
    # small chunks: a resharding load wants part of a saved rank's file, not all of it
    ck = Checkpointer(url, local=tier(root, nodes[rank]), chunk_bytes=1024)
    calls = _count_calls()
    fast_calls = []
    for step in range(1, steps + 1):
        state = make_state(rank, world, step)
        if step % every_persistent == 0:
            calls.clear()
            ck.save(step, state).result(60)
        h = ck.save_local(step, state)
        assert h is not None
        h.wait_staged()
        trainer = [c for c in calls if c[0] == threading.current_thread().name]
        h.result(60)
        fast_calls += [c for c in calls if c[0] != threading.current_thread().name]
        assert trainer == [], f"training thread made {trainer}"
        calls.clear()
    expected = {rank} | set(ck.tier.sources)
    deadline = time.monotonic() + 90
    while not {h.rank for h in scan(ck.tier.storage) if h.step == steps} >= expected:
        assert time.monotonic() < deadline, "copies did not arrive"
        time.sleep(0.02)
    other = [(t, n) for t, n, g in fast_calls if not (n in ("isend", "irecv") and g is ck.tier.group
                                                        or n in ("PG.send", "PG.recv") and g is ck.tier.group)]
    kinds = sorted({n for _t, n, _g in fast_calls})
    groups_ok = all(g is ck.tier.group for _t, n, g in fast_calls if n.startswith("PG."))
    dist.barrier()
    atexit.unregister(ck._atexit)  # killed: no close, no clean-up
    return {"other": other, "kinds": kinds, "groups_ok": groups_ok, "skipped": ck.tier.skipped}


def _restart(rank, world, url, root, nodes, oracle_step=None):
    """Restart on ``nodes`` and load. ``oracle_step``: then also load that persistent step
    (same shapes, so the same plan) at this world size, counting the bytes the ordinary
    load reads of each saved rank's data file."""
    os.environ["FLEXCKPT_NODE"] = nodes[rank]
    read = [0]
    by_file: dict = {}  # data bytes read from the store, by saved rank's file name
    orig_bytes, orig_into, orig_scatter = Storage.read_bytes, RangeReader.read_into, RangeReader.read_scatter

    def count(reader, n):
        if reader.storage.url == url:
            read[0] += n
            name = os.path.basename(reader.path)
            by_file[name] = by_file.get(name, 0) + n

    def read_bytes(self, rel, limit=None):
        out = orig_bytes(self, rel, limit)
        read[0] += len(out) if self.url == url else 0
        return out

    def read_into(self, offset, out):
        count(self, memoryview(out).nbytes)
        return orig_into(self, offset, out)

    def read_scatter(self, offset, outs):
        count(self, sum(memoryview(o).nbytes for o in outs))
        return orig_scatter(self, offset, outs)

    Storage.read_bytes, RangeReader.read_into, RangeReader.read_scatter = read_bytes, read_into, read_scatter
    ck = Checkpointer(url, local=tier(root, nodes[rank]))
    state = make_state(rank, world, 0, zero=True)
    read[0] = 0  # from here: the load (rank 0's start-up housekeeping reads the store's markers)
    by_file.clear()
    t0 = time.perf_counter()
    step = ck.load(state)
    seconds = time.perf_counter() - t0
    want = make_state(rank, world, step)
    exact = all(torch.equal(state[n].local, want[n].local) for n in SHAPES)
    rec = ck.tier.last_recovery
    from_peers = ck.last_load_stats.bytes_from_peers if rec.source == "tier" else None
    manifest = (ck.last_load_stats.manifest_bytes, ck.last_load_stats.manifest_from_peer)
    store_bytes, store_files, oracle = read[0], dict(by_file), None
    if oracle_step is not None:
        by_file.clear()
        ck.load(make_state(rank, world, 0, zero=True), step=oracle_step)
        oracle = dict(by_file)
    t1 = time.perf_counter()
    ck.close()
    # unpatched for the next scenario of the launch (else each wraps the last one's counters)
    Storage.read_bytes, RangeReader.read_into, RangeReader.read_scatter = orig_bytes, orig_into, orig_scatter
    print(f"rank {rank}: load {seconds:.2f} s, close {time.perf_counter() - t1:.2f} s", flush=True)
    return {"step": step, "exact": exact, "persistent_bytes": store_bytes, "lanes": state["data"].values,
            "want_lanes": want["data"].values, "meta": state["meta"], "source": rec.source, "reason": rec.reason,
            "parts": rec.parts, "seconds": seconds, "tier_left": os.path.exists(ck.tier.root),
            "fetched": rec.fetched, "sent": rec.sent_bytes, "received": rec.fetched_bytes, "store_files": store_files,
            "oracle": oracle, "from_peers": from_peers, "manifest": manifest}


def _copy_nodes(root: str, dst: str, lose: list[str], drop_steps: tuple[int, ...] = ()) -> str:
    """The node folders of ``root`` but those in ``lose``, with ``drop_steps`` gone from the rest (as if pruned)."""
    shutil.copytree(root, dst)
    for node in lose:
        shutil.rmtree(os.path.join(dst, node))
    for node in os.listdir(dst):
        for tier_dir in os.listdir(os.path.join(dst, node)):
            for step in drop_steps:
                shutil.rmtree(os.path.join(dst, node, tier_dir, f"step-{step:012d}"))
    return dst


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """One launch of 4 ranks, three runs killed after their last step, each with its own store
    and node folders (``where(run)`` gives them):

    - "four nodes": 4 nodes x 1 rank, fast tier every step (each node keeps steps 8 and 9),
      persistent every 4 (steps 4 and 8), killed at step 9;
    - "two nodes": nodes A, A, B, B, persistent every 2, killed at step 3;
    - "stages": 2 pipeline stages x 2 ranks on nodes A (stage 0) and B (stage 1), killed at step 3."""
    base = tmp_path_factory.mktemp("tier")

    def where(run: str) -> tuple[str, str]:
        return str(base / run / "store"), str(base / run / "nodes")

    out = run_scenarios(4, [
        ("four nodes", _train, (*where("four nodes"), ["n0", "n1", "n2", "n3"], 9, 4)),
        ("two nodes", _train, (*where("two nodes"), ["A", "A", "B", "B"], 3, 2)),
        ("stages", _train_pp, (*where("stages"), ["A", "A", "B", "B"], 3)),
    ], timeout=TIMEOUT)
    return where, out


@pytest.fixture(scope="module")
def restarted_at_two(killed, tmp_path_factory):
    """One launch of 2 ranks restarting every 2-rank case in turn, each from its own copy of a
    killed run's node folders (the tests below say what each case lost)."""
    where, _ = killed
    tmp = tmp_path_factory.mktemp("restart2")
    url4, root4 = where("four nodes")
    url2, root2 = where("two nodes")
    url_pp, root_pp = where("stages")
    return run_scenarios(2, [
        ("n2 lost, on n3 n1", _restart, (url4, _copy_nodes(root4, str(tmp / "a"), ["n2"]), ["n3", "n1"], 8)),
        ("rank 0's copies lost", _restart, (url4, _copy_nodes(root4, str(tmp / "b"), ["n0", "n1"]), ["n2", "n3"], 8)),
        ("and step 8 pruned", _restart, (url4, _copy_nodes(root4, str(tmp / "c"), ["n0", "n1"], (8,)), ["n2", "n3"])),
        ("B lost, on A", _restart, (url2, _copy_nodes(root2, str(tmp / "d"), ["B"]), ["A", "A"])),
        ("stages, B lost", _restart_pp, (url_pp, _copy_nodes(root_pp, str(tmp / "e"), ["B"]), ["A", "C"], 3)),
    ], timeout=TIMEOUT)


def test_zero_collectives_on_the_training_thread_and_only_send_recv_on_the_tier_group(killed):
    for r in killed[1]["four nodes"]:
        assert r["other"] == [] and r["groups_ok"] and r["skipped"] == 0
        assert set(r["kinds"]) <= {"isend", "irecv", "PG.send", "PG.recv"} and "PG.send" in r["kinds"]


@pytest.mark.parametrize("survivors", [
    ["n0", "n1", "n3"],
    ["n3", "n1"],
])
def test_node_lost_restores_fast_step_renumbered_without_reading_the_store(killed, restarted_at_two, survivors,
                                                                           tmp_path):
    url, root = killed[0]("four nodes")
    if len(survivors) == 2:
        res = restarted_at_two["n2 lost, on n3 n1"]
    else:  # the only 3-rank case: a launch of its own
        nodes_root = _copy_nodes(root, str(tmp_path / "nodes"), ["n2"])
        res = run_workers(_restart, 3, url, nodes_root, survivors, 8, timeout=TIMEOUT)
    for r in res:
        assert (r["step"], r["exact"], r["persistent_bytes"], r["source"]) == (9, True, 0, "tier"), r
        # every rank receives the union of the lanes (and takes what it hosts now)
        assert r["lanes"] == {str(l): {"doc": 900 + l} for l in range(LANES)} and r["meta"] == {"step": 9}
        assert not r["tier_left"]  # a clean exit removes the tier
    # byte-range fetches: of each data file a peer sent, exactly the bytes the ordinary load
    # reads of it at this world size (the persistent step 8 has the same plan), never more
    fetched = [{os.path.basename(rel): n for rel, n in r["fetched"].items() if rel.endswith(".data")} for r in res]
    for got, r in zip(fetched, res):
        assert all(n == r["oracle"][name] for name, n in got.items()), (got, r["oracle"])
    assert any(fetched)
    assert sum(r["sent"] for r in res) == sum(r["received"] for r in res) > 0
    assert [r["from_peers"] for r in res] == [r["received"] for r in res]  # the load counts what the tier fetched
    whole = os.path.getsize(os.path.join(url, "step-000000000008",
                                         *[f for f in _files(url, 8) if f.endswith("r00001.data")]))
    partial = [n for r in res for rel, n in r["fetched"].items() if rel.endswith(".data") and n < whole]
    if len(survivors) == 3:  # 4 -> 3 ranks: a rank asks for part of a saved rank's file
        assert partial, [r["fetched"] for r in res]
    # n2 held saved rank 2's own files and rank 1's copy: rank 2's came from n3 (its partner), and
    # a rank whose node lacked a saved rank's files fetched them from a peer over the tier's group
    from_n3 = [p for r in res for s, p in r["parts"].items() if s == 2]
    assert from_n3 and all(p in ("own node n3", f"node n3 via rank {survivors.index('n3')}") for p in from_n3)
    assert any(" via rank " in p for r in res for p in r["parts"].values())


def _files(url: str, step: int) -> list[str]:
    folder = os.path.join(url, f"step-{step:012d}")
    return [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs]


def test_both_copies_of_a_rank_lost_takes_only_its_parts_from_the_stores_same_step(killed, restarted_at_two):
    """Saved rank 0's files of steps 8 and 9 are on no surviving node (n0 held its own, n1 its
    copy); the store holds step 8 (the same save): step 8 loads with rank 0's parts from the
    store, the rest from the tier (n2 and n3 restart at 2 ranks)."""
    res = restarted_at_two["rank 0's copies lost"]
    for r in res:
        assert (r["step"], r["exact"], r["source"]) == (8, True, "tier"), r
        assert "lacks saved rank(s) [0] on every surviving node; the persistent store holds step 8" in r["reason"]
        assert r["lanes"] == {str(l): {"doc": 800 + l} for l in range(LANES)} and r["meta"] == {"step": 8}
        assert all(p.startswith(("own node", "node ")) for s, p in r["parts"].items() if s != 0), r["parts"]
        assert set(r["store_files"]) <= {"r00000.data"}, r["store_files"]  # only the missing rank's data
    assert set().union(*[r["store_files"] for r in res]) == {"r00000.data"}
    # the store's manifest read once: by rank 0, received by rank 1
    url = killed[0]("four nodes")[0]
    size = os.path.getsize(os.path.join(url, "step-000000000008", "manifest.json"))
    assert [r["manifest"] for r in res] == [(size, False), (size, True)]
    # 4 -> 2 ranks: rank 0 (on n2) reads saved ranks 0 and 1 (its shards) and 3 (who saved the
    # replicated tensor): 0 from the store, 1 from its node (the copy), 3 from rank 1's node
    assert res[0]["parts"] == {0: "persistent store step 8", 1: "own node n2", 3: "node n3 via rank 1"}
    # of saved rank 3's data file rank 0 wants the replicated tensor only: the peer sends exactly
    # the bytes the ordinary load of persistent step 8 (the same plan) reads of it, part of the file
    fetched = {os.path.basename(rel): n for rel, n in res[0]["fetched"].items() if rel.endswith(".data")}
    assert list(fetched) == ["r00003.data"] and fetched["r00003.data"] == res[0]["oracle"]["r00003.data"], (
        fetched, res[0]["oracle"])
    whole = os.path.getsize(os.path.join(url, "step-000000000008",
                                         *[f for f in _files(url, 8) if f.endswith("r00003.data")]))
    assert 0 < fetched["r00003.data"] < whole


def test_a_partial_step_the_store_lacks_falls_back_to_the_newest_persistent_step_whole(restarted_at_two):
    """As above, and the survivors' step 8 is gone too (as if pruned): tier step 9 lacks
    rank 0 and the store has no step 9, so the newest persistent step (8) loads whole."""
    res = restarted_at_two["and step 8 pruned"]
    for r in res:
        assert (r["step"], r["exact"], r["source"]) == (8, True, "persistent"), r
        assert "no fast-tier step is complete; loading persistent step 8 whole" in r["reason"]
        assert "tier step 9 lacks the files of saved rank(s) [0]" in r["reason"]
        assert r["persistent_bytes"] > 0 and r["lanes"] == {str(l): {"doc": 800 + l} for l in range(LANES)}
    assert set().union(*[r["store_files"] for r in res]) == {"r00000.data", "r00001.data", "r00002.data",
                                                              "r00003.data"}


def test_two_nodes_of_two_ranks_restart_on_one_node_from_the_partner_copies(restarted_at_two):
    res = restarted_at_two["B lost, on A"]  # the "two nodes" run (A, A, B, B) restarted on A, A
    for r in res:
        assert (r["step"], r["exact"], r["persistent_bytes"], r["source"]) == (3, True, 0, "tier"), r
        assert r["lanes"] == {str(l): {"doc": 300 + l} for l in range(LANES)}
        assert all(p == "own node A" for p in r["parts"].values())
    assert sorted(set().union(*[r["parts"] for r in res])) == [0, 1, 2, 3]


# -- one process: hygiene -----------------------------------------------------------------------
def _one(tmp_path, **kw) -> Checkpointer:
    t = LocalTier(dir=str(tmp_path / "shm"), replicas=0, lineage="one", **kw)
    return Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, run_id="one", local=t)


def test_space_check_fails_at_construction_with_the_numbers(tmp_path):
    with pytest.raises(ValueError, match=r"needs 4000000000000000 bytes \(1 copy x keep_last 2 x 2000000000000000 "
                                         r"bytes a rank x 1 rank on this node\), \d+ free .*64 MiB"):
        _one(tmp_path, state_bytes=2 * 10**15)


def test_fast_step_restored_in_one_process_and_load_of_a_persistent_step_bypasses_the_tier(tmp_path):
    ck = _one(tmp_path)
    ck.save(5, make_state(0, 1, 5)).result(60)
    for step in (6, 7):
        ck.save_local(step, make_state(0, 1, step)).result(60)
    root = ck.tier.root
    ck.close()
    assert not os.path.exists(root)  # close() is a clean exit: the tier goes
    # a crash (no close) keeps it; a restart restores step 7 from it
    ck = _one(tmp_path)
    ck.save_local(7, make_state(0, 1, 7)).result(60)
    atexit.unregister(ck._atexit)
    ck2 = _one(tmp_path)
    state = make_state(0, 1, 0, zero=True)
    assert ck2.load(state) == 7 and ck2.tier.last_recovery.source == "tier"
    assert torch.equal(state["w"].local, make_state(0, 1, 7)["w"].local)
    assert ck2.load(state, step=5) == 5 and torch.equal(state["w"].local, make_state(0, 1, 5)["w"].local)
    ck2.close()


def test_load_with_exclude_restores_from_the_tier_and_leaves_the_excluded_leaves_alone(tmp_path, monkeypatch):
    ck = _one(tmp_path)
    ck.save(5, make_state(0, 1, 5)).result(60)
    ck.save_local(7, make_state(0, 1, 7)).result(60)
    atexit.unregister(ck._atexit)  # a crash: the tier stays
    read = []  # the data files read, by path
    for name in ("read_into", "read_scatter"):
        real = getattr(RangeReader, name)
        monkeypatch.setattr(RangeReader, name, lambda self, *a, real=real: (read.append(self.path), real(self, *a))[1])

    def target() -> dict:  # without the saved "meta", with an "extra" value no save holds
        state = make_state(0, 1, 0, zero=True)
        del state["meta"]
        state["extra"] = {"x": 1}
        return state

    ck2 = _one(tmp_path)
    state = target()
    assert ck2.load(state, exclude=("meta", "extra", "data")) == 7
    rec = ck2.tier.last_recovery
    assert rec.source == "tier" and rec.step == 7, rec.reason
    assert torch.equal(state["w"].local, make_state(0, 1, 7)["w"].local)
    assert state["data"].values == make_state(0, 1, 0, zero=True)["data"].values and state["extra"] == {"x": 1}
    assert read and all(p.startswith(str(tmp_path / "shm")) for p in read), read  # none of the store's
    state = target()  # the same target, "data" not excluded: restored from the tier too
    assert ck2.load(state, exclude=("meta", "extra")) == 7 and ck2.tier.last_recovery.source == "tier"
    assert state["data"].values == make_state(0, 1, 7)["data"].values
    # without the exclusion the structures differ: the tier says so and the store's load names the key
    with pytest.raises(Exception, match="extra"):
        ck2.load(target())
    assert "another lineage or structure" in ck2.tier.last_recovery.reason
    assert ck2.tier.last_recovery.other_structure
    # the step of another structure stays (a mistaken load must not sweep it): it is restored once the structure matches
    assert 7 in {h.step for h in scan(ck2.tier.storage)}
    state = target()
    assert ck2.load(state, exclude=("meta", "extra")) == 7 and ck2.tier.last_recovery.source == "tier"
    ck2.close()


def test_steps_set_aside_leave_the_scan_at_once_and_a_killed_sweep_is_finished_later(tmp_path):
    root = str(tmp_path)
    for step in (5, 7, 9):
        os.makedirs(os.path.join(root, f"step-{step:012d}", "s.1"))
        with open(os.path.join(root, f"step-{step:012d}", "s.1", "r00000.data"), "wb") as f:
            f.write(b"x" * 10)
    aside = set_aside(root, 7, "a")
    assert sorted(os.listdir(root)) == [REMOVED, f"step-{7:012d}"]  # renamed at once: no scan sees them
    assert sorted(os.path.basename(p) for p in aside) == [f"step-{5:012d}.a", f"step-{9:012d}.a"]
    assert sorted(set_aside_before(root)) == sorted(aside)  # what a killed process left, found at the next start
    remove_paths(aside)
    assert set_aside_before(root) == [] and set_aside(root, 7, "b") == []


def _died(ck: Checkpointer) -> None:
    """What a SIGKILL leaves: no close(), and the tier folder's lock let go (by the kernel)."""
    atexit.unregister(ck._atexit)
    ck.tier._let_go()


def test_other_runs_tiers_are_removed_at_start_and_never_loaded(tmp_path):
    ck = _one(tmp_path)
    ck.save_local(3, make_state(0, 1, 3)).result(60)
    _died(ck)
    (tmp_path / "shm" / "unrelated").mkdir()
    t = LocalTier(dir=str(tmp_path / "shm"), replicas=0, lineage="another", stale_after=0)
    other = Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, run_id="one", local=t)
    assert not os.path.exists(ck.tier.root) and (tmp_path / "shm" / "unrelated").exists()
    with pytest.raises(Exception, match="no committed checkpoint"):
        other.load(make_state(0, 1, 0, zero=True))
    assert other.tier.last_recovery.source == "none"
    assert ("held the tier of run id 'one', not this launch's 'another': FLEXCKPT_RUN_ID must be the same on every "
            "launch" in other.tier.last_recovery.reason), other.tier.last_recovery.reason
    other.close()


def test_a_torn_fast_step_is_never_loaded(tmp_path):
    """What a kill during a save or a copy leaves: files without their marker, or a marker
    whose files are short. Either way the step is not complete and the previous one loads."""
    ck = _one(tmp_path)
    for step in (6, 7):
        ck.save_local(step, make_state(0, 1, step)).result(60)
    atexit.unregister(ck._atexit)
    held = {h.step: h for h in scan(ck.tier.storage)}
    folder = os.path.join(ck.tier.root, f"step-{7:012d}")
    data = [os.path.join(folder, rel) for rel in held[7].doc["files"] if rel.endswith(".data")][0]
    with open(data, "r+b") as f:  # the marker names more bytes than the file holds
        f.truncate(os.path.getsize(data) - 1)
    ck2 = _one(tmp_path)
    state = make_state(0, 1, 0, zero=True)
    assert ck2.load(state) == 6 and torch.equal(state["w"].local, make_state(0, 1, 6)["w"].local)
    atexit.unregister(ck2._atexit)
    # a bundle whose marker never landed: after a restore only the restored step stays, so save 8 and tear it
    ck3 = _one(tmp_path)
    ck3.save_local(8, make_state(0, 1, 8)).result(60)
    atexit.unregister(ck3._atexit)
    marker = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(ck3.tier.root, f"step-{8:012d}"))
              for f in fs if f.endswith(".done")][0]
    os.remove(marker)
    ck4 = _one(tmp_path)
    assert ck4.load(make_state(0, 1, 0, zero=True)) == 6
    ck4.close()


def test_newest_held_names_the_tiers_newest_step_and_a_failed_tier_load_sets_every_step_aside(tmp_path):
    """``newest_held``: the newest step the node holds a complete bundle of (None when it
    holds none). A tier step whose load fails (a flipped byte in its data) falls back to
    the store's step, and the tier's steps are set aside: the run goes on from the older
    step, which they must never outrank at a later restart."""
    ck = _one(tmp_path)
    assert ck.tier.newest_held() is None
    ck.save(5, make_state(0, 1, 5)).result(60)
    for step in (6, 7):
        ck.save_local(step, make_state(0, 1, step)).result(60)
    assert ck.tier.newest_held() == 7
    atexit.unregister(ck._atexit)  # a crash: the tier stays
    held = {h.step: h for h in scan(ck.tier.storage)}
    rel = [r for r in held[7].doc["files"] if r.endswith(".data")][0]
    data = os.path.join(ck.tier.root, f"step-{7:012d}", rel)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    ck2 = _one(tmp_path)
    assert ck2.tier.newest_held() == 7  # complete as its marker says: only the load's checksums see the flip
    state = make_state(0, 1, 0, zero=True)
    assert ck2.load(state) == 5 and torch.equal(state["w"].local, make_state(0, 1, 5)["w"].local)
    assert "the fast-tier load of step 7 failed on rank(s) [0]" in ck2.tier.last_recovery.reason
    assert scan(ck2.tier.storage) == [] and ck2.tier.newest_held() is None
    ck2.close()


def test_a_fast_save_due_while_the_last_is_in_flight_is_skipped_and_counted(tmp_path, monkeypatch):
    import flexckpt.tier.save as fast_save

    release = threading.Event()
    real = fast_save.write_raw

    def slow_write(*a, **k):
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(fast_save, "write_raw", slow_write)
    ck = _one(tmp_path)
    first = ck.save_local(1, make_state(0, 1, 1))
    t0 = time.perf_counter()
    assert ck.save_local(2, make_state(0, 1, 2)) is None and ck.tier.skipped == 1
    assert time.perf_counter() - t0 < 1.0  # never waited for
    release.set()
    assert first.result(30) == 1
    assert ck.save_local(3, make_state(0, 1, 3)).result(30) == 3 and ck.tier.skipped == 1
    assert sorted(h.step for h in scan(ck.tier.storage)) == [1, 3]
    ck.close()


# -- recovery's byte ranges and step view (one process) -------------------------------------------
def test_asked_ranges_are_the_chunks_the_ordinary_load_reads_and_land_in_their_target(tmp_path):
    """A step saved by 1 rank, read as rank 1 of 2: the ranges asked of each data file are
    what the ordinary load reads of it (counted through the storage layer), and each lands
    whole in one stretch of the target, so it can be received there directly."""
    from flexckpt.catalog import read_manifest
    from flexckpt.load.pending import PendingLoad
    from flexckpt.state.structure import walk
    from flexckpt.tier.peer_ranges import ranges_needed

    ck = Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, chunk_bytes=1024)
    ck.save(3, {"w": ShardedTensor.from_global(global_tensor("w", 3), Shard(0), 0, 1)}).result(60)
    ck.close()
    target = {"w": ShardedTensor.from_global(torch.zeros(SHAPES["w"]), Shard(0), 1, 2)}
    m = read_manifest(ck.storage, 3)
    pending = PendingLoad(ck.storage, m, walk(target, 1, 2), 1, 2, True)
    targets = [(m.tensors[pending.walk.specs[i].name], rng) for i, rng in pending.targets]
    ranges = ranges_needed(m, targets, set(m.files))
    read: dict = {}
    orig = RangeReader.read_scatter

    def counting(self, offset, outs):
        read[os.path.basename(self.path)] = read.get(os.path.basename(self.path), 0) + sum(o.nbytes for o in outs)
        return orig(self, offset, outs)

    RangeReader.read_scatter = counting
    try:
        pending.read(1)
    finally:
        RangeReader.read_scatter = orig
    # rows 48..95 are bytes [7680, 15360) of the file; chunks of 1024 bytes: [7168, 15360) is read
    assert {os.path.basename(f): sum(r.length for r in rs) for f, rs in ranges.items()} == read == {"r00000.data": 8192}
    assert os.path.getsize(os.path.join(ck.storage.root, "step-000000000003", list(m.files)[0])) == 15360
    # the first chunk is half wanted (to a buffer); the rest lands whole at byte 512 of the target
    assert [tuple(r) for rs in ranges.values() for r in rs] == [(7168, 1024, -1, 0), (8192, 7168, 0, 512)]


def test_step_view_reads_received_ranges_and_refuses_others(tmp_path):
    from flexckpt.errors import MissingFile
    from flexckpt.tier.view import Received, StepView

    waited = []
    f = Received("step-1/a/r00001.data", 100, "rank 3 on node n3")
    f.add(60, np.arange(20, dtype=np.uint8), lambda: waited.append(60))
    f.add(10, np.arange(30, dtype=np.uint8), lambda: waited.append(10))
    view = StepView(Storage(str(tmp_path)), {"step-1/a/r00001.data": f})
    out = np.zeros(5, dtype=np.uint8)
    view.open_reader("step-1/a/r00001.data").read_into(35, memoryview(out))
    assert out.tolist() == [25, 26, 27, 28, 29] and waited == [10] and view.size("step-1/a/r00001.data") == 100
    with pytest.raises(MissingFile, match=r"r00001.data from rank 3 on node n3: bytes \[40, 45\) were not asked for"):
        view.open_reader("step-1/a/r00001.data").read_into(38, memoryview(np.zeros(7, dtype=np.uint8)))
    # a range received straight into its place is not copied onto itself
    target = np.arange(20, dtype=np.uint8)
    g = Received("x", 20, "a peer")
    g.add(0, target, lambda: None)
    g.read_scatter(0, [memoryview(target)[:8], memoryview(target)[8:]])
    assert target.tolist() == list(range(20))


def test_the_stores_step_serves_missing_parts_only_when_it_is_the_same_save(tmp_path):
    """Same attempt, plan and files (manifest lines) as the tier's bundles: accepted. Another
    attempt, or a held rank whose files differ: refused, naming why."""
    import dataclasses

    from flexckpt.tier.inventory import choose
    from flexckpt.tier.recover import StepRecovery

    ck = _one(tmp_path)
    state = make_state(0, 1, 4)
    ck.save(4, state).result(60)
    ck.save_local(4, state).result(60)
    held = scan(ck.tier.storage)
    d = choose([held], ck.tier.lineage, held[0].doc["fingerprint"], [4])
    assert (d.source, d.step, d.missing) == ("tier", 4, [])
    recovery = StepRecovery(ck.tier, ck)
    assert recovery.store_manifest(d).attempt == d.attempt  # a persistent and a fast save of a step: attempt 1 each
    with pytest.raises(ValueError, match=r"step 4 is not the save the fast tier holds part of \(it is save attempt "):
        recovery.store_manifest(dataclasses.replace(d, attempt=d.attempt[:-1] + "2"))
    doc = dict(d.docs[0], line=[*d.docs[0]["line"][:3], d.docs[0]["line"][3] + 1, *d.docs[0]["line"][4:]])
    with pytest.raises(ValueError, match=r"the files of saved rank\(s\) \[0\] differ"):
        recovery.store_manifest(dataclasses.replace(d, docs={0: doc}))
    ck.close()

# -- pipeline stages and bytes values -----------------------------------------------------------
PP_LAYERS = 4


def _pp_global(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn((6, 5) if name.endswith(".w") else (5,), generator=g) + step


def _loader_bytes(dp: int, step: int) -> bytes:
    """torchtitan's data loader state: pickled bytes under ``dp_rank_<d>``, the same on
    every stage of a data-parallel replica (never unpickled by flexckpt)."""
    return bytes([dp, step % 256]) + b"\x80\x04loader" * (3 + dp)


def _pp_state(rank: int, world: int, stages: int, step: int, zero: bool = False, layers: int = PP_LAYERS) -> dict:
    """This rank's stage: layer ``i`` on stage ``i * stages // layers``, a weight ``Shard(0)``
    and a norm ``Replicate()`` on the stage's dp mesh (spanning part of the world when
    ``stages`` > 1); the loader's bytes under the rank's dp rank; the step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard, distribute_tensor

    per = world // stages
    mesh = init_device_mesh("cpu", (stages, per), mesh_dim_names=("pp", "dp"))["dp"]
    stage, dp = rank // per, rank % per
    model = {}
    for i in range(layers):
        if i * stages // layers != stage:
            continue
        for name, placement in ((f"layers.{i}.w", DShard(0)), (f"layers.{i}.norm", DReplicate())):
            t = _pp_global(name, step)
            model[name] = distribute_tensor(torch.zeros_like(t) if zero else t, mesh, [placement])
    return {"model": model, "data": {f"dp_rank_{dp}": b"" if zero else _loader_bytes(dp, step)}, "step": -1 if zero else step}


def _persistent_reads(url: str) -> list:
    """Bytes read from the persistent store ``url`` from now on in this process (a one-item list)."""
    read = [0]
    orig_bytes, orig_into, orig_scatter = Storage.read_bytes, RangeReader.read_into, RangeReader.read_scatter

    def read_bytes(self, rel, limit=None):
        out = orig_bytes(self, rel, limit)
        read[0] += len(out) if self.url == url else 0
        return out

    def read_into(self, offset, out):
        read[0] += memoryview(out).nbytes if self.storage.url == url else 0
        return orig_into(self, offset, out)

    def read_scatter(self, offset, outs):
        read[0] += sum(memoryview(o).nbytes for o in outs) if self.storage.url == url else 0
        return orig_scatter(self, offset, outs)

    Storage.read_bytes, RangeReader.read_into, RangeReader.read_scatter = read_bytes, read_into, read_scatter
    return read


def _train_pp(rank, world, url, root, nodes, steps):
    """2 stages x 2 ranks: persistent at step 1, fast every step; killed after the last."""
    os.environ["FLEXCKPT_NODE"] = nodes[rank]
    ck = Checkpointer(url, local=tier(root, nodes[rank]))
    for step in range(1, steps + 1):
        state = _pp_state(rank, world, 2, step)
        if step == 1:
            ck.save(step, state).result(60)
        ck.save_local(step, state).result(60)
    expected = {rank} | set(ck.tier.sources)
    deadline = time.monotonic() + 90
    while not {h.rank for h in scan(ck.tier.storage) if h.step == steps} >= expected:
        assert time.monotonic() < deadline, "copies did not arrive"
        time.sleep(0.02)
    dist.barrier()  # every node now holds its ranks' files and their sources' copies
    carried = sorted(h.rank for h in scan(ck.tier.storage) if h.step == steps and "structure" in h.doc)
    atexit.unregister(ck._atexit)  # killed: no close, no clean-up
    return carried


def _restart_pp(rank, world, url, root, nodes, steps):
    """One stage at W=2: the tier's step bit for bit with no byte from the store; again at
    2 stages of one rank; then a target with a layer no stage saved: the tier cannot serve it, says so, and the
    persistent load names the layer."""
    from flexckpt.errors import StructureMismatch

    os.environ["FLEXCKPT_NODE"] = nodes[rank]
    unpatched = Storage.read_bytes, RangeReader.read_into, RangeReader.read_scatter
    read = _persistent_reads(url)
    ck = Checkpointer(url, local=tier(root, nodes[rank]))
    state = _pp_state(rank, world, 1, 0, zero=True)
    read[0] = 0
    step = ck.load(state)
    want = _pp_state(rank, world, 1, steps)
    exact = [n for n, t in want["model"].items() if not torch.equal(state["model"][n].full_tensor(), t.full_tensor())]
    rec = ck.tier.last_recovery
    out = {"step": step, "differ": exact, "persistent_bytes": read[0], "data": state["data"], "want_data": want["data"],
           "step_value": state["step"], "source": rec.source, "reason": rec.reason, "parts": rec.parts}
    # again at 2 stages of 1 rank: the target ranks' structures differ too (their union is gathered)
    state, want = _pp_state(rank, world, 2, 0, zero=True), _pp_state(rank, world, 2, steps)
    out["two_stages"] = (ck.load(state), ck.tier.last_recovery.source, read[0], sorted(state["model"]),
                         [n for n, t in want["model"].items() if not torch.equal(state["model"][n].full_tensor(), t.full_tensor())],
                         state["data"] == want["data"])
    odd = _pp_state(rank, world, 1, 0, zero=True, layers=PP_LAYERS + 1)
    try:
        ck.load(odd)
        out["odd"] = "loaded"
    except StructureMismatch as exc:
        out["odd"] = str(exc)
    out["odd_source"], out["odd_reason"] = ck.tier.last_recovery.source, ck.tier.last_recovery.reason
    ck.close()
    Storage.read_bytes, RangeReader.read_into, RangeReader.read_scatter = unpatched
    return out


def test_pipeline_stages_with_bytes_values_restore_from_the_tier_at_one_stage_and_half_the_world(killed,
                                                                                                 restarted_at_two):
    """2 stages x 2 ranks on nodes A (stage 0) and B (stage 1), each node holding the other's
    copies; node B lost, the job restarts on W=2 (node A and a new node C), at one stage and
    at two."""
    # each node holds all 4 bundles; the markers of saved rank 0 and of stage 1's lowest rank carry the structures
    assert killed[1]["stages"] == [[0, 2]] * 4
    res = restarted_at_two["stages, B lost"]
    for rank, r in enumerate(res):
        assert (r["step"], r["differ"], r["persistent_bytes"], r["source"]) == (3, [], 0, "tier"), r
        layers = [f"layers.{i}.{p}" for i in (2 * rank, 2 * rank + 1) for p in ("norm", "w")]
        assert r["two_stages"] == (3, "tier", 0, layers, [], True), r["two_stages"]
        assert r["data"] == r["want_data"] == {f"dp_rank_{rank}": _loader_bytes(rank, 3)} and r["step_value"] == 3
        assert r["odd_source"] == "persistent" and "of another lineage or structure ignored" in r["odd_reason"], r
        assert "layers.4" in r["odd"] and "persistent" not in r["odd"], r["odd"]
    assert sorted(res[0]["parts"]) == sorted(res[1]["parts"]) == [0, 1, 2, 3]  # each wants a piece of every saved rank
    assert all(p == "own node A" for p in res[0]["parts"].values())
    assert all(p == "node A via rank 0" for p in res[1]["parts"].values())


def test_a_step_whose_stage_structure_no_marker_carries_is_not_restored_from_the_tier_and_says_why():
    def doc(rank, line_fp, structure=None):
        d = {"lineage": "L", "fingerprint": f"compat-{line_fp}", "line": [line_fp], "step": 7}
        return d if structure is None else {**d, "structure": structure}

    def st(*names):
        return {"tensors": [{"name": n, "dtype": "float32", "shape": [4]} for n in names], "plain": [], "lanes": [],
                "per_rank": []}

    from flexckpt.tier.inventory import compat_union

    both = compat_union([st("a"), st("b")])
    held = [Held(7, "run.0000abcd.1", r, 4, doc(r, "S0" if r < 2 else "S1", st("a") if r == 0 else None)) for r in range(4)]
    d = choose([held], "L", both, [5])
    assert (d.source, d.step) == ("persistent", 5)
    assert "the structure of saved rank 2 (its pipeline stage's) is in no marker of the step" in d.reason
    held[2] = Held(7, "run.0000abcd.1", 2, 4, doc(2, "S1", st("b")))  # the stage's lowest rank carries it
    d = choose([held], "L", both, [5])
    assert (d.source, d.step) == ("tier", 7)
    assert choose([held], "L", compat_union([st("a"), st("b"), st("c")]), []).source == "none"  # another structure


def test_bytes_values_of_a_fast_step_merge_by_key_and_unequal_copies_name_the_key():
    from flexckpt.tier.recover import _merged_keyed
    from flexckpt.tier.inventory import Decision

    def step(*keyed):
        return Decision("tier", 7, "run.0000abcd.1", len(keyed), docs={r: {"keyed": k} for r, k in enumerate(keyed)})

    same = {"data/dp_rank_0": [0, "AAE="]}
    assert _merged_keyed(step(same, {"data/dp_rank_0": [1, "AAE="]}, {})) == same  # the lowest rank's copy
    with pytest.raises(ValueError, match=r"bytes value 'data/dp_rank_0' differs between saved ranks 0 and 1"):
        _merged_keyed(step(same, {"data/dp_rank_0": [1, "AAI="]}))


def test_a_bytes_value_is_restored_from_the_tier_and_its_file_goes_after_the_load(tmp_path):
    ck = _one(tmp_path)
    state = {**make_state(0, 1, 4), "loader": {"dp_rank_0": _loader_bytes(0, 4)}}
    ck.save_local(4, state).result(60)
    atexit.unregister(ck._atexit)
    ck2 = _one(tmp_path)
    target = {**make_state(0, 1, 0, zero=True), "loader": {"dp_rank_0": b""}}
    assert ck2.load(target) == 4 and ck2.tier.last_recovery.source == "tier", ck2.tier.last_recovery.reason
    assert target["loader"] == {"dp_rank_0": _loader_bytes(0, 4)} and torch.equal(target["w"].local, state["w"].local)
    assert not [f for _d, _s, fs in os.walk(ck2.tier.root) for f in fs if f == "keyed.values"]
    ck2.close()
