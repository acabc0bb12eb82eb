"""flexckpt under faults (issue 11): run ids with a trailing newline (11), data files that link
out of the root (12), Checkpointers dropped without close() (7), storage calls that stall (6),
on a local folder and against the moto S3 server behind a fault-injecting proxy."""
import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
import s3fs
import torch

from fault_proxy import FaultProxy
from flexckpt import Checkpointer, SaveError
from flexckpt.format.names import attempt_id, check_run_id, data_name, step_dir
from flexckpt.storage import OutsideRoot, Storage
from flexckpt.storage_stall import StorageStalled
from flexshard.spawn import run_workers


# ---- 11: run ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["job42\n", "job42\n\n", "\njob42", "a" * 65])
def test_a_run_id_with_a_trailing_newline_or_other_extra_is_refused(bad, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"run id must match"):
        check_run_id(bad)
    monkeypatch.setenv("FLEXCKPT_RUN_ID", bad)
    with pytest.raises(ValueError, match=r"run id must match"):
        Checkpointer(str(tmp_path))


# ---- 12: symbolic links --------------------------------------------------------------------


def test_a_data_file_linking_out_of_the_root_is_refused_and_a_linked_root_is_fine(tmp_path):
    state = {"w": torch.arange(1000.0)}
    for name in ("inside", "outside"):
        with Checkpointer(str(tmp_path / name), run_id="job") as ck:
            ck.save(1, state).result(timeout=30)
    # the root reached through a link loads
    os.symlink(tmp_path / "inside", tmp_path / "linked")
    with Checkpointer(str(tmp_path / "linked"), run_id="job") as ck:
        target = {"w": torch.zeros(1000)}
        assert ck.load(target) == 1 and torch.equal(target["w"], state["w"])
    # identical bytes outside the root, behind a link: followed and loaded before the fix
    (data,) = (tmp_path / "inside" / step_dir(1)).glob("job.*.1/r00000.data")
    (outside,) = (tmp_path / "outside" / step_dir(1)).glob("job.*.1/r00000.data")
    data.unlink()
    os.symlink(outside, data)
    with Checkpointer(str(tmp_path / "inside"), run_id="job") as ck:
        with pytest.raises(OutsideRoot, match=rf"{data} is a symbolic link to .*outside.*, outside the checkpoint root"):
            ck.load({"w": torch.zeros(1000)})


def test_check_inside_refuses_every_way_out_of_the_root_also_after_its_root_is_resolved_once(tmp_path):
    # the root's real location is kept after the first call; what lies below it is looked at each time
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_bytes(b"x")
    real_root = tmp_path / "real"
    (real_root / "step" / "inner").mkdir(parents=True)
    (real_root / "step" / "f").write_bytes(b"x")
    os.symlink(real_root, tmp_path / "linked")
    storage = Storage(str(tmp_path / "linked"))  # a root that is itself a link is fine
    inside = storage.path("step", "f")
    for _ in range(2):
        storage.check_inside(inside)
    storage.check_inside(storage.path("step", "missing", "f"))  # missing: inside, its open says so
    os.symlink(real_root / "step" / "f", real_root / "step" / "link-in")  # a link that stays inside
    storage.check_inside(storage.path("step", "link-in"))
    storage.check_inside(storage.path("step", "inner", "..", "f"))
    ways_out = {
        "file link": lambda: os.symlink(tmp_path / "outside" / "f", real_root / "step" / "out"),
        "relative file link": lambda: os.symlink("../../outside/f", real_root / "step" / "out"),
        "folder link": lambda: os.symlink(tmp_path / "outside", real_root / "step" / "out"),
        "file swapped for a link after a check": lambda: (
            (real_root / "step" / "out").write_bytes(b"x"), storage.check_inside(storage.path("step", "out")),
            (real_root / "step" / "out").unlink(), os.symlink(tmp_path / "outside" / "f", real_root / "step" / "out")),
    }
    for how, plant in ways_out.items():
        plant()
        rel = ("step", "out", "f") if how == "folder link" else ("step", "out")
        with pytest.raises(OutsideRoot, match=r"is a symbolic link to .*/outside.*, outside the checkpoint root .*/real;"):
            storage.check_inside(storage.path(*rel))
        (real_root / "step" / "out").unlink()
    for rel in ("../outside/f", "step/../../outside/f", "step//../../outside/f"):
        with pytest.raises(OutsideRoot, match="outside the checkpoint root"):
            storage.check_inside(storage.path(rel))
    with pytest.raises(OutsideRoot):
        Storage(str(real_root)).check_inside(str(tmp_path / "outside" / "f"))  # not below the root at all
    Storage("memory://x").check_inside("/anything")  # object stores have no links


def test_a_save_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    root = tmp_path / "ckpt"
    with Checkpointer(str(root), run_id="job", direct_io=False) as ck:
        # the attempt's own folder, with a link where its data file will go
        data = root / step_dir(1) / data_name(attempt_id("job", ck.session, 1), 0)
        data.parent.mkdir(parents=True)
        os.symlink(victim, data)
        with pytest.raises(SaveError, match=r"Too many levels of symbolic links|ELOOP"):
            ck.save(1, {"w": torch.ones(100)}).result(timeout=30)
    assert victim.read_bytes() == b"precious"


# ---- 7: thread lifetime --------------------------------------------------------------------


def test_checkpointers_dropped_without_close_are_freed_with_their_threads(tmp_path):
    def threads():  # storage-call helpers are shared by every Checkpointer and end when idle
        return sum(t.name != "flexckpt-storage-call" for t in threading.enumerate())

    gc.collect()
    before = threads()
    refs = []
    for i in range(20):
        ck = Checkpointer(str(tmp_path / str(i)))
        ck.save(1, {"w": torch.ones(256, 1024)}).result(timeout=30)  # 1 MiB staging buffer each
        refs.append(weakref.ref(ck))
        del ck
    def helpers():  # idle ones end after IDLE_EXIT_S (earlier tests' too: waited for below)
        return sum(t.name == "flexckpt-storage-call" for t in threading.enumerate())

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()
        if not any(r() for r in refs) and threads() <= before and helpers() <= 4:
            break
        time.sleep(0.05)
    # before the fix: all 20 alive, with 60 threads (stager, writer, committer each)
    assert sum(r() is not None for r in refs) == 0
    assert threads() == before
    assert helpers() <= 4, helpers()  # a few reused helper threads, not some per checkpointer


def test_a_save_its_checkpointer_dropped_fails_on_its_handle_instead_of_hanging(tmp_path):
    """Its threads may still finish it (each holds the Checkpointer while it works on the
    save); otherwise the handle fails naming the fix. Before the fix: no result ever (a plain
    result() waited for ever)."""
    handle = Checkpointer(str(tmp_path), run_id="gone").save(1, {"w": torch.ones(1000)})  # freed at once
    gc.collect()
    try:
        assert handle.result(timeout=30) == 1
    except SaveError as e:
        assert str(e) == ("save of step 1 failed: the Checkpointer was freed without close() before this save "
                          "finished; keep a reference to it and call close() (or use it in a with block) to finish "
                          "its saves")


def test_a_process_that_exits_without_close_still_commits_its_saves_in_flight(tmp_path):
    code = (
        "import torch\n"
        "from flexckpt import Checkpointer\n"
        f"ck = Checkpointer({str(tmp_path)!r}, run_id='exit')\n"
        "ck.save(1, {'w': torch.arange(100000.0)})\n"  # no result(), no close(): exit waits for it
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    with Checkpointer(str(tmp_path), run_id="exit") as ck:
        target = {"w": torch.zeros(100000)}
        assert ck.load(target) == 1 and torch.equal(target["w"], torch.arange(100000.0))


# ---- 6: stall timeout ----------------------------------------------------------------------


def _slow_parts(pause: float, n: int):
    for _ in range(n):
        time.sleep(pause)
        yield memoryview(b"x" * 1000)


def test_the_stall_timeout_bounds_no_progress_not_the_total(tmp_path):
    storage = Storage(str(tmp_path), stall_timeout=1.0)
    t0 = time.monotonic()
    assert storage.write_stream("moving", _slow_parts(0.3, 6), fsync=False) == 6000  # 1.8 s in all, moving
    assert time.monotonic() - t0 > 1.5
    t0 = time.monotonic()
    with pytest.raises(StorageStalled, match=r"storage call write_stream\('stuck'\) on .* made no progress for 1 s"):
        storage.write_stream("stuck", _slow_parts(5.0, 1), fsync=False)
    assert time.monotonic() - t0 < 3.0


def test_a_stalled_write_fails_its_save_on_the_handle_and_training_goes_on(tmp_path, monkeypatch):
    release = threading.Event()
    real = Storage.write_stream

    def stuck_once(self, rel, parts, fsync=True):
        def parts_after_release():  # consumed inside the watched call, as the writer's are
            if not release.is_set():
                release.wait(30)  # an NFS server that went away
            yield from parts

        return real(self, rel, parts_after_release(), fsync)

    monkeypatch.setattr(Storage, "write_stream", stuck_once)
    with Checkpointer(str(tmp_path), stall_timeout=1.0, direct_io=False) as ck:
        t0 = time.monotonic()
        handle = ck.save(1, {"w": torch.ones(100)})
        handle.wait_staged()
        assert time.monotonic() - t0 < 1.0  # the training thread is not held by the stall
        with pytest.raises(SaveError, match=r"save of step 1 failed: storage call write_stream\(.*made no progress for 1 s"):
            handle.result(timeout=10)
        assert time.monotonic() - t0 < 5
        release.set()
        ck.save(2, {"w": torch.full((100,), 2.0)}).result(timeout=30)
        target = {"w": torch.zeros(100)}
        assert ck.load(target) == 2 and torch.equal(target["w"], torch.full((100,), 2.0))


# ---- 6 and bounded retries: S3 through a fault-injecting proxy -------------------------------


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultProxy(s3_endpoint)
    yield p
    p.stop()


BACKOFF_SCALE = 0.01


@pytest.fixture
def quick_backoff(monkeypatch):
    """botocore's and s3fs's back-off waits between tries, each one hundredth of what it asks
    (up to 8 s a try in botocore's default mode: some 10 s a test); how many tries, and which
    errors are retried, stay as configured. Returns the waits asked for, in seconds."""
    import asyncio
    import types

    import aiobotocore.endpoint
    import s3fs.core

    asked = []

    async def sleep(delay, *args, **kwargs):
        asked.append(delay)
        await asyncio.sleep(delay * BACKOFF_SCALE, *args, **kwargs)

    async def endpoint_sleep(self, delay):
        await sleep(delay)

    quick = types.ModuleType("asyncio")  # what s3fs's retry loops see as the asyncio module
    quick.__dict__.update(vars(asyncio))
    quick.sleep = sleep
    monkeypatch.setattr(aiobotocore.endpoint.AioEndpoint, "_sleep", endpoint_sleep)
    monkeypatch.setattr(s3fs.core, "asyncio", quick)
    return asked


def _s3(proxy, s3_options, **extra):
    opts, bucket = s3_options
    return dict(opts, client_kwargs={"endpoint_url": proxy.url}, skip_instance_cache=True, **extra), bucket


def test_s3_5xx_and_resets_are_retried_and_the_checkpoint_is_bit_exact(proxy, s3_options, quick_backoff):
    opts, bucket = _s3(proxy, s3_options)
    state = {"w": torch.randn(4000), "b": torch.arange(77, dtype=torch.int16)}
    faults = {1: "503", 4: "500", 6: "reset"}
    proxy.set(lambda method, path, n: faults.get(n % 7))  # 3 in every 7 requests fail
    with Checkpointer(f"s3://{bucket}/flaky", storage_options=opts, chunk_bytes=4096, stall_timeout=20) as ck:
        for step in (1, 2):
            ck.save(step, state).result(timeout=120)
        target = {"w": torch.zeros(4000), "b": torch.zeros(77, dtype=torch.int16)}
        assert ck.load(target) == 2
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    print(f"s3 flaky: {len(proxy.requests)} requests, faults injected {proxy.faults}, "
          f"{len(quick_backoff)} back-offs asking {sum(quick_backoff):.1f} s in all")
    assert proxy.faults["503"] >= 3 and proxy.faults["reset"] >= 3
    assert len(quick_backoff) >= 3  # each fault was retried after a back-off, not given up


def test_s3_a_put_that_never_answers_fails_the_save_within_the_stall_timeout(proxy, s3_options):
    opts, bucket = _s3(proxy, s3_options)
    url = f"s3://{bucket}/hung"
    proxy.set(lambda method, path, n: "hang" if method == "PUT" and path.endswith(".data") else None)
    with Checkpointer(url, storage_options=opts, stall_timeout=3.0) as ck:  # 3 s: a busy 2-core machine stays under it
        t0 = time.monotonic()
        handle = ck.save(1, {"w": torch.ones(1000)})
        with pytest.raises(SaveError, match=r"storage call write_stream\('step-0+1/.*\.data'\) .* made no progress for 3 s"):
            handle.result(timeout=60)  # before the fix: pending for minutes (411 s seen)
        took = time.monotonic() - t0
        proxy.set(lambda method, path, n: None)  # the endpoint recovers: training went on, saves work
        ck.save(2, {"w": torch.full((1000,), 2.0)}).result(timeout=60)
        assert ck.steps() == [2]
    print(f"s3 hung PUT: failed after {took:.2f} s, faults injected {proxy.faults}")
    assert took < 10 and proxy.faults["hang"] == 1


def test_s3_an_endpoint_that_always_fails_fails_the_save_after_bounded_retries(proxy, s3_options, quick_backoff):
    opts, bucket = _s3(proxy, s3_options, config_kwargs={"retries": {"max_attempts": 1}})
    proxy.set(lambda method, path, n: "503" if method == "PUT" else None)
    with Checkpointer(f"s3://{bucket}/down", storage_options=opts, stall_timeout=30) as ck:
        t0 = time.monotonic()
        with pytest.raises(SaveError, match=r"Please reduce your request rate"):
            ck.save(1, {"w": torch.ones(1000)}).result(timeout=120)
        took = time.monotonic() - t0
    puts = sum(1 for method, path, _ in proxy.requests if method == "PUT" and path.endswith(".data"))
    print(f"s3 always 503: failed after {took:.2f} s and {puts} PUT attempts of the data file, "
          f"back-offs asking {sum(quick_backoff):.1f} s in all")
    # s3fs: 5 tries per upload (the close after the failure tries once more), botocore retries off;
    # with the waits as asked (not a hundredth of them) it still fails within 20 s
    assert 2 <= puts <= 10 and took + sum(quick_backoff) < 20


# ---- 1 again: a relaunch under the same FLEXCKPT_RUN_ID re-saves a committed step --------------


def _relaunch(rank, world, root, version):
    from flexckpt.catalog import read_manifest

    ck = Checkpointer(root)  # run id from FLEXCKPT_RUN_ID, the world from torch.distributed
    state = {"w": torch.full((1000,), float(version)), "v": version}
    if version == 0:
        for step in (1, 2):
            ck.save(step, state).result(timeout=60)
    else:  # roll back to step 1, then save step 2 again
        ck.load({"w": torch.zeros(1000), "v": -1}, step=1)
        before = read_manifest(ck.storage, 2).attempt
        handle = ck.save(2, state)
        handle.result(timeout=60)
        ck.wait()
        return {"committed_before": before, "resave": handle.attempt}
    ck.close()
    return None


def test_a_relaunch_under_the_same_run_id_never_re_saves_into_the_committed_attempt(tmp_path):
    # before: the session digits were a hash of the run id, so the relaunch's first save of
    # step 2 was attempt "job42.<same>.1", the committed one, and wrote into its files
    env = {"FLEXCKPT_RUN_ID": "job42"}
    run_workers(_relaunch, 2, str(tmp_path), 0, timeout=120, env=env)
    out = run_workers(_relaunch, 2, str(tmp_path), 1, timeout=120, env=env)
    assert out[0]["committed_before"].startswith("job42.") and out[0]["committed_before"].endswith(".1")
    assert out[0]["resave"] != out[0]["committed_before"] and out[0]["resave"] == out[1]["resave"]
    with Checkpointer(str(tmp_path), run_id="reader") as ck:
        target = {"w": torch.zeros(1000), "v": -1}
        assert ck.load(target) == 2 and target["v"] == 1 and torch.equal(target["w"], torch.full((1000,), 1.0))
