"""Disk full (issue 11): a save that hits ENOSPC fails on its handle, training goes on, and
saves work again once space is back. On a real tmpfs when the tests may mount one, else
through a ``Storage`` wrapper that raises ENOSPC (see ``conftest.small_disk``)."""
import time

import pytest
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


def _full_then_freed(small_disk, mib, taken):
    """A 20 MiB disk, ``keep_last=1``, checkpoints of ``mib`` MiB: steps 1 and 2 commit, another
    process takes ``taken`` MiB and step 3 fails with ENOSPC on its handle, the space comes
    back, step 4 must commit and load."""
    disk = small_disk(20 * MiB)
    with Checkpointer(str(disk.path / "ckpt"), keep_last=1) as ck:
        for step in (1, 2):
            _save(ck, step, mib).result(timeout=60)
        ck.wait()  # retention of step 1 included
        disk.fill(taken * MiB)
        with pytest.raises(SaveError, match=r"No space left on device"):
            _save(ck, 3, mib).result(timeout=60)
        disk.free()
        _save(ck, 4, mib).result(timeout=60)
        target = _state(0, mib)
        assert ck.load(target) == 4 and torch.equal(target["w"], _state(4, mib)["w"])
    print(f"disk full via {disk.kind}")


def test_enospc_fails_the_save_on_its_handle_and_saves_resume_when_space_is_back(small_disk):
    _full_then_freed(small_disk, mib=4, taken=14)


@pytest.mark.xfail(reason="issue 11 defect 4: a failed save's partial files stay until a later commit, so "
                          "later saves keep failing (the second part of issue 11, on the new format)", strict=False)
def test_one_disk_full_does_not_stop_every_later_save(small_disk):
    _full_then_freed(small_disk, mib=8, taken=6)  # the figures: 20 MB disk, 8 MB checkpoints, 6 MB taken
