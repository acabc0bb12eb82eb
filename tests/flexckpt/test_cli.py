"""The command-line tool on a checkpoint saved by 2 ranks."""
import os

import pytest
import torch

from flexckpt import ByLane, Checkpointer
from flexckpt.cli import main
import orjson

from flexckpt.format.names import MANIFEST, step_dir
from flexshard import BlockShard, Owned, Replicate, Shard, ShardedTensor

GLOBAL = {"emb": torch.randn(300, 16), "norm": torch.randn(16), "w": torch.randn(64, 64), "m": torch.randn(1000)}
SAVED = {"emb": BlockShard(32), "norm": Replicate(), "w": Owned(1), "m": Shard(0)}


def _save(root, step=5):
    cks = [Checkpointer(str(root), rank=r, world_size=2, run_id="cli", chunk_bytes=4096) for r in range(2)]
    hs = [
        ck.save(step, {"model": {k: ShardedTensor.from_global(v, SAVED[k], r, 2) for k, v in GLOBAL.items()},
                       "step": step, "data": ByLane({str(r): {"doc": r}})})
        for r, ck in enumerate(cks)
    ]
    assert [h.result(timeout=30) for h in hs] == [step, step]
    for ck in cks:
        ck.close()


def test_steps_inspect_and_plan_describe_the_checkpoint(tmp_path, capsys):
    _save(tmp_path)
    assert main(["steps", str(tmp_path)]) == 0
    assert "world 2" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "step 5 of run cli, saved by 2 ranks" in out and "4 tensors" in out
    assert "('model', 'w')" in out and "Owned(owner=1)" in out and "per-lane ('data',): 2 lanes (0, 1)" in out
    assert main(["plan", str(tmp_path), "--world", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert main(["plan", str(tmp_path), "--world", "1"]) == 0
    assert capsys.readouterr().out.startswith("restore of step 5 (saved by 2 ranks) on 1 rank:\n")


def test_verify_finds_a_damaged_chunk(tmp_path, capsys):
    _save(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert "ok" in capsys.readouterr().out
    attempt = orjson.loads((tmp_path / step_dir(5) / MANIFEST).read_bytes())["attempt"]
    path = tmp_path / step_dir(5) / attempt / "r00001.data"
    raw = bytearray(path.read_bytes())
    raw[10] ^= 1
    path.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path), "--all"]) == 1
    assert "DAMAGED (1 problem)" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nothing")]) == 2


def test_reshard_rewrites_for_a_new_world_that_loads_without_resharding(tmp_path, capsys):
    _save(tmp_path / "src")
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--world", "3", "--layout", "model/norm=shard"]) == 0
    with Checkpointer(str(tmp_path / "dst")) as ck:
        from flexckpt.catalog import read_manifest

        m = read_manifest(ck.storage, 5)
    assert m.world_size == 3 and m.tensors["model/norm"].layout == Shard(0)
    assert m.lanes == {"data": {"0": {"doc": 0}, "1": {"doc": 1}}}
    for r in range(3):
        with Checkpointer(str(tmp_path / "dst"), rank=r, world_size=3, run_id="check") as ck:
            layouts = {k: m.tensors[f"model/{k}"].layout for k in GLOBAL}
            target = {"model": {k: ShardedTensor.empty(v.shape, layouts[k], rank=r, world_size=3) for k, v in GLOBAL.items()},
                      "step": 0, "data": ByLane()}
            ck.load(target)
            for k, v in GLOBAL.items():
                assert torch.equal(target["model"][k].local, ShardedTensor.from_global(v, layouts[k], r, 3).local)
            # saved pieces now match the targets exactly: each rank reads only its own file
            assert ck.last_load_stats.bytes_read <= sum(target["model"][k].local.numel() * 4 for k in GLOBAL) + 4096


def test_a_folder_without_checkpoints_is_an_error_that_points_at_a_run_folders_ckpt(tmp_path, capsys):
    _save(tmp_path / "run" / "ckpt")  # where flextrain keeps a run's checkpoints
    for cmd in (["steps"], ["inspect"], ["verify"], ["plan", "--world", "2"]):
        assert main([cmd[0], str(tmp_path / "run"), *cmd[1:]]) == 2
        assert capsys.readouterr().err == (f"flexckpt: no committed checkpoint under {tmp_path / 'run'}; it looks "
                                           f"like a flextrain run folder: pass {tmp_path / 'run'}/ckpt\n")
    assert main(["export-safetensors", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert f"pass {tmp_path / 'run'}/ckpt" in capsys.readouterr().err
    assert main(["steps", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == (f"flexckpt: no committed checkpoint under {tmp_path / 'missing'}: "
                                       f"{tmp_path / 'missing'} does not exist; check the path (for a flextrain "
                                       f"run, RUN_DIR/ckpt)\n")
    assert not (tmp_path / "missing").exists()  # looking does not create it


def test_a_damaged_newest_manifest_names_the_step_before_it(tmp_path, capsys):
    _save(tmp_path, step=5)
    _save(tmp_path, step=7)
    manifest = tmp_path / step_dir(7) / MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:10])  # cut short
    for argv in (["inspect", str(tmp_path)], ["plan", str(tmp_path), "--world", "2"],
                 ["reshard", str(tmp_path), str(tmp_path / "out"), "--world", "1"],
                 ["export-dcp", str(tmp_path), str(tmp_path / "out")],
                 ["export-safetensors", str(tmp_path), str(tmp_path / "out")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"flexckpt: invalid checkpoint manifest {step_dir(7)}/{MANIFEST}: not valid JSON"), err
        assert err.endswith("; pass --step 5 for the step before it\n") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    assert main(["inspect", str(tmp_path), "--step", "7"]) == 2  # asked for by number: no other step offered
    assert "--step 5" not in capsys.readouterr().err
    assert main(["inspect", str(tmp_path), "--step", "5"]) == 0


def test_output_into_a_closed_pipe_exits_141_without_a_message(tmp_path, capsys, closed_stdout):

    _save(tmp_path)
    closed_stdout()
    assert main(["inspect", str(tmp_path), "--tensors"]) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("cmd", ["steps", "inspect", "verify", "plan", "reshard", "import-dcp", "export-dcp",
                                 "export-safetensors"])
def test_every_subcommand_describes_itself_and_its_arguments(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: flexckpt {cmd}")
    description = out.split("\n\n")[1]
    assert not description.startswith(("positional arguments", "options")), out  # a sentence, not just the usage
    if "--step STEP" in out:
        assert "a committed step" in out or "--step, else" in out, out


def test_bad_layout_sizes_and_compression_are_one_line_errors(tmp_path, capsys):
    _save(tmp_path / "src")
    for kind in ("hybrid:x", "block:abc", "bogus", "hybrid:2:3:4"):
        assert main(["plan", str(tmp_path / "src"), "--world", "2", "--layout", f"model/*={kind}"]) == 2
        assert capsys.readouterr().err.startswith(f"flexckpt: unknown layout kind '{kind}': use replicate")
    with pytest.raises(SystemExit) as e:
        main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--world", "2", "--compression", "lz4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --compression: compression must be None, 'zstd' or 'zstd:LEVEL'" in err and err.count("\n") == 1
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("ckpt_kept_in", ["run/ckpt", "elsewhere"])
def test_verify_all_of_a_folder_without_checkpoints_is_an_error_like_verify(ckpt_kept_in, tmp_path, capsys):
    _save(tmp_path / ckpt_kept_in)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    hint = f"; it looks like a flextrain run folder: pass {run}/ckpt" if ckpt_kept_in == "run/ckpt" else ""
    for argv in (["verify", str(run), "--all"], ["verify", str(run)], ["steps", str(run)]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", f"flexckpt: no committed checkpoint under {run}{hint}\n"), argv


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    _save(root / "src")
    (root / "a-file").write_text("not a checkpoint")
    return root


# {src}: a committed checkpoint; {file}: a plain file; {new}: a path that does not exist yet
BAD_ARGUMENTS = [
    (["steps", ""], "the checkpoint location is empty"),
    (["steps", "foo://bar"], "'foo://bar' as a checkpoint location: checkpoint location 'foo://bar': no storage knows "
                             "the scheme 'foo'; use a local path, file://, memory:// or s3://"),
    (["steps", "{file}"], "{file} is a file, not a checkpoint folder"),
    (["inspect", "{file}"], "{file} is a file, not a checkpoint folder"),
    (["verify", "{file}", "--all"], "{file} is a file, not a checkpoint folder"),
    (["steps", "{file}/ckpt"], "Not a directory: '{file}/ckpt'"),
    (["inspect", "{src}", "--step", "-1"], "--step -1: step must be an int in [0, 10**12)"),
    (["plan", "{file}", "--world", "2"], "{file} is a file, not a checkpoint folder"),
    (["plan", "{src}", "--world", "0"], "--world must be in [1, 1048576] (what a checkpoint can record), got 0"),
    (["reshard", "{src}", "{new}", "--world", str(10**20)],
     f"--world must be in [1, 1048576] (what a checkpoint can record), got {10**20}"),
    (["plan", "{src}", "--world", "x"], "argument --world: invalid int value: 'x'"),
    (["plan", "{src}", "--world", "3", "--layout", "model/*=hybrid:2"],
     "cannot lay step 5's tensors out on 3 ranks: HybridShard(group_size=2) needs a world size divisible"),
    (["plan", "{src}", "--world", "2", "--layout", "model/*=bogus"], "unknown layout kind 'bogus'"),
    (["plan", "{src}", "--world", "2", "--layout", "noequals"], "--layout wants PATTERN=KIND, got 'noequals'"),
    (["plan", "{src}", "--world", "2", "--layout", "modle/*=shard"], "--layout 'modle/*=shard' matches no tensor of step 5"),
    (["reshard", "{src}", "{new}", "--world", "3", "--layout", "model/*=hybrid:2"],
     "cannot lay step 5's tensors out on 3 ranks: HybridShard(group_size=2) needs a world size divisible"),
    (["reshard", "{src}", "{new}", "--world", "2", "--layout", "model/*=block:0"],
     "BlockShard(block_size=...) needs an int >= 1, got 0"),
    (["reshard", "{src}", "{new}", "--world", "2", "--layout", "model/*=bogus"], "unknown layout kind 'bogus'"),
    (["reshard", "{src}", "{new}", "--world", "2", "--layout", "noequals"], "--layout wants PATTERN=KIND, got 'noequals'"),
    (["reshard", "{src}", "", "--world", "2"], "the checkpoint location is empty"),
    (["reshard", "{src}", "foo://bar", "--world", "2"], "'foo://bar' as a checkpoint location"),
    (["reshard", "{src}", "{file}", "--world", "2"], "{file} is a file, not a checkpoint folder"),
    (["reshard", "{src}", "{file}/dst", "--world", "2"], "reshard: [Errno 20] Not a directory: '{file}/dst'"),
    (["reshard", "{src}", "{new}", "--world", "2", "--step", "-4"], "--step -4: step must be an int"),
    (["import-dcp", "{new}", ""], "the checkpoint location is empty"),
    (["import-dcp", "{new}", "foo://bar"], "'foo://bar' as a checkpoint location"),
    (["import-dcp", "{file}", "{new}"], "'{file}' is not a folder"),
    (["import-dcp", "{new}", "{file}"], "{file} is a file, not a checkpoint folder"),
    (["import-dcp", "{new}", "{new}x", "--step", "-1"], "--step -1: step must be an int in [0, 10**12)"),
    (["import-dcp", "{new}", "{new}x", "--budget-mib", "-1"], "--budget-mib must be >= 0"),
    (["export-dcp", "", "{new}"], "the checkpoint location is empty"),
    (["export-dcp", "foo://bar", "{new}"], "'foo://bar' as a checkpoint location"),
    (["export-dcp", "{file}", "{new}"], "{file} is a file, not a checkpoint folder"),
    (["export-dcp", "{src}", "foo://bar"], "DCP_DIR 'foo://bar' is a URL"),
    (["export-safetensors", "", "{new}"], "the checkpoint location is empty"),
    (["export-safetensors", "{file}", "{new}"], "{file} is a file, not a checkpoint folder"),
    (["export-safetensors", "{src}", "s3://bucket/out"], "OUT_DIR 's3://bucket/out' is a URL"),
    (["export-safetensors", "{src}", "{new}", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
]


@pytest.mark.parametrize("argv,want", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_to_every_subcommand_are_one_line_naming_the_value_and_exit_2(argv, want, saved, tmp_path, capsys):
    where = {"src": saved / "src", "file": saved / "a-file", "new": tmp_path / "new"}
    try:
        rc = main([a.format(**where) for a in argv])
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.count("\n") == 1 and want.format(**where) in captured.err, captured.err
    assert captured.out == "" and not (tmp_path / "new").exists() and not (tmp_path / "newx").exists()


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory):
    import warnings

    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.arange(256.0).reshape(16, 16), "b": torch.ones(16)}, "step": 7},
                 checkpoint_id=str(path))
    return path


def _refuse_writes_under(monkeypatch, folder):
    """What a read-only folder does to a writer that is not root: its folders cannot be made."""
    import errno

    from flexckpt.storage import Storage

    real = Storage.makedirs

    def makedirs(self, rel):
        if self.path(rel).startswith(str(folder)):
            raise PermissionError(errno.EACCES, "Permission denied", self.path(rel))
        return real(self, rel)

    monkeypatch.setattr(Storage, "makedirs", makedirs)


@pytest.mark.parametrize("dest", ["under a file", "refusing writes", "read-only folder"])
@pytest.mark.parametrize("cmd", ["reshard", "import-dcp"])
def test_an_unwritable_destination_is_one_line_with_no_logged_tracebacks(cmd, dest, saved, dcp_folder, tmp_path,
                                                                         monkeypatch, capsys, caplog):
    import logging

    if dest == "read-only folder" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders (the 'refusing writes' case stands in)")
    dst = saved / "a-file" / "dst" if dest == "under a file" else tmp_path / "dst"
    if dest == "refusing writes":
        _refuse_writes_under(monkeypatch, dst)
    if dest == "read-only folder":
        dst.mkdir()
        dst.chmod(0o555)
    logger = logging.getLogger("flexckpt")
    handlers = list(logger.handlers)
    argv = ["reshard", str(saved / "src"), str(dst), "--world", "2"] if cmd == "reshard" else \
        ["import-dcp", str(dcp_folder), str(dst), "--budget-mib", "0"]  # 0: a save per tensor, as many failures
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flexckpt: ") and str(dst) in err, err
    assert [r.getMessage() for r in caplog.records if r.name.startswith("flexckpt")] == []  # none went on to be printed
    assert logger.handlers == handlers and logger.propagate  # a library user's logging is as it was


def test_errors_the_library_logs_during_a_command_that_succeeds_are_shown_one_line_each(saved, tmp_path, monkeypatch,
                                                                                       capsys):
    import flexckpt.save.committer

    def reclaim_at_start(*args, **kwargs):
        raise OSError("disk on fire (test)")

    monkeypatch.setattr(flexckpt.save.committer, "reclaim_at_start", reclaim_at_start)
    assert main(["reshard", str(saved / "src"), str(tmp_path / "dst"), "--world", "2"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("flexckpt: reclaiming unfinished saves under ") and line.endswith(" failed")
                         for line in lines), lines


def test_import_dcp_into_a_path_under_a_file_prints_one_line_in_a_real_process(saved, dcp_folder):
    import subprocess
    import sys

    dst = saved / "a-file" / "imported"
    proc = subprocess.run([sys.executable, "-m", "flexckpt.cli", "import-dcp", str(dcp_folder), str(dst)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"flexckpt: save of step 7 failed: [Errno 20] Not a directory: '{dst}'\n", proc.stderr


def test_import_dcp_help_says_dcp_has_no_checksums(capsys):
    with pytest.raises(SystemExit):
        main(["import-dcp", "--help"])
    assert "DCP stores no checksums: a damaged byte in a DCP data file imports without an error" in \
        " ".join(capsys.readouterr().out.split())


def test_an_export_reads_the_newest_manifest_once_before_its_first_tensor(tmp_path, monkeypatch, capsys):
    """To learn what to export (each load of a batch of tensors reads it again: Checkpointer.load's own)."""
    from flexckpt.storage import Storage

    _save(tmp_path, step=5)
    _save(tmp_path, step=7)
    reads, at_first_load = [], []
    read_bytes, load = Storage.read_bytes, Checkpointer.load

    def counted_read(self, rel, limit=None):
        if rel.endswith(MANIFEST):
            reads.append(rel)
        return read_bytes(self, rel, limit)

    def noted_load(self, *args, **kwargs):
        if not at_first_load:
            at_first_load.append(list(reads))
        return load(self, *args, **kwargs)

    monkeypatch.setattr(Storage, "read_bytes", counted_read)
    monkeypatch.setattr(Checkpointer, "load", noted_load)
    for cmd in ("export-dcp", "export-safetensors"):
        reads.clear()
        at_first_load.clear()
        assert main([cmd, str(tmp_path), str(tmp_path / cmd)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("exported step 7: 4 tensors"), out
        assert cmd == "export-dcp" or f" in 1 file to {tmp_path / cmd}\n" in out, out
        assert at_first_load == [[f"{step_dir(7)}/{MANIFEST}"]], cmd


WRITES = ("makedirs", "write_stream", "write_direct", "put_atomic", "remove", "remove_tree")


@pytest.mark.parametrize("argv", [
    ["steps", "{src}"], ["inspect", "{src}"], ["verify", "{src}"], ["plan", "{src}", "--world", "1"],
    ["export-dcp", "{src}", "{out}"], ["export-safetensors", "{src}", "{out}"],
    ["reshard", "{src}", "{out}", "--world", "1"],
], ids=lambda argv: argv[0])
def test_a_command_that_reads_a_checkpoint_writes_nothing_there(tmp_path, monkeypatch, capsys, argv):
    """As with read-only credentials, or beside a live job: a stale attempt folder of another
    job and an empty step folder (which a job's start removes) stay, and no write under the
    source is even tried (each would fail with a permission error)."""
    from flexckpt.storage import Storage

    src = tmp_path / "src"
    _save(src)
    stale = src / step_dir(5) / "old.0000abcd.1"
    stale.mkdir()
    (stale / "r00000.data").write_bytes(b"\1" * 64)
    for p in (stale / "r00000.data", stale):
        os.utime(p, (1e9, 1e9))  # 2001: untouched for far longer than any commit_timeout
    (src / step_dir(3)).mkdir()
    tried = []
    for name in WRITES:
        def refused(self, rel, *a, _write=getattr(Storage, name), _name=name, **k):
            if os.path.commonpath([self.path(rel), str(src)]) == str(src):
                tried.append(f"{_name} {rel}")
                raise PermissionError(13, "Permission denied (read-only, test)", self.path(rel))
            return _write(self, rel, *a, **k)

        monkeypatch.setattr(Storage, name, refused)
    assert main([a.format(src=src, out=tmp_path / "out") for a in argv]) == 0, capsys.readouterr().err
    assert capsys.readouterr().err == ""
    assert tried == []
    assert stale.is_dir() and (src / step_dir(3)).is_dir()


def test_inspect_of_a_plain_dict_names_each_value_by_its_key_path_not_an_escaped_name(tmp_path, capsys):
    state = {"a/b": torch.ones(2), "a": {"b": torch.zeros(2), 3: "x", "3": "y"}, "l": [1, {"k%": 2}],
             "d": ByLane({"0": 1}), "raw": b"12"}
    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        ck.save(1, state).result(timeout=30)
    assert main(["inspect", str(tmp_path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "%2F" not in out and "%25" not in out
    for shown in ["('a', 3) = \"x\"", "('a', '3') = \"y\"", "('l', 0) = 1", "('l', 1, 'k%') = 2",
                  "per-lane ('d',): 1 lanes", "bytes ('raw',): 2 bytes"]:
        assert shown in out
    assert [line.split()[0] for line in out.splitlines() if "float32" in line] == ["('a/b',)", "('a',"]
