"""The edges of a fast tier's life: a run that goes back to an older step, another job
starting beside a live one, a full tmpfs, a run folder removed and made again, two
machines under one node name. One process each, but the sweep (two processes on one
node folder)."""
import atexit
import errno
import logging
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from flexckpt import Checkpointer
from flexckpt.tier import LocalTier
import flexckpt.tier.fast as fast
from flexckpt.tier.inventory import Held, choose, scan
import flexckpt.tier.save as fast_save
from flexshard.spawn import run_workers
from tier_states import make_state

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def _ck(tmp_path, lineage: str = "life", keep_last: int = 2, **kw) -> Checkpointer:
    t = LocalTier(dir=str(tmp_path / "shm"), replicas=0, lineage=lineage, keep_last=keep_last, **kw)
    return Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, run_id="life", local=t)


def _crash(ck: Checkpointer) -> None:
    """A kill: no close(), and the tier folder's lock let go (as the kernel does)."""
    atexit.unregister(ck._atexit)
    getattr(ck.tier, "_let_go", lambda: None)()


def _branch(step: int) -> dict:
    """The state the run saves at ``step`` after going back: other values than the first branch's."""
    return make_state(0, 1, 1000 + step)


# -- 1: a run that goes back ----------------------------------------------------------------------
@pytest.mark.parametrize("how", ["step", "strict", "strict in one launch"])
def test_a_run_gone_back_to_an_older_step_restores_its_own_branch_never_the_abandoned_one(tmp_path, monkeypatch,
                                                                                         how):
    """The tier saved 13 and 14; the run goes back to the store's step 5 with ``load(state,
    step=5)`` at a restart (then saves 6 and 7: the abandoned steps are newer), with
    ``strict=False`` at a restart (then saves 13 and 14 again: equal step numbers, both
    attempt 1, the abandoned one's listed first), or with ``strict=False`` in the same
    launch (then saves 6 and 7; keep_last 4 keeps all four). The next restart restores the
    run's own newest step, with its values."""
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0))  # the first launch's session: 00000000
    ck = _ck(tmp_path, keep_last=4)
    monkeypatch.undo()
    ck.save(5, make_state(0, 1, 5)).result(60)
    for step in (13, 14):
        ck.save_local(step, make_state(0, 1, step)).result(60)
    if how != "strict in one launch":
        _crash(ck)
        monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=(1 << 128) - 1))  # the second's: ffffffff
        ck = _ck(tmp_path, keep_last=4)
        monkeypatch.undo()
    state = make_state(0, 1, 0, zero=True)
    assert (ck.load(state, step=5) if how == "step" else ck.load(state, strict=False)) == 5
    assert torch.equal(state["w"].local, make_state(0, 1, 5)["w"].local)
    # a rollback sets the tier's steps aside; a partial load (a probe) leaves them for a full load
    assert sorted(h.step for h in scan(ck.tier.storage)) == ([] if how == "step" else [13, 14])
    steps = (13, 14) if how == "strict" else (6, 7)
    for step in steps:
        ck.save_local(step, _branch(step)).result(60)
    if how == "strict in one launch":  # keep_last 4: the abandoned steps are still there
        assert sorted(h.step for h in scan(ck.tier.storage)) == [6, 7, 13, 14]
    _crash(ck)
    ck3 = _ck(tmp_path)
    state = make_state(0, 1, 0, zero=True)
    assert ck3.load(state) == steps[-1] and ck3.tier.last_recovery.source == "tier", ck3.tier.last_recovery.reason
    assert torch.equal(state["w"].local, _branch(steps[-1])["w"].local)
    assert state["meta"] == {"step": 1000 + steps[-1]}
    ck3.close()


def _held(step: int, launch: int, branch: int = 0) -> Held:
    return Held(step, f"run.{launch:04x}{branch:04x}.1", 0, 1,
                {"lineage": "L", "fingerprint": "F", "launch": launch, "branch": branch})


def test_saves_of_one_step_never_tie_the_later_launch_or_branch_wins_in_any_listing_order():
    for inventory in ([_held(14, 1), _held(14, 2)], [_held(14, 2), _held(14, 1)]):
        d = choose([inventory], "L", "F", [])
        assert (d.source, d.step, d.attempt) == ("tier", 14, "run.00020000.1")
    # a later launch's step outranks an earlier launch's newer one (that launch went on from elsewhere),
    # and so does a later branch's in one launch (a load the tier did not serve came between)
    d = choose([[_held(14, 1), _held(7, 2)]], "L", "F", [5])
    assert (d.step, d.attempt) == (7, "run.00020000.1")
    d = choose([[_held(14, 2, 0), _held(7, 2, 1)]], "L", "F", [5])
    assert (d.step, d.attempt) == (7, "run.00020001.1")


# -- 2: a starting job beside a live one ------------------------------------------------------------
LIVE = """
import sys, torch
from flexckpt import Checkpointer
from flexckpt.tier import LocalTier
ck = Checkpointer(sys.argv[1], rank=0, world_size=1, local=LocalTier(dir=sys.argv[2], replicas=0, lineage="live"))
ck.save_local(1, {"w": torch.ones(8)}).result(60)
print(ck.tier.root, flush=True)
sys.stdin.read()  # until the test lets go (or kills this process)
"""


def test_a_starting_job_never_sweeps_a_live_jobs_tier_and_sweeps_it_once_its_owner_died(tmp_path):
    shm = tmp_path / "shm"
    live = subprocess.Popen([sys.executable, "-c", LIVE, str(tmp_path / "live-store"), str(shm)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC}, text=True)
    try:
        root = live.stdout.readline().strip()
        assert root and os.path.isdir(root), live.poll()
        old = time.time() - 3600  # untouched for an hour (a job saving to its tier rarely)
        for d, _, fs in os.walk(root):
            for f in fs + ["."]:
                os.utime(os.path.join(d, f), (old, old))
        starter = _ck(tmp_path, lineage="starter", stale_after=0)
        assert os.path.isdir(root) and scan(fast.Storage(root, None, None)) != []  # the live job's tier stays
        starter.save_local(1, make_state(0, 1, 1)).result(60)
        # a second Checkpointer of this process never sweeps the tier the process holds
        second = Checkpointer(str(tmp_path / "store2"), rank=0, world_size=1, run_id="second",
                              local=LocalTier(dir=str(shm), replicas=0, lineage="second", stale_after=0))
        assert os.path.isdir(starter.tier.root) and scan(starter.tier.storage) != []
        second.close()
        live.kill()  # its owner died: the lock is gone with it
        live.wait(30)
        after = Checkpointer(str(tmp_path / "store3"), rank=0, world_size=1, run_id="after",
                             local=LocalTier(dir=str(shm), replicas=0, lineage="after", stale_after=0))
        assert not os.path.exists(root) and os.path.isdir(starter.tier.root)
        after.close()
        starter.close()
    finally:
        live.kill()
        live.wait(30)


# -- 3: a full tmpfs ---------------------------------------------------------------------------------
def test_a_fast_save_that_fills_the_tmpfs_removes_its_files_says_so_and_the_tier_recovers(tmp_path, monkeypatch,
                                                                                          caplog):
    ck = _ck(tmp_path)
    ck.save_local(1, make_state(0, 1, 1)).result(60)
    real = fast_save.write_raw
    full = {"on": True}

    def filling(storage, rel, stream, nbytes, **kw):
        if not full["on"]:
            return real(storage, rel, stream, nbytes, **kw)
        with open(storage.path(rel), "wb") as f:  # part of the file lands, then the tmpfs is full
            f.write(bytes(stream[: nbytes // 2]))
        raise OSError(errno.ENOSPC, "No space left on device", storage.path(rel))

    monkeypatch.setattr(fast_save, "write_raw", filling)
    caplog.set_level(logging.WARNING, logger="flexckpt")
    for n, step in enumerate((2, 3, 4), start=1):
        h = ck.save_local(step, make_state(0, 1, step))
        with pytest.raises(Exception, match="No space left"):
            h.result(60)
        assert not os.path.exists(os.path.join(ck.tier.root, f"step-{step:012d}"))  # nothing of it stays
        assert (ck.tier.failed, ck.tier.failing, h.timings["failed_in_a_row"]) == (n, n, float(n))
    assert "3 fast saves in a row failed; the tier is not protecting the run" in caplog.text
    assert [h.step for h in scan(ck.tier.storage)] == [1]
    full["on"] = False  # the space is back: the next fast saves land, and keep_last holds
    for step in (5, 6):
        h = ck.save_local(step, make_state(0, 1, step))
        assert h.result(60) == step and h.timings["failed_in_a_row"] == 0.0
    assert ck.tier.failing == 0 and "the tier protects the run again" in caplog.text
    assert sorted(h.step for h in scan(ck.tier.storage)) == [5, 6]
    state = make_state(0, 1, 0, zero=True)
    _crash(ck)
    ck2 = _ck(tmp_path)
    assert ck2.load(state) == 6 and torch.equal(state["w"].local, make_state(0, 1, 6)["w"].local)
    ck2.close()


# -- 17: two machines under one node name ------------------------------------------------------------
def _one_name_two_folders(rank, world, url, root):
    """Two ranks report node name "same" but each has a folder of its own (two machines);
    they save, are killed, restart and load."""
    os.environ["FLEXCKPT_NODE"] = "same"
    folder = os.path.join(root, f"machine{rank}")

    def tier():
        return LocalTier(dir=folder, replicas=1, keep_last=2, timeout=60, lineage="clash", stale_after=0)

    ck = Checkpointer(url, local=tier())
    ck.save(2, make_state(rank, world, 2)).result(60)
    for step in (3, 4):
        ck.save_local(step, make_state(rank, world, step)).result(60)
    atexit.unregister(ck._atexit)  # killed
    ck2 = Checkpointer(url, local=tier())
    state = make_state(rank, world, 0, zero=True)
    step = ck2.load(state)
    exact = torch.equal(state["w"].local, make_state(rank, world, step)["w"].local)
    left = sorted(h.step for h in scan(ck2.tier.storage))
    dist.barrier()
    return {"step": step, "exact": exact, "reason": ck2.tier.last_recovery.reason, "left": left}


def test_two_machines_under_one_node_name_are_named_and_their_steps_set_aside_on_both(tmp_path):
    res = run_workers(_one_name_two_folders, 2, str(tmp_path / "store"), str(tmp_path / "nodes"), timeout=180)
    for r in res:
        assert r["step"] == 2 and r["exact"], r
        assert r["reason"].startswith("ranks [0] and [1] report one node name 'same' but scan different tier "
                                      "folders: two machines under one name"), r["reason"]
        assert r["left"] == [], r  # set aside on each machine, not only on the lowest rank's


# -- 5: a restart's start-up housekeeping ------------------------------------------------------------
def test_a_restart_reads_no_manifest_of_a_step_holding_only_its_committed_attempt_and_never_waits_for_reclaim(
        tmp_path, monkeypatch):
    import flexckpt.catalog as catalog
    import flexckpt.save.committer as committer

    ck = _ck(tmp_path)
    for step in (1, 2, 3):
        ck.save(step, make_state(0, 1, step)).result(60)
    ck.save_local(4, make_state(0, 1, 4)).result(60)
    _crash(ck)
    stale = tmp_path / "store" / f"step-{2:012d}" / "other.12345678.1"  # another job's attempt, long untouched
    stale.mkdir()
    (stale / "r00000.data").write_bytes(b"\1" * 64)
    for p in (stale / "r00000.data", stale):
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    reads = []
    real_read = catalog.read_manifest  # what the reclaim's committed_attempt calls
    monkeypatch.setattr(catalog, "read_manifest", lambda storage, step: reads.append(step) or real_read(storage, step))
    gate = threading.Event()  # the store's housekeeping is slow (a large store): it waits for the gate
    real_reclaim = committer.reclaim_at_start
    monkeypatch.setattr(committer, "reclaim_at_start", lambda *a, **k: (gate.wait(120), real_reclaim(*a, **k))[1])
    built = []
    starter = threading.Thread(target=lambda: built.append(_ck(tmp_path)), daemon=True)
    starter.start()
    starter.join(30)
    try:
        assert built, "construction waited for the start-up housekeeping"
        ck2 = built[0]
        state = make_state(0, 1, 0, zero=True)
        assert ck2.load(state) == 4 and ck2.tier.last_recovery.source == "tier"  # the housekeeping still waits
        assert reads == []
    finally:
        gate.set()
        starter.join(60)
    ck2.close()  # waits for the housekeeping
    assert reads == [2] and not stale.exists()  # only the step with another attempt beside its committed one


def test_the_space_check_counts_a_file_removed_during_its_walk_as_nothing(tmp_path, monkeypatch):
    """A set-aside step is emptied on another thread while a fast save checks its space: a file
    that vanishes between the listing and its size must not fail the save (it did, in CI)."""
    from flexckpt.tier import fast

    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / ".removed").mkdir()
    (tmp_path / ".removed" / "gone").write_bytes(b"y" * 50)
    real = os.path.getsize

    def vanishing(path):
        if path.endswith("gone"):
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(fast.os.path, "getsize", vanishing)
    assert fast._bytes_under(str(tmp_path)) == 100
