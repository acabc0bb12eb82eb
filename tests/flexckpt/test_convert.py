"""The converters (``flexckpt import-dcp``, ``export-dcp``, ``export-safetensors``) on the
state of a real FSDP2 model trained with AdamW at world 2: each round trip bit-identical,
loaded into FSDP2 models at worlds 2 and 1, and bad input refused with one line and no
output that looks complete. Two launches."""
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from flexckpt import ByLane, Checkpointer, PerRank
from flexckpt.cli import main
from flexshard.spawn import run_workers
from fsdp_states import _fresh_state, _fsdp, _full, _same, _train


def _cli(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def _load_both(rank: int, world: int, imported: str, exported: str) -> dict:
    """Fresh FSDP2 models filled from the import (flexckpt) and from the export (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    out = {}
    model, optim, state = _fresh_state(world)
    with Checkpointer(imported, run_id=f"imp{world}") as ck:
        out["import_step"] = ck.load(state)
    out["imported"] = _full(state)
    model, optim, state = _fresh_state(world)
    del state["step"]
    dcp.load(state, checkpoint_id=exported)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["exported"] = _full(state)
    return out


def _save_both(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp(world)
    _train(model, optim, rank, 0, 3)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "step": 3}, checkpoint_id=f"{root}/dcp")
    state = {"model": msd, "optim": osd, "step": 3, "data": ByLane({str(rank): rank}), "rng": PerRank(rank)}
    with Checkpointer(f"{root}/flex", run_id="conv") as ck:
        ck.save(3, state).result(timeout=60)
    saved = _full({"model": msd, "optim": osd, "step": 3})
    dist.barrier()
    cli = {}
    if rank == 0:
        cli["import"] = _cli(["import-dcp", f"{root}/dcp", f"{root}/imported", "--budget-mib", "0"])
        cli["export"] = _cli(["export-dcp", f"{root}/flex", f"{root}/exported", "--budget-mib", "0"])
    dist.barrier()
    return {"saved": saved, "cli": cli, **_load_both(rank, world, f"{root}/imported", f"{root}/exported")}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("convert"))
    two = run_workers(_save_both, 2, root, timeout=180)
    one = run_workers(_load_both, 1, f"{root}/imported", f"{root}/exported", timeout=120)
    return root, two, one


def test_import_dcp_and_export_dcp_round_trip_bit_identical_into_fsdp2_at_two_and_one(converted):
    root, two, one = converted
    saved = two[0]["saved"]
    rc, out = two[0]["cli"]["import"]
    assert rc == 0 and "as step 3 (step from plain value 'step')" in out, out
    rc, out = two[0]["cli"]["export"]
    assert rc == 0 and "left out: data (per-lane value)" in out and "left out: rng (per-rank value)" in out, out
    for r in [*two, *one]:
        assert r["import_step"] == 3
        assert _same(saved, r["imported"]) == []
        assert _same({k: v for k, v in saved.items() if k != "/step"}, {**r["exported"]}) == []
    # the import is an ordinary checkpoint: one tensor per batch ("--budget-mib 0"), Owned by its batch's rank
    with Checkpointer(f"{root}/imported") as ck:
        c = ck.contents().by_name()
    assert c.step == 3 and c.world_size == len(c.tensors) == sum(isinstance(v, torch.Tensor) for v in saved.values())
    assert c.plain["optim/param_groups/0/betas"] == (0.9, 0.999) and c.plain["step"] == 3


def test_export_safetensors_hugging_face_layout_bit_identical(converted, tmp_path):
    from safetensors.torch import load_file

    root, two, _ = converted
    saved = two[0]["saved"]
    weights = {k[len("/model/"):]: v for k, v in saved.items() if k.startswith("/model/")}
    for dtype, cast in ((None, torch.float32), ("bf16", torch.bfloat16)):
        out = str(tmp_path / f"st-{dtype}")
        argv = ["export-safetensors", f"{root}/flex", out, "--select", "model/*", "--strip-prefix", "model/",
                "--max-shard-size", "300B"] + (["--dtype", dtype] if dtype else [])
        rc, text = _cli(argv)
        assert rc == 0, text
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files[0].endswith("-of-" + f"{len(files):05d}.safetensors")
        assert sorted(os.listdir(out)) == sorted(files + ["model.safetensors.index.json"])
        got = {}
        for f in files:
            part = load_file(os.path.join(out, f))
            assert all(index["weight_map"][k] == f for k in part)
            got.update(part)
        assert sorted(got) == sorted(weights)
        assert all(got[k].dtype == cast and torch.equal(got[k], weights[k].to(cast)) for k in weights)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())


def test_converters_refuse_bad_input_with_one_line_and_no_complete_looking_output(converted, tmp_path, monkeypatch):
    root, _, _ = converted
    no_meta = str(tmp_path / "no-meta")
    shutil.copytree(f"{root}/dcp", no_meta)
    os.remove(os.path.join(no_meta, ".metadata"))
    a_file = str(tmp_path / "a-file")
    open(a_file, "w").close()
    cases = [
        (["import-dcp", str(tmp_path / "missing"), str(tmp_path / "x")], "is not a folder"),
        (["import-dcp", no_meta, str(tmp_path / "x")], "has no .metadata file"),
        (["export-safetensors", f"{root}/flex", str(tmp_path / "s1"), "--select", "model/nope*"], "matches no tensor"),
        (["export-safetensors", f"{root}/flex", str(tmp_path / "s2"), "--strip-prefix", "nope/"], "starts no selected"),
        (["export-safetensors", f"{root}/flex", str(tmp_path / "s3"), "--strip-prefix", "model"],
         "--strip-prefix 'model' leaves '/"),
        (["export-safetensors", f"{root}/flex", a_file], "already exists and is not an empty folder"),
        (["export-dcp", f"{root}/flex", "/proc/flexckpt-test/out"], "cannot create DCP folder"),
        (["export-dcp", str(tmp_path / "empty"), str(tmp_path / "d1")], "no committed flexckpt checkpoint"),
    ]
    for argv, want in cases:
        rc, text = _cli(argv)
        assert rc == 2 and text.count("\n") == 1 and want in text, (argv, text)
    assert not any(os.path.exists(tmp_path / d) for d in ("x", "s1", "s3"))

    # a failure half-way leaves neither the index nor any final-named file (nor .metadata)
    import flexckpt.convert.safetensors_out as so
    import flexckpt.convert.dcp as cd

    calls = []

    def failing(ck, contents, names):
        calls.append(names)
        if len(calls) == 3:
            raise OSError("disk full (test)")
        return real(ck, contents, names)

    real = so.read_tensors
    monkeypatch.setattr(so, "read_tensors", failing)
    monkeypatch.setattr(cd, "read_tensors", failing)
    rc, text = _cli(["export-safetensors", f"{root}/flex", str(tmp_path / "half"), "--max-shard-size", "1KB", "--budget-mib", "0"])
    assert rc == 2 and text == "flexckpt: export-safetensors: disk full (test)\n", text
    assert os.listdir(tmp_path / "half") == []
    calls.clear()
    rc, text = _cli(["export-dcp", f"{root}/flex", str(tmp_path / "half-dcp"), "--budget-mib", "0"])
    assert rc == 2 and text == f"flexckpt: writing {tmp_path / 'half-dcp'} failed: OSError: disk full (test)\n", text
    assert not os.path.exists(tmp_path / "half-dcp" / ".metadata")


@pytest.mark.timeout(120)
def test_import_dcp_of_several_batches_into_a_url_with_a_newer_step_completes(tmp_path):
    # issue 14 defect 2: the last batch's Checkpointer (rank 0, which commits) started after
    # the earlier batches were written, and its start-up reclamation deleted their folder:
    # the import waited out commit_timeout (600 s), then failed "record of ranks [1, 2] missing"
    import time

    import torch.distributed.checkpoint as dcp

    tensors = {k: torch.arange(64, dtype=torch.float32) + i for i, k in enumerate("abc")}
    dcp.save({**tensors, "step": 3}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    url = str(tmp_path / "ckpt")
    with Checkpointer(url, run_id="train") as ck:
        ck.save(10, {"w": torch.ones(4), "step": 10}).result(timeout=30)
    t0 = time.monotonic()
    rc, out = _cli(["import-dcp", str(tmp_path / "dcp"), url, "--budget-mib", "0"])
    assert rc == 0, out
    assert time.monotonic() - t0 < 60  # a few seconds; before: commit_timeout
    with Checkpointer(url, run_id="reader") as ck:
        assert ck.steps() == [3, 10]
        target = {k: torch.zeros(64) for k in tensors} | {"step": 0}
        assert ck.load(target, step=3) == 3
    assert all(torch.equal(target[k], v) for k, v in tensors.items()) and target["step"] == 3


@pytest.mark.timeout(120)
def test_import_dcp_onto_a_mesh_target_loads_bit_exact_and_a_bad_target_is_one_line(tmp_path):
    # issue 15 point 6: import-dcp lays the tensors out as --world/--mesh/--layout say
    import torch.distributed.checkpoint as dcp

    from flexckpt.catalog import read_manifest
    from flexckpt.storage import Storage
    from flexshard import MeshLayout, ShardedTensor

    g = torch.Generator().manual_seed(0)
    model = {"wq": torch.randn(8, 6, generator=g), "wo": torch.randn(4, 10, generator=g).to(torch.bfloat16)}
    dcp.save({"model": model, "bias": torch.arange(5.0), "step": 7}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    url = str(tmp_path / "ckpt")
    rc, out = _cli(["import-dcp", str(tmp_path / "dcp"), url, "--world", "4", "--mesh", "fsdp=2,tp=2",
                    "--layout", "model/*=S0,S1"])
    assert rc == 0, out
    m = read_manifest(Storage(url), 7)
    assert m.world_size == 4
    for n in ("model/wq", "model/wo"):
        assert m.tensors[n].layout == MeshLayout((2, 2), ("S0", "S1")), (n, m.tensors[n].layout)
    for r in range(4):
        state = {"model": {k: ShardedTensor.empty(v.shape, MeshLayout((2, 2), ("S0", "S1")), v.dtype, rank=r, world_size=4)
                           for k, v in model.items()}, "bias": torch.zeros(5), "step": 0}
        with Checkpointer(url, rank=r, world_size=4, run_id=f"reader{r}") as ck:
            assert ck.load(state, step=7) == 7
        for k, v in model.items():
            want = ShardedTensor.from_global(v, MeshLayout((2, 2), ("S0", "S1")), r, 4).local
            got = state["model"][k].local
            assert got.dtype == v.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (r, k)
        assert torch.equal(state["bias"], torch.arange(5.0)) and state["step"] == 7
    bad = [["--world", "4", "--mesh", "fsdp=3,tp=2", "--layout", "model/*=S0,S1"],
           ["--mesh", "fsdp=2,tp=2", "--layout", "model/*=S0,S1"],
           ["--world", "4", "--mesh", "fsdp=2,tp=2", "--layout", "nothing/*=S0,S1"]]
    for extra in bad:
        rc, out = _cli(["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "bad"), *extra])
        assert rc == 2 and out.count("\n") == 1 and out.startswith("flexckpt: "), (extra, out)
        with Checkpointer(str(tmp_path / "bad"), run_id="look") as ck:
            assert ck.steps() == [], extra  # nothing committed


@pytest.mark.timeout(120)
def test_import_dcp_onto_a_target_honours_the_budget_or_refuses_before_writing(tmp_path):
    # --budget-mib bounded the import alone: the reshard to --world then held each target
    # rank's whole share (at --world 1, the whole checkpoint) whatever the budget said
    import torch.distributed.checkpoint as dcp

    from flexckpt.catalog import read_manifest
    from flexckpt.storage import Storage

    a, b = torch.arange(2**18, dtype=torch.float32), -torch.arange(2**18, dtype=torch.float32)  # 1 MiB each
    dcp.save({"a": a, "b": b, "step": 3}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    whole = str(tmp_path / "whole")
    rc, out = _cli(["import-dcp", str(tmp_path / "dcp"), whole, "--world", "1", "--budget-mib", "1"])
    assert rc == 2 and out.count("\n") == 1 and out.startswith("flexckpt: "), out
    assert "--budget-mib 1: with --world 1 target rank 0 holds 2.00 MiB" in out, out
    assert "raise --budget-mib to 2" in out, out
    assert os.listdir(whole) == []  # refused before anything was written
    url = str(tmp_path / "two")
    rc, out = _cli(["import-dcp", str(tmp_path / "dcp"), url, "--world", "2", "--budget-mib", "1"])
    assert rc == 0, out  # each rank owns one tensor: 1 MiB a rank
    assert read_manifest(Storage(url), 3).world_size == 2
    state = {"a": torch.zeros_like(a), "b": torch.zeros_like(b), "step": 0}
    with Checkpointer(url, rank=0, world_size=1, run_id="reader") as ck:
        assert ck.load(state) == 3
    assert torch.equal(state["a"], a) and torch.equal(state["b"], b) and state["step"] == 3


@pytest.mark.timeout(60)
def test_import_dcp_in_more_batches_than_a_record_group_commits(tmp_path):
    # batch 64 (a group leader, which gathers the records of batches 65..) was saved and waited
    # for before them: the import stalled until commit_timeout
    import torch.distributed.checkpoint as dcp

    from flexckpt.format.names import GROUP

    model = {f"t{i}": torch.full((4,), float(i)) for i in range(GROUP + 6)}
    dcp.save(model, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    url = str(tmp_path / "ckpt")
    rc, out = _cli(["import-dcp", str(tmp_path / "dcp"), url, "--budget-mib", "0"])  # a batch per tensor
    assert rc == 0, out
    state = {k: torch.zeros(4) for k in model}
    with Checkpointer(url, rank=0, world_size=1, run_id="reader") as ck:
        assert ck.load(state) == 0
    assert all(torch.equal(state[k], v) for k, v in model.items())
