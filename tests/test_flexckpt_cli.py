"""The command-line tool on a checkpoint saved by 2 ranks."""
import pytest
import torch

from flexckpt import ByLane, Checkpointer
from flexckpt.cli import main
import orjson

from flexckpt.manifest import MANIFEST, step_dir
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
    assert "model/w" in out and "Owned(owner=1)" in out and "per-lane data: 2 lanes (0, 1)" in out
    assert main(["plan", str(tmp_path), "--world", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]


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
        from flexckpt.commit import read_manifest

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
    assert capsys.readouterr().err == f"flexckpt: no committed checkpoint under {tmp_path / 'missing'}\n"


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
    for kind in ("hybrid:x", "block:abc", "bogus"):
        with pytest.raises(SystemExit, match=f"unknown layout kind '{kind}': use replicate"):
            main(["plan", str(tmp_path / "src"), "--world", "2", "--layout", f"model/*={kind}"])
    with pytest.raises(SystemExit) as e:
        main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--world", "2", "--compression", "lz4"])
    assert e.value.code == 2
    assert "argument --compression: compression must be None, 'zstd' or 'zstd:LEVEL'" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()
