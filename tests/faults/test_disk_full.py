"""Disk full (issue 11): a save that hits ENOSPC fails on its handle, training goes on, and
saves work again once space is back. On a real tmpfs when the tests may mount one, else
through a ``Storage`` wrapper that raises ENOSPC (see ``conftest.small_disk``)."""
import os
import time

import torch

from flexckpt import Checkpointer, SaveError

MiB = 1 << 20


def _state(step, mib):
    return {"w": torch.full((mib * MiB // 4,), float(step)), "step": step}


def _save(ck, step, mib):
    t0 = time.monotonic()
    handle = ck.save(step, _state(step, mib))
    assert time.monotonic() - t0 < 5  # save() itself never waits on the disk
    return handle


def _outcome(handle):
    """The save's error once it ended, None if it committed."""
    try:
        handle.result(timeout=60)
    except SaveError as e:
        return e
    return None


def _full_then_freed(small_disk, mib, taken):
    """A 20 MiB disk, ``keep_last=1``, checkpoints of ``mib`` MiB: steps 1 and 2 commit, another
    process takes ``taken`` MiB and step 3 fails on its handle, the space comes back, step 4 is
    saved and loaded. Returns (step 3's error, step 4's error or None, loaded step, loaded w)."""
    disk = small_disk(20 * MiB)
    with Checkpointer(str(disk.path / "ckpt"), keep_last=1) as ck:
        for step in (1, 2):
            _save(ck, step, mib).result(timeout=60)
        ck.wait()  # retention of step 1 included
        disk.fill(taken * MiB)
        full = _outcome(_save(ck, 3, mib))
        disk.free()
        after = _outcome(_save(ck, 4, mib))
        target = _state(0, mib)
        loaded = ck.load(target)
    print(f"disk full via {disk.kind}")
    return full, after, loaded, target["w"]


def test_enospc_fails_the_save_on_its_handle_and_saves_resume_when_space_is_back(small_disk):
    full, after, loaded, w = _full_then_freed(small_disk, mib=4, taken=14)
    assert isinstance(full, SaveError) and "No space left on device" in str(full)
    assert after is None and loaded == 4 and torch.equal(w, _state(4, 4)["w"])


def test_one_disk_full_does_not_stop_every_later_save(small_disk):
    # the figures: 20 MB disk, 8 MB checkpoints, 6 MB taken
    full, after, loaded, w = _full_then_freed(small_disk, mib=8, taken=6)
    assert isinstance(full, SaveError) and "No space left on device" in str(full)
    assert after is None and loaded == 4 and torch.equal(w, _state(4, 8)["w"])


def test_a_restarted_job_on_a_full_disk_reclaims_what_earlier_launches_left(small_disk):
    """An earlier launch of run "job" committed steps 1 and 2 and was killed writing step 3
    (8 MiB left behind, untouched since) and a re-save of step 1 (2 MiB); another job is
    saving step 3 right now (2 MiB, fresh: kept at start-up; the commit of step 3 then treats it
    as the folder of a job that ended before this one started, as issue 10 designed). 20 MiB disk, 4 MiB checkpoints: without
    reclaiming at start-up the restarted job's save fails with ENOSPC."""
    disk = small_disk(20 * MiB)
    root = disk.path / "ckpt"
    with Checkpointer(str(root), keep_last=1, run_id="job") as ck:
        for step in (1, 2):
            _save(ck, step, 4).result(timeout=60)
        ck.wait()
    planted = {"job.0badf00d.1": (3, 8, True), "job.0badf00d.2": (1, 2, False), "other.12345678.1": (3, 2, False)}
    for name, (step, mib, stale) in planted.items():
        folder = root / f"step-{step:012d}" / name
        folder.mkdir(parents=True)
        (folder / "r00000.data").write_bytes(b"\1" * (mib * MiB))
        if stale:  # untouched for longer than commit_timeout
            for p in (folder / "r00000.data", folder):
                os.utime(p, (time.time() - 120, time.time() - 120))
    time.sleep(0.05)
    disk.fill(3 * MiB)
    # 4 (step 2) + 12 planted + 3 taken: 1 MiB free before the restart
    with Checkpointer(str(root), keep_last=1, run_id="job", commit_timeout=60) as ck:
        ck._reclaim.join(60)  # start-up housekeeping runs on a thread of its own
        assert sorted(p.parent.name + "/" + p.name for p in root.glob("step-*/*.*.*")) == [
            "step-000000000002/" + next((root / "step-000000000002").glob("job.*")).name,
            "step-000000000003/other.12345678.1",  # another live job's: kept
        ]
        _save(ck, 3, 4).result(timeout=60)
        target = _state(0, 4)
        assert ck.load(target) == 3 and torch.equal(target["w"], _state(3, 4)["w"])
