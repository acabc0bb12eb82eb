"""Loads that half succeed (issue 11, defect 8): everything is validated before the ranks
agree, and plain, per-lane and per-rank values are set only after they agreed. Before the
fix a bad per-rank entry of rank 1 made rank 0 return step 2 while rank 1 raised, and a bad
plain value raised ``ValueError`` (even with ``fallback=True``) after ``step=7`` was set."""
import copy
import os

import orjson
import pytest
import torch
import torch.distributed as dist

from flexckpt import ByLane, Checkpointer, LoadError, ManifestError, PerRank
from flexckpt.catalog import read_manifest
from flexckpt.format.checksum import checksum
from flexckpt.format.names import step_dir, values_name
from flexshard import Shard, ShardedTensor
from flexshard.spawn import run_workers
from manifest_edit import _edit_manifest

FULL = torch.arange(600, dtype=torch.float32)


def _state(step, rank=0, world=1):
    return {
        "w": ShardedTensor.from_global(FULL + step, Shard(0), rank, world),
        "meta": {"step": step, "pair": [step, "x"]},
        "lanes": ByLane({str(rank): {"doc": step}}),
        "rng": PerRank(torch.full((4,), float(10 * step + rank))),
    }


def _sentinel(rank=0, world=1):
    return {
        "w": ShardedTensor.empty((600,), Shard(0), rank=rank, world_size=world),
        "meta": {"step": -1, "pair": [-1, "none"]},
        "lanes": ByLane({str(rank): {"doc": -1}}),
        "rng": PerRank(torch.full((4,), -1.0)),
    }


def _values(st):
    return copy.deepcopy({"meta": st["meta"], "lanes": st["lanes"].values, "rng": st["rng"].value.tolist()})


def _damage_per_rank_value(root, step, rank):
    """Rewrite rank ``rank``'s per-rank values file with a tensor whose bytes do not fill its
    shape, and make the manifest vouch for the new file: only that rank can tell."""
    with Checkpointer(root, run_id="fix", rank=0, world_size=1) as ck:
        m = read_manifest(ck.storage, step)
        rel = f"{step_dir(step)}/{values_name(m.attempt, rank)}"
    bad = orjson.dumps({"rng": {"$tensor": {"dtype": "float32", "shape": [4], "data": "AAAA"}}})
    with open(os.path.join(root, rel), "wb") as f:
        f.write(bad)

    def vouch(doc):
        doc["ranks"][rank][3:5] = [checksum(bad), len(bad)]

    _edit_manifest(root, step, vouch)


def _two_ranks(rank, world, root):
    ck = Checkpointer(root, run_id="halfload")
    for step in (1, 2):
        ck.save(step, _state(step, rank, world)).result(timeout=60)
    ck.wait()
    dist.barrier()
    if rank == 0:
        _damage_per_rank_value(root, 2, rank=1)
    dist.barrier()  # test code: both ranks load after the damage
    target = _sentinel(rank, world)
    try:
        ck.load(target)
        first = "loaded"
    except (LoadError, ManifestError) as e:
        first = f"{type(e).__name__}: {e}"
    untouched = _values(target)
    step = ck.load(target, fallback=True)
    ck.close()
    return {"first": first, "untouched": untouched, "fallback": step, "after": _values(target),
            "w": torch.equal(target["w"].local, ShardedTensor.from_global(FULL + 1, Shard(0), rank, world).local)}


def test_a_bad_per_rank_value_on_rank_1_alone_fails_the_load_on_both_ranks_before_any_value_is_set(tmp_path):
    res = run_workers(_two_ranks, 2, str(tmp_path), timeout=120)
    assert res[0]["first"] == "LoadError: load of step 2 failed on rank 1; see that rank's error"
    assert res[1]["first"].startswith("ManifestError: per-rank tensor 'rng': 3 bytes do not fill shape [4] of float32")
    for rank, r in enumerate(res):
        # nothing but (perhaps) tensors was written into the target on either rank
        assert r["untouched"] == {"meta": {"step": -1, "pair": [-1, "none"]}, "lanes": {str(rank): {"doc": -1}},
                                  "rng": [-1.0] * 4}
        # fallback=True: both ranks load step 1 together, all of it
        assert r["fallback"] == 1 and r["w"]
        assert r["after"] == {"meta": {"step": 1, "pair": [1, "x"]}, "lanes": {"0": {"doc": 1}, "1": {"doc": 1}},
                              "rng": [10.0 + rank] * 4}


@pytest.mark.parametrize("bad", [{"$tuple": "x"}, {"$float": "1e5"}, {"$other": 1}])
def test_a_bad_plain_value_is_the_librarys_error_before_anything_is_set_and_fallback_takes_the_previous_step(
    tmp_path, bad
):
    root = str(tmp_path)
    with Checkpointer(root, run_id="plain") as ck:
        for step in (1, 2):
            ck.save(step, _state(step)).result(timeout=30)

    def spoil(doc):
        doc["plain"]["meta/pair"] = [2, bad]

    _edit_manifest(root, 2, spoil)
    with Checkpointer(root, run_id="plain") as ck:
        target = _sentinel()
        with pytest.raises(ManifestError, match=r"checkpoint step 2: plain value 'meta/pair' is malformed"):
            ck.load(target)
        assert _values(target) == {"meta": {"step": -1, "pair": [-1, "none"]}, "lanes": {"0": {"doc": -1}},
                                   "rng": [-1.0] * 4}
        assert ck.load(target, fallback=True) == 1
        assert _values(target) == {"meta": {"step": 1, "pair": [1, "x"]}, "lanes": {"0": {"doc": 1}}, "rng": [10.0] * 4}
        assert torch.equal(target["w"].local, FULL + 1)
