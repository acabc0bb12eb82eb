"""What a user is told (issue 25): a mismatch names its real cause and fix, ``strict=False``
never drops saved state silently, and an error raised to the caller is not also logged."""
import logging

import pytest
import torch

from flexckpt import Checkpointer, LoadError, StructureMismatch


def _model_and_adamw(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _trained(tmp_path):
    """Step 10 of a model and AdamW that took one step; returns the saved moments."""
    model, opt = _model_and_adamw(0)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(10, {"model": model, "optim": opt, "step": 10}).result()
    return {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}


def test_a_fresh_optimizer_is_told_how_to_create_its_state_and_following_it_loads_the_moments(tmp_path):
    saved = _trained(tmp_path)
    model, opt = _model_and_adamw(1)  # a restart: the optimizer has no state yet
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(StructureMismatch) as e:
            ck.load({"model": model, "optim": opt, "step": 0})
        msg = str(e.value)
        assert "'optim/state/0/exp_avg'" in msg and "the optimizer under 'optim' has no state yet" in msg
        assert "get_optimizer_state_dict(model, optimizer)" in msg and "README's FSDP2 section" in msg
        assert "\n" not in msg
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        get_optimizer_state_dict(model, opt)  # what the message says: creates the state in place
        state = {"model": model, "optim": opt, "step": 0}
        assert ck.load(state) == 10 and state["step"] == 10
    got = opt.state_dict()["state"][0]
    assert torch.equal(got["exp_avg"], saved["exp_avg"]) and torch.equal(got["exp_avg_sq"], saved["exp_avg_sq"])


def test_strict_false_lists_and_counts_the_saved_keys_it_left_out(tmp_path, caplog):
    _trained(tmp_path)
    model, opt = _model_and_adamw(1)
    state = {"model": model, "optim": opt, "step": 0}
    with Checkpointer(str(tmp_path)) as ck, caplog.at_level(logging.WARNING, logger="flexckpt"):
        assert ck.load(state, strict=False) == 10 and state["step"] == 10
        stats = ck.last_load_stats
    left = [f"optim/state/{p}/{k}" for p in (0, 1) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert stats.not_loaded == sorted(left) and stats.missing == [] and stats.skipped == sorted(left)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "left out 6 key(s) the checkpoint holds" in warnings[0]


def _cli(argv):
    import contextlib
    import io

    from flexckpt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def _files(path):
    import os

    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", [["--world", "4", "--mesh", "fsdp=2,tp=2", "--layout", "*=S0,S1"],
                                    ["--budget-mib", "0"]], ids=["onto-a-mesh", "in-batches"])
def test_import_dcp_onto_a_full_disk_fails_at_once_in_one_line_and_leaves_nothing(tmp_path, small_disk, target):
    """Issue 25 item 16: one writer's ENOSPC, whose failure marker does not fit either, made
    the import's other writers wait out commit_timeout (600 s), and left their files."""
    import time

    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    dcp.save({"model": {n: torch.randn(512, 512, generator=g) for n in ("wq", "wk", "wv", "wo")}, "step": 5},
             checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # 4 MiB
    disk = small_disk(5 << 19)  # 2.5 MiB: ranks 3 and 2 (or two batches) fit, the next does not
    url = str(disk.path / "ckpt")
    t0 = time.monotonic()
    rc, err = _cli(["import-dcp", str(tmp_path / "dcp"), url, *target])
    took = time.monotonic() - t0
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    assert took < 30, took
    assert _files(disk.path) == [], _files(disk.path)  # nothing written stays, the folder it made neither


def test_an_error_raised_by_load_is_not_also_logged(tmp_path, caplog):
    from flexckpt import ChecksumError
    from flexckpt.catalog import read_manifest
    from flexckpt.format.names import data_name, step_dir

    with Checkpointer(str(tmp_path), chunk_bytes=256) as ck:
        ck.save(1, {"w": torch.arange(200.0)}).result()
        data = tmp_path / step_dir(1) / data_name(read_manifest(ck.storage, 1).attempt, 0)
        raw = bytearray(data.read_bytes())
        raw[300] ^= 0xFF
        data.write_bytes(bytes(raw))
        with caplog.at_level(logging.INFO, logger="flexckpt"), pytest.raises(ChecksumError):
            ck.load({"w": torch.zeros(200)})
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_listing_that_fails_is_raised_with_its_cause_not_logged(tmp_path, caplog, monkeypatch):
    from flexckpt.storage import Storage

    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"w": torch.ones(2)}).result()
        ck.wait()  # retention too
        monkeypatch.setattr(Storage, "list_names", lambda self, rel="": (_ for _ in ()).throw(PermissionError(13, "denied")))
        with caplog.at_level(logging.INFO, logger="flexckpt"), pytest.raises(LoadError, match="could not list .*denied"):
            ck.load({"w": torch.zeros(2)})
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_failure_marker_whose_message_does_not_fit_is_written_empty_and_still_read(small_disk):
    """Another process's ranks learn of the failure from the marker alone: on a full disk it
    is written empty rather than not at all (which left them waiting for commit_timeout)."""
    from flexckpt.save import commit
    from flexckpt.storage import Storage

    disk = small_disk(1 << 20)
    storage = Storage(str(disk.path / "ckpt"))
    storage.makedirs("step-000000000003")
    disk.fill((1 << 20) - disk.used())  # full to the last byte
    commit.mark_failed(storage, 3, "job.0badf00d.1", "rank 2 failed while writing: OSError: No space left on device")
    getattr(commit, "_FAILED_HERE", {}).clear()  # as another process sees it: from the store alone
    got = commit.failure_message(Storage(str(disk.path / "ckpt")), 3, "job.0badf00d.1")
    assert got == "save of step 3 failed on another rank: (its message did not fit on the disk)", (disk.kind, got)


def test_a_file_given_for_the_checkpoint_folder_fails_at_construction_in_one_line(tmp_path, caplog):
    from flexckpt import StorageError

    path = tmp_path / "model.ckpt"
    path.write_bytes(b"x")
    with pytest.raises(StorageError, match=r"^.*model\.ckpt is a file, not a folder: a checkpoint is a folder; "
                                           r"pass the path of a folder \(new or holding checkpoints\)$"):
        Checkpointer(str(path), rank=0, world_size=1)
    assert "Traceback" not in caplog.text and "reclaiming" not in caplog.text
    assert path.read_bytes() == b"x"
