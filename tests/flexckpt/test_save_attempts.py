"""Save attempts own their files, records and markers (issue 11, defects 1, 2, 3 and 5).
Several ranks of one job are several Checkpointers with explicit rank/world in one process;
a crash is a write that stops half-way (what the next process finds is the same)."""
import os
import subprocess
import sys
import textwrap
import time

import orjson
import pytest
import torch

from flexckpt import Checkpointer, SaveError
from flexckpt.catalog import read_manifest
from flexckpt.format.jsondoc import seal, unseal
from flexckpt.storage import Storage
from flexshard import Shard, ShardedTensor

W = 2


def state(rank, value, n=4096):
    return {"w": ShardedTensor.from_global(torch.full((n,), float(value)), Shard(0), rank, W), "step": int(value)}


def load_value(root, step=None):
    """What a fresh job loads: every element's value (one value when the step is not mixed)."""
    got = set()
    for r in range(W):
        with Checkpointer(str(root), rank=r, world_size=W, run_id="reader") as ck:
            target = state(r, -1)
            ck.load(target, step=step)
            got |= set(target["w"].local.tolist())
    return got


def save_all(cps, step, value, timeout=30):
    hs = [cp.save(step, state(r, value)) for r, cp in enumerate(cps)]
    return [h.result(timeout=timeout) for h in hs]


def test_a_crash_while_re_saving_a_committed_step_leaves_it_loadable(tmp_path, monkeypatch):
    # defect 1: keep_last=2, steps 1..5, roll back to 4, re-save 5 and crash half-way
    cps = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job", keep_last=2, direct_io=False) for r in range(W)]
    for step in range(1, 6):
        save_all(cps, step, step)
    for cp in cps:
        cp.wait()
    assert cps[0].steps() == [4, 5]
    real = Storage.write_stream

    def crash_half_way(self, rel, parts, fsync=True):
        data = b"".join(bytes(p) for p in parts)
        real(self, rel, [data[: len(data) // 2]], fsync)
        raise OSError(5, "killed half-way through the data file")

    monkeypatch.setattr(Storage, "write_stream", crash_half_way)
    hs = [cp.save(5, state(r, 50)) for r, cp in enumerate(cps)]
    for h in hs:
        with pytest.raises(SaveError):
            h.result(timeout=30)
    for cp in cps:
        cp.close()
    monkeypatch.undo()
    assert load_value(tmp_path, 5) == {5.0}  # the committed step 5, untouched
    # re-saving a step after a rollback keeps working, and the old attempt's files go
    cps = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job2", keep_last=2) for r in range(W)]
    save_all(cps, 5, 51)
    cps[0].wait()
    assert load_value(tmp_path, 5) == {51.0}
    step5 = sorted(os.listdir(tmp_path / "step-000000000005"))
    assert step5 == sorted(["manifest.json", cps[0]._pipeline.in_flight.handles[-1].attempt]), step5
    for cp in cps:
        cp.close()


def test_a_late_record_and_a_stale_failure_marker_never_decide_a_new_attempt(tmp_path):
    # defect 2: rank 0's commit of step 2 times out because rank 1 is late; rank 1's record
    # lands afterwards; both retry step 2 with new values
    r0 = Checkpointer(str(tmp_path), rank=0, world_size=W, run_id="job", commit_timeout=0.5)
    r1 = Checkpointer(str(tmp_path), rank=1, world_size=W, run_id="job", commit_timeout=5)
    with pytest.raises(SaveError, match="commit_timeout"):
        r0.save(2, state(0, 1)).result(timeout=30)
    late = r1.save(2, state(1, 1))
    with pytest.raises(SaveError, match="failed on"):
        late.result(timeout=30)  # its attempt failed on rank 0: that is the truth for it
    h0 = r0.save(2, state(0, 2))
    time.sleep(0.3)
    assert not h0.done()  # rank 1's old record does not complete the new attempt
    h1 = r1.save(2, state(1, 2))
    assert h0.result(timeout=30) == 2
    assert h1.result(timeout=30) == 2  # the first attempt's failure marker is not this one's
    assert h0.attempt != late.attempt and h0.attempt == h1.attempt
    r0.close(), r1.close()
    assert load_value(tmp_path, 2) == {2.0}


def test_two_jobs_on_one_url_fail_loudly_and_keep_the_committed_files(tmp_path):
    # defect 3: two live jobs (different run ids) save the same steps into one URL
    a = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job-a", commit_timeout=30) for r in range(W)]
    b = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job-b", commit_timeout=30) for r in range(W)]
    save_all(a, 1, 1)
    hs = [cp.save(1, state(r, 2)) for r, cp in enumerate(b)]
    with pytest.raises(SaveError, match="another job is saving into"):
        hs[0].result(timeout=30)
    with pytest.raises(SaveError, match="failed on another rank"):
        hs[1].result(timeout=30)
    assert load_value(tmp_path, 1) == {1.0}  # job a's checkpoint is whole
    for cp in a + b:
        cp.close()


def test_an_earlier_jobs_stale_files_do_not_stop_a_new_job_from_re_saving(tmp_path):
    a = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job-a") for r in range(W)]
    save_all(a, 1, 1)
    for cp in a:
        cp.close()
    # the earlier job ended before the new one started: a requeue, not a race
    time.sleep(0.05)
    b = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job-b") for r in range(W)]
    save_all(b, 1, 2)
    b[0].wait()
    assert load_value(tmp_path, 1) == {2.0}
    assert [n for n in os.listdir(tmp_path / "step-000000000001") if n.startswith("job-a.")] == []
    for cp in b:
        cp.close()


def test_rank_0s_own_failure_is_announced_to_the_other_ranks(tmp_path):
    # defect 5: rank 0 fails at once (disk full); rank 1 learns it, not after commit_timeout
    r0 = Checkpointer(str(tmp_path), rank=0, world_size=W, run_id="job", commit_timeout=600)
    r1 = Checkpointer(str(tmp_path), rank=1, world_size=W, run_id="job", commit_timeout=600)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    r0.storage.write_direct = full
    r0.storage.write_stream = full
    h0, h1 = r0.save(1, state(0, 1)), r1.save(1, state(1, 1))
    t0 = time.monotonic()
    with pytest.raises(SaveError, match="No space left"):
        h0.result(timeout=30)
    with pytest.raises(SaveError, match="rank 0 failed while writing.*No space left"):
        h1.result(timeout=10)
    assert time.monotonic() - t0 < 10
    r0.close(), r1.close()


def test_process_exit_waits_a_bounded_time_for_a_save_that_cannot_commit(tmp_path):
    # defect 5: rank 1 never writes; the exit of rank 0 waits exit_timeout, not commit_timeout
    script = textwrap.dedent(f"""
        import torch
        from flexckpt import Checkpointer
        ck = Checkpointer({str(tmp_path)!r}, rank=0, world_size=2, run_id="job", commit_timeout=60, exit_timeout=1)
        ck.save(1, {{"w": torch.ones(4)}}).wait_staged()
        print("saved", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout.readline().strip() == "saved"
    t0 = time.monotonic()
    try:
        proc.wait(30)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 10  # exit_timeout=1 plus interpreter teardown


def _requeued_launch(rank: int, world: int, url: str, savers: list[int]) -> str:
    """One launch of a job whose torchrun run id and restart count repeat (a requeue):
    only ranks in ``savers`` save step 1; returns rank 0's outcome."""
    ck = Checkpointer(url, commit_timeout=1.0, exit_timeout=1)
    assert ck.run_id == "slurm4242-0"
    outcome = "not saving"
    if rank in savers:
        h = ck.save(1, {"w": ShardedTensor.from_global(torch.full((64,), float(len(savers))), Shard(0), rank, world)})
        h.wait_staged()
        if rank == 0:
            try:
                h.result(timeout=30)
                outcome = "committed"
            except SaveError as e:
                outcome = f"failed: {e}"
        else:
            h._done.wait(30)  # its record is written
    ck.close(timeout=5)
    return outcome


def test_a_requeued_job_with_the_same_torchrun_id_never_uses_the_earlier_launchs_records(tmp_path):
    # defect 2: both launches get run id slurm4242-0; the first leaves rank 1's record of
    # step 1 behind; in the second, rank 1 never saves: rank 0 must not commit with the old record
    from flexshard.spawn import run_workers

    env = {"TORCHELASTIC_RUN_ID": "slurm4242", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = run_workers(_requeued_launch, 2, str(tmp_path), [1], timeout=120, env=env)
    assert first == ["not saving", "not saving"]
    second = run_workers(_requeued_launch, 2, str(tmp_path), [0], timeout=120, env=env)
    assert second[0].startswith("failed") and "missing" in second[0], second
    assert Checkpointer(str(tmp_path)).steps() == []


def _data_files(root, step):
    return sorted(p.relative_to(root).as_posix() for p in (root / f"step-{step:012d}").glob("*/r*.data"))


def test_two_live_jobs_at_different_steps_fail_loudly_and_delete_nothing_of_each_other(tmp_path):
    # issue 14 defect 1: job a commits step 20 and saves 21 while job b (another run id) is
    # half-way through step 10. Before: a's retention deleted b's step-10 folder, both of b's
    # result() calls succeeded, step 10 did not load (MissingFile), and b's keep_last=1 then
    # deleted b's own step 10 because a's steps were higher
    a = Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="job-a", keep_last=1, commit_timeout=30)
    a.save(20, {"w": torch.ones(64), "step": 20}).result(timeout=30)
    b = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job-b", keep_last=1, commit_timeout=30)
         for r in range(W)]
    h0 = b[0].save(10, state(0, 10))
    deadline = time.monotonic() + 30
    while len(_data_files(tmp_path, 10)) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    b_files = _data_files(tmp_path, 10)
    assert len(b_files) == 1  # rank 0 of job b wrote its data; it waits for rank 1's record
    with pytest.raises(SaveError, match=r"another job is saving into .*run 'job-b' wrote step-000000000010/job-b\."):
        a.save(21, {"w": torch.ones(64), "step": 21}).result(timeout=30)
    a.wait()
    assert _data_files(tmp_path, 10) == b_files  # nothing of job b was deleted
    h1 = b[1].save(10, state(1, 10))
    # job a wrote step 21's folder after job b started: b's commit fails loudly too
    with pytest.raises(SaveError, match=r"run 'job-a' wrote step-000000000021/job-a\."):
        h0.result(timeout=30)
    with pytest.raises(SaveError, match="failed on another rank"):
        h1.result(timeout=30)
    assert Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="reader").steps() == [20]
    for cp in [a] + b:
        cp.close()


def test_the_live_job_check_lists_only_the_step_folders_it_has_not_listed_before(tmp_path, monkeypatch):
    # it listed every step folder at every commit: on an object store, LIST requests growing
    # with the steps kept (keep_last=None keeps them all)
    import flexckpt.save.committer as committer
    listed, inside = [], []
    real_list, real_check = Storage.list_names, committer.other_live_job

    def counting_list(self, rel=""):
        if inside:
            listed.append(rel)
        return real_list(self, rel)

    def check(*args, **kwargs):
        inside.append(True)
        try:
            return real_check(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(Storage, "list_names", counting_list)
    monkeypatch.setattr(committer, "other_live_job", check)
    ck = Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="job")
    per_commit = []
    for step in range(1, 7):
        listed.clear()
        ck.save(step, {"w": torch.ones(64), "step": step}).result(timeout=30)
        per_commit.append(list(listed))
    ck.close()
    assert per_commit == [["", f"step-{s:012d}"] for s in range(1, 7)]


def test_retention_removes_only_this_runs_failed_saves_and_stale_folders(tmp_path):
    from flexckpt.save.cleanup import apply_retention

    root = tmp_path
    with Checkpointer(str(root), rank=0, world_size=1, run_id="me", commit_timeout=60) as ck:
        for step in (1, 2, 5):
            ck.save(step, {"w": torch.ones(8), "step": step}).result(timeout=30)
        ck.wait()
        since = ck._committer.since
        attempt = ck._pipeline.in_flight.handles[-1].attempt
    planted = {  # step 3 and 4 are uncommitted, older than the newest commit (5)
        "step-000000000003/me.00000001.1": ("failed", 0),  # this run's failed save: goes
        "step-000000000003/me.00000001.2": ("", 0),  # this run's save in flight: stays
        "step-000000000004/other.00000002.1": ("", 0),  # another job's save in flight: stays
        "step-000000000004/other.00000003.1": ("", 120),  # untouched for over commit_timeout: goes
    }
    for rel, (marker, age) in planted.items():
        folder = root / rel
        folder.mkdir(parents=True)
        (folder / "r00000.data").write_bytes(b"\1" * 64)
        if marker:
            (folder / marker).write_bytes(b"rank 0 failed")
        if age:
            for p in (*folder.iterdir(), folder):
                os.utime(p, (time.time() - age, time.time() - age))
    # another job committed step 1 again after this job started; keep_last=1 must keep it
    path = root / "step-000000000001" / "manifest.json"
    doc = orjson.loads(unseal(path.read_bytes())[0])
    doc["run_id"], doc["attempt"] = "zz", "zz." + doc["attempt"].split(".", 1)[1]
    os.rename(root / "step-000000000001" / doc["attempt"].replace("zz.", "me.", 1), root / "step-000000000001" / doc["attempt"])
    path.write_bytes(seal(orjson.dumps(doc)))
    assert read_manifest(Storage(str(root)), 1).run_id == "zz"
    apply_retention(Storage(str(root)), 1, 5, attempt, since, 60.0)
    left = sorted(p.relative_to(root).as_posix() for p in root.glob("step-*/*.*.*"))
    assert [p for p in left if not p.startswith(("step-000000000001", "step-000000000005"))] == [
        "step-000000000003/me.00000001.2", "step-000000000004/other.00000002.1"]
    assert (root / "step-000000000001" / "manifest.json").exists()  # another job's, committed since: kept
    assert not (root / "step-000000000002").exists()  # this job's, beyond keep_last: gone


@pytest.mark.parametrize("order", [(10, 9), (9, 10)], ids=["larger step first", "smaller step first"])
def test_two_saves_in_flight_in_either_order_both_commit_and_load(tmp_path, order):
    # issue 14 defect 6: step 10's retention took step 9's folder (in flight) for a leftover
    # and deleted it while it was written: step 9 failed with a bare ENOENT (5 of 5 trials)
    cps = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job", keep_last=1, commit_timeout=30)
           for r in range(W)]
    hs = [cp.save(step, state(r, step)) for step in order for r, cp in enumerate(cps)]
    assert [h.result(timeout=30) for h in hs] == [s for s in order for _ in range(W)]
    cps[0].wait()
    # keep_last=1 never removes the step its commit just wrote: 9 committed after 10 stays
    # until the next commit
    assert cps[0].steps() == ([9, 10] if order == (10, 9) else [10])
    for cp in cps:
        cp.close()
    assert load_value(tmp_path, 10) == {10.0}
    if order == (10, 9):
        assert load_value(tmp_path, 9) == {9.0}
    cps = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job2", keep_last=1) for r in range(W)]
    save_all(cps, 11, 11)
    cps[0].wait()
    assert cps[0].steps() == [11]
    for cp in cps:
        cp.close()


def test_two_threads_saving_interleaved_steps_all_commit(tmp_path):
    # issue 14 defect 6: 26-30 of 60 saves failed with two threads
    import threading

    ck = Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="job", keep_last=2, commit_timeout=30)
    errors, done = [], []

    def saver(steps):
        for s in steps:
            try:
                done.append(ck.save(s, {"w": torch.full((256,), float(s)), "step": s}).result(timeout=30))
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(f"step {s}: {e}")

    threads = [threading.Thread(target=saver, args=(range(first, 41, 2),)) for first in (2, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ck.wait()
    assert len(ck._pipeline._threads) == 3  # one stager, writer and committer: two first saves at once started two sets
    assert errors == [] and sorted(done) == list(range(1, 41))
    steps = ck.steps()
    assert 40 in steps and len(steps) <= 3, steps
    for s in steps:
        target = {"w": torch.zeros(256), "step": 0}
        assert ck.load(target, step=s) == s and target["step"] == s and torch.equal(target["w"], torch.full((256,), float(s)))
    ck.close()


def _wait_any(*events, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not any(e.is_set() for e in events):
        assert time.monotonic() < deadline, "the forced interleaving never happened"
        time.sleep(0.001)


def test_retention_never_removes_the_folder_a_save_is_creating(tmp_path, monkeypatch):
    # issue 14 defect 6, the flake left in the two-thread test above: step 2 committed while
    # the writer of step 1 had made step-…01/ but not yet its attempt folder in it; step 2's
    # retention removed the empty step folder, and step 1 failed with a bare ENOENT. Forced
    # here: the writer stops between the two mkdirs until retention ran (or is held off).
    import threading

    import flexckpt.save.committer as cpmod
    from flexckpt.format.names import step_dir

    ck = Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="job", keep_last=2, commit_timeout=30)
    parent_made, retention_ran, held_off = threading.Event(), threading.Event(), threading.Event()

    class SpyLock:  # the lock that keeps retention and the making of save folders apart
        def __init__(self):
            self._lock = threading.Lock()

        def __enter__(self):
            if not self._lock.acquire(blocking=False):
                held_off.set()  # one side waits for the other: the bad interleaving cannot happen
                self._lock.acquire()

        def __exit__(self, *exc):
            self._lock.release()

    monkeypatch.setattr(ck._committer, "folders_lock", SpyLock())
    step1 = str(tmp_path / step_dir(1)) + os.sep
    real_mkdir, real_retention = os.mkdir, cpmod.apply_retention

    def mkdir(path, *args, **kwargs):
        if os.fspath(path).startswith(step1) and not parent_made.is_set():
            parent_made.set()  # os.makedirs made step-…01/ and found it there; the leaf is next
            _wait_any(retention_ran, held_off)
        return real_mkdir(path, *args, **kwargs)

    def retention(*args, **kwargs):
        _wait_any(parent_made, held_off)
        real_retention(*args, **kwargs)
        retention_ran.set()

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(cpmod, "apply_retention", retention)
    h2 = ck.save(2, {"w": torch.full((64,), 2.0), "step": 2})
    h1 = ck.save(1, {"w": torch.full((64,), 1.0), "step": 1})  # the larger step first, in flight together
    assert (h2.result(timeout=30), h1.result(timeout=30)) == (2, 1)
    ck.wait()
    assert parent_made.is_set() and (retention_ran.is_set() or held_off.is_set())
    assert ck.steps() == [1, 2]  # keep_last=2
    for s in (1, 2):
        target = {"w": torch.zeros(64), "step": 0}
        assert ck.load(target, step=s) == s and torch.equal(target["w"], torch.full((64,), float(s)))
    ck.close()


@pytest.mark.parametrize("first", [7, 5], ids=["keep_last dooms the step re-saved", "another attempt of the step"])
def test_retention_leaves_a_step_with_a_save_in_flight_alone(tmp_path, monkeypatch, first):
    # a save of step 5 is writing its data while a commit's retention runs: step 5 committed
    # earlier and beyond keep_last=1 (a re-save after a rollback), or attempt 1 of step 5
    # committing while attempt 2 is in flight. Retention must not take attempt 2's folder.
    import threading

    import flexckpt.save.committer as cpmod
    import flexckpt.save.pipeline as pipemod
    from flexckpt.format.names import step_dir

    ck = Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="job", keep_last=1, commit_timeout=30)
    if first == 7:
        ck.save(5, {"w": torch.full((64,), 50.0), "step": 5}).result(timeout=30)
        ck.wait()
    writing, retention_ran = threading.Event(), threading.Event()
    real_write, real_commit, real_retention = pipemod.write_data_file, cpmod.commit, cpmod.apply_retention
    last = f"{step_dir(5)}/job."

    def write_data_file(storage, rel, *args, **kwargs):
        if rel.startswith(last) and ".2/" in rel:  # the second save of step 5
            writing.set()
            _wait_any(retention_ran)
        return real_write(storage, rel, *args, **kwargs)

    def commit(storage, manifest, *args, **kwargs):
        if manifest.step == first and not writing.is_set():  # the commit whose retention runs next
            _wait_any(writing)  # here, not in retention: a writer making its folders waits for that
        return real_commit(storage, manifest, *args, **kwargs)

    def retention(storage, keep_last, newest, *args, **kwargs):
        real_retention(storage, keep_last, newest, *args, **kwargs)
        if newest == first:
            retention_ran.set()

    monkeypatch.setattr(pipemod, "write_data_file", write_data_file)
    monkeypatch.setattr(cpmod, "commit", commit)
    monkeypatch.setattr(cpmod, "apply_retention", retention)
    h_first = ck.save(first, {"w": torch.full((64,), float(first)), "step": first})
    h5 = ck.save(5, {"w": torch.full((64,), 5.0), "step": 5})
    assert (h_first.result(timeout=30), h5.result(timeout=30)) == (first, 5)
    ck.wait()
    assert ck.steps() == ([5, 7] if first == 7 else [5])  # 5 committed after 7 stays until the next commit
    target = {"w": torch.zeros(64), "step": 0}
    assert ck.load(target, step=5) == 5 and torch.equal(target["w"], torch.full((64,), 5.0))
    assert h5.attempt.endswith(".2") and read_manifest(Storage(str(tmp_path)), 5).attempt == h5.attempt
    ck.close()


def test_another_ranks_writer_survives_retention_removing_its_empty_step_folder(tmp_path, monkeypatch):
    # ranks are processes: rank 1 starts step 9 before rank 0 does (rank 0's save of it not in
    # flight yet) and makes step-…09/ just as rank 0's retention after step 10 removes that
    # empty folder; rank 1 makes it again instead of failing with ENOENT
    import threading

    import flexckpt.save.committer as cpmod
    from flexckpt.format.names import step_dir

    cps = [Checkpointer(str(tmp_path), rank=r, world_size=W, run_id="job", keep_last=1, commit_timeout=30)
           for r in range(W)]
    parent_made, retention_ran = threading.Event(), threading.Event()
    step9 = str(tmp_path / step_dir(9)) + os.sep
    real_mkdir, real_retention = os.mkdir, cpmod.apply_retention

    def mkdir(path, *args, **kwargs):
        if os.fspath(path).startswith(step9) and not parent_made.is_set():
            parent_made.set()
            _wait_any(retention_ran)
        return real_mkdir(path, *args, **kwargs)

    def retention(storage, keep_last, newest, *args, **kwargs):
        if newest == 10:
            _wait_any(parent_made)
        real_retention(storage, keep_last, newest, *args, **kwargs)
        retention_ran.set()

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(cpmod, "apply_retention", retention)
    h10 = [cp.save(10, state(r, 10)) for r, cp in enumerate(cps)]
    h9 = [cps[1].save(9, state(1, 9))]
    assert h10[0].result(timeout=30) == 10
    cps[0].wait()
    assert retention_ran.is_set()
    h9.insert(0, cps[0].save(9, state(0, 9)))
    assert [h.result(timeout=30) for h in h10 + h9] == [10, 10, 9, 9]
    cps[0].wait()
    assert cps[0].steps() == [9, 10]
    for cp in cps:
        cp.close()
    assert load_value(tmp_path, 9) == {9.0} and load_value(tmp_path, 10) == {10.0}


def _plant_stale(root, age=1000):
    """An attempt folder of another job, untouched for ``age`` seconds, in committed step 5,
    and an empty uncommitted step folder: what a normal start (its coordinator) removes."""
    stale = root / "step-000000000005" / "old.0000abcd.1"
    stale.mkdir(parents=True)
    (stale / "r00000.data").write_bytes(b"\1" * 64)
    for p in (stale / "r00000.data", stale):
        os.utime(p, (time.time() - age, time.time() - age))
    empty = root / "step-000000000003"
    empty.mkdir()
    return stale, empty


def test_a_read_only_open_changes_nothing_where_a_normal_start_reclaims(tmp_path):
    with Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="job") as ck:
        ck.save(5, {"w": torch.full((64,), 5.0), "step": 5}).result(timeout=30)
    stale, empty = _plant_stale(tmp_path)
    with Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="reader", commit_timeout=60, read_only=True) as ck:
        target = {"w": torch.zeros(64), "step": 0}
        assert ck.load(target) == 5 and target["step"] == 5 and target["w"].tolist() == [5.0] * 64
        with pytest.raises(RuntimeError, match=rf"^this Checkpointer of {tmp_path} was opened read_only=True: open "
                                               rf"one without read_only to save$"):
            ck.save(6, target)
    assert stale.is_dir() and empty.is_dir()
    Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="writer", commit_timeout=60).close()
    assert not stale.exists() and not empty.exists()


def test_read_only_with_a_fast_tier_is_refused(tmp_path):
    from flexckpt.tier import LocalTier

    with pytest.raises(ValueError, match=r"^read_only=True writes nothing, and a fast tier \(local=\) saves: drop one "
                                         r"of them$"):
        Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="r", read_only=True, local=LocalTier(dir=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_a_rank_whose_files_vanish_after_rank_0_failed_the_commit_reports_rank_0s_cause(tmp_path, monkeypatch):
    """Rank 0's commit fails and it removes the save's files; rank 1, still writing its chunk
    table, then fails on a missing file. Its handle names rank 0's failure (the cause), not
    only its own missing file (seen in CI: a race between the two)."""
    import flexckpt.save.committer as committer
    import flexckpt.save.pipeline as pipeline
    from flexckpt.save.commit import failure_message

    real_gather, real_write = committer.gather, pipeline.write_rank_files

    def failing_gather(*a, **k):
        raise OSError("storage hiccup")

    def late_write(storage, folder, *, rank, attempt, **k):
        if rank == 1:  # rank 1's table is written only after rank 0 announced its failure
            deadline = time.monotonic() + 20
            while failure_message(storage, int(folder.rsplit("-", 1)[1]), attempt) is None:
                assert time.monotonic() < deadline, "rank 0 never announced its failure"
                time.sleep(0.01)
            raise FileNotFoundError(2, "No such file or directory", f"{folder}/r00001.table")
        return real_write(storage, folder, rank=rank, attempt=attempt, **k)

    monkeypatch.setattr(committer, "gather", failing_gather)
    monkeypatch.setattr(pipeline, "write_rank_files", late_write)
    url = str(tmp_path / "ck")
    cks = [Checkpointer(url, rank=r, world_size=2, run_id="race", commit_timeout=20) for r in range(2)]
    try:
        hs = [ck.save(1, {"w": ShardedTensor(torch.ones(4), Shard(0), (8,), r, 2)}) for r, ck in enumerate(cks)]
        with pytest.raises(SaveError, match="storage hiccup"):
            hs[0].result(timeout=30)
        with pytest.raises(SaveError, match=r"rank 0 failed while committing: OSError: storage hiccup \(then this rank, "
                                            r"while writing its chunk table: FileNotFoundError"):
            hs[1].result(timeout=30)
    finally:
        monkeypatch.setattr(committer, "gather", real_gather)
        for ck in cks:
            ck.close()
