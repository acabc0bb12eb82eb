"""Values addressed by key, not by rank (issue 15, point 4), and the check a trainer makes
before its first step (point 5).

``bytes`` leaves are stored opaquely, once per key however many ranks hold the key (the
TP/PP peers of one data-parallel replica); copies must be equal. Each rank loads the keys
it holds, at any world size; a key no rank saved stops the load naming it and the opt-out
(``exclude=``). ``Checkpointer.check`` lists every leaf that cannot be checkpointed in one
error. Ranks are played in one process (``rank=``/``world_size=``)."""
import os
import pickle

import pytest
import torch

from flexckpt import (
    ByLane,
    Checkpointer,
    ChecksumError,
    ManifestError,
    MissingFile,
    PerRank,
    SaveError,
    StructureMismatch,
    TruncatedFile,
    UnsupportedState,
)
from flexckpt.catalog import read_manifest
from flexckpt.format.names import keyed_name, step_dir
from flexckpt.state.values import MAX_BYTES_VALUE
from flexckpt.storage import Storage
from flexshard import Shard, ShardedTensor
from manifest_edit import _edit_manifest

W = torch.arange(24, dtype=torch.float32).reshape(6, 4)


class Loader:
    """torchtitan's data loader in miniature: its state is ``{"dp_rank_<d>": bytes,
    "world_size": dp}``, and every TP peer of replica d holds the same key."""

    def __init__(self, dp_rank: int, dp: int, position: int = -1) -> None:
        self.key, self.dp, self.position = f"dp_rank_{dp_rank}", dp, position
        self.loaded = 0

    def state_dict(self) -> dict:
        return {self.key: pickle.dumps({"position": self.position}), "world_size": self.dp}

    def load_state_dict(self, sd: dict) -> None:
        self.position = pickle.loads(sd[self.key])["position"]  # the trainer's own bytes, its own unpickling
        self.loaded += 1


def _state(rank: int, world: int, tp: int, position=lambda d: 100 + d) -> dict:
    dp_rank = rank // tp
    return {
        "w": ShardedTensor.from_global(W, Shard(0), rank, world),
        "data": Loader(dp_rank, world // tp, position(dp_rank)),
        "blob": {"tokenizer": b"\x00\xffsame on every rank"},
    }


def _save(root, world, states, step=1, **kw):
    cks = [Checkpointer(str(root), rank=r, world_size=world, run_id="keys", fsync=False, **kw) for r in range(world)]
    try:
        handles = [ck.save(step, states(r)) for r, ck in enumerate(cks)]
        out = []
        for h in handles:
            try:
                out.append(h.result(timeout=30))
            except SaveError as e:
                out.append(e)
        return out
    finally:
        for ck in cks:
            ck.close()


def _load(root, rank, world, state, **kw):
    with Checkpointer(str(root), rank=rank, world_size=world, run_id="load") as ck:
        return ck.load(state, **kw)


def test_bytes_values_held_by_tp_peers_are_stored_once_and_each_rank_loads_its_key_at_any_world(tmp_path):
    # saved at W=4 as (dp 2, tp 2): ranks 0, 1 hold dp_rank_0; ranks 2, 3 dp_rank_1; all hold blob
    assert _save(tmp_path, 4, lambda r: _state(r, 4, tp=2)) == [1] * 4
    m = read_manifest(Storage(str(tmp_path)), 1)
    want = {"data/dp_rank_0": pickle.dumps({"position": 100}), "data/dp_rank_1": pickle.dumps({"position": 101}),
            "blob/tokenizer": b"\x00\xffsame on every rank"}
    assert sorted(m.keyed) == sorted(want)
    assert m.plain == {"data/world_size": 2}
    stored = (tmp_path / step_dir(1) / keyed_name(m.attempt)).read_bytes()
    assert len(stored) == sum(len(v) for v in want.values())  # each key once, not once per holder
    for key, value in want.items():
        offset, length, _ = m.keyed[key]
        assert stored[offset : offset + length] == value
    # load at (dp 2, tp 1), (dp 2, tp 4) and (dp 1): every rank gets the key it holds, bit for bit
    for world, tp in ((2, 1), (8, 4), (1, 1)):
        for rank in range(world):
            target = _state(rank, world, tp, position=lambda d: -1)
            target["blob"]["tokenizer"] = b""
            assert _load(tmp_path, rank, world, target) == 1
            assert target["data"].position == 100 + rank // tp and target["data"].loaded == 1, (world, rank)
            assert target["blob"]["tokenizer"] == want["blob/tokenizer"]
            assert torch.equal(target["w"].local, ShardedTensor.from_global(W, Shard(0), rank, world).local)
    # one rank may hold several keys (a rank that takes over two replicas' loaders)
    both = {"data": {"dp_rank_0": b"", "dp_rank_1": b"", "world_size": 0}}
    assert _load(tmp_path, 0, 1, both, exclude=("w", "blob")) == 1
    assert both["data"] == {"dp_rank_0": want["data/dp_rank_0"], "dp_rank_1": want["data/dp_rank_1"], "world_size": 2}


def test_unequal_copies_of_a_key_fail_the_save_naming_the_key_and_ranks(tmp_path):
    def states(r):
        s = _state(r, 4, tp=2)
        if r == 3:  # a TP peer of replica 1 whose loader went its own way
            s["data"].position = 7
        return s

    outcome = _save(tmp_path, 4, states, commit_timeout=20)
    assert isinstance(outcome[0], SaveError), outcome
    assert ("bytes value 'data/dp_rank_1' was saved by ranks 2 and 3 with different contents" in str(outcome[0])
            and "a key of its own" in str(outcome[0]))
    assert Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="look").steps() == []


def test_a_repeated_lane_and_repeated_bytes_across_record_groups_merge_when_equal(tmp_path, monkeypatch):
    import flexckpt.checkpointer as ckmod
    import flexckpt.save.commit as commit
    import flexckpt.save.committer as committer
    import flexckpt.format.names as names
    import flexckpt.save.pipeline as save_pipeline

    for module in (ckmod, commit, committer, names, save_pipeline):  # group leaders merge first, then rank 0 merges the groups
        monkeypatch.setattr(module, "GROUP", 2)
    states = lambda r: {"data": ByLane({"7": {"doc": 1}}), "x": b"one copy", "own": {f"r{r}": bytes([r])}}  # noqa: E731
    assert _save(tmp_path, 5, states) == [1] * 5
    m = read_manifest(Storage(str(tmp_path)), 1)
    assert m.lanes == {"data": {"7": {"doc": 1}}}
    assert sorted(m.keyed) == ["own/r0", "own/r1", "own/r2", "own/r3", "own/r4", "x"]
    target = {"data": ByLane(), "x": b"", "own": {"r4": b""}}
    assert _load(tmp_path, 0, 1, target) == 1
    assert target == {"data": target["data"], "x": b"one copy", "own": {"r4": b"\x04"}}


def test_a_key_never_saved_stops_the_load_naming_it_and_exclude_opts_out(tmp_path):
    assert _save(tmp_path, 4, lambda r: _state(r, 4, tp=2)) == [1] * 4
    # (dp 3): rank 2 holds dp_rank_2, which no rank saved
    target = _state(2, 3, tp=1, position=lambda d: -1)
    with pytest.raises(StructureMismatch, match=r"no bytes value \['data/dp_rank_2'\] that rank 2 of 3 holds: no rank "
                                                r"saved it.*exclude=\('data/dp_rank_2',\)"):
        _load(tmp_path, 2, 3, target)
    assert target["data"].position == -1 and target["data"].loaded == 0
    # opting out by a pattern: the rest loads, the excluded key keeps what it held
    assert _load(tmp_path, 2, 3, target, exclude=("data/*",)) == 1
    assert target["data"].position == -1 and target["data"].loaded == 1
    assert torch.equal(target["w"].local, ShardedTensor.from_global(W, Shard(0), 2, 3).local)
    # naming the container leaves the stateful object alone altogether
    target = _state(2, 3, tp=1, position=lambda d: -1)
    assert _load(tmp_path, 2, 3, target, exclude=("data",)) == 1
    assert target["data"].loaded == 0 and target["blob"]["tokenizer"] == b"\x00\xffsame on every rank"
    # strict=False skips it too, and says so in the stats
    target = _state(2, 3, tp=1, position=lambda d: -1)
    with Checkpointer(str(tmp_path), rank=2, world_size=3, run_id="load") as ck:
        assert ck.load(target, strict=False) == 1
        assert "data/dp_rank_2" in ck.last_load_stats.skipped
    with pytest.raises(TypeError, match="exclude must be a tuple"):
        _load(tmp_path, 0, 1, _state(0, 1, tp=1), exclude="data/*")


def test_per_rank_values_at_another_world_size_stop_the_load_instead_of_a_warning(tmp_path):
    assert _save(tmp_path, 2, lambda r: {"w": ShardedTensor.from_global(W, Shard(0), r, 2), "rng": PerRank(r)}) == [1, 1]
    target = {"w": ShardedTensor.empty((6, 4), Shard(0), rank=0, world_size=1), "rng": PerRank("mine")}
    with pytest.raises(StructureMismatch, match=r"per-rank values \['rng'\] .* world size 2 .* at world size 1.*"
                                                r"exclude=\('rng',\)"):
        _load(tmp_path, 0, 1, target)
    assert _load(tmp_path, 0, 1, target, exclude=("rng",)) == 1
    assert target["rng"].value == "mine" and not target["rng"].restored
    assert torch.equal(target["w"].local, W)
    target["rng"].restored = True  # from an earlier load: strict=False skips it and says it was not restored
    with Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="load") as ck:
        assert ck.load(target, strict=False) == 1 and ck.last_load_stats.skipped == ["rng"]
    assert target["rng"].value == "mine" and not target["rng"].restored
    same = {"w": ShardedTensor.empty((6, 4), Shard(0), rank=1, world_size=2), "rng": PerRank(None)}
    assert _load(tmp_path, 1, 2, same) == 1 and same["rng"].value == 1 and same["rng"].restored


class Armed:
    """Unpickling this runs code: the kind of payload a checkpoint must never trigger."""

    fired = 0

    def __reduce__(self):
        return (Armed._fire, ())

    @staticmethod
    def _fire():
        Armed.fired += 1
        return "fired"


def test_bytes_values_are_never_unpickled(tmp_path, monkeypatch):
    payload = pickle.dumps({"state": Armed()})
    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, lambda *a, **k: pytest.fail("flexckpt unpickled a value"))
    assert _save(tmp_path, 2, lambda r: {"dl": {"dp_rank_0": payload}}) == [1, 1]
    target = {"dl": {"dp_rank_0": b""}}
    assert _load(tmp_path, 0, 3, target) == 1
    assert target["dl"]["dp_rank_0"] == payload and Armed.fired == 0


def _one_key(tmp_path):
    assert _save(tmp_path, 1, lambda r: {"a": b"alpha" * 10, "b": b"beta"}) == [1]
    m = read_manifest(Storage(str(tmp_path)), 1)
    return tmp_path / step_dir(1) / keyed_name(m.attempt)


@pytest.mark.parametrize("damage, error, match", [
    (lambda p: p.write_bytes(b"alphX" + p.read_bytes()[5:]), ChecksumError, r"bytes value 'a'.*damaged"),
    (lambda p: p.write_bytes(p.read_bytes()[:20]), TruncatedFile, r"ends at byte 20"),
    (lambda p: p.unlink(), MissingFile, r"keyed.values is missing"),
])
def test_a_damaged_bytes_values_file_is_flexckpts_own_error(tmp_path, damage, error, match):
    damage(_one_key(tmp_path))
    target = {"a": b"", "b": b""}
    with pytest.raises(error, match=match):
        _load(tmp_path, 0, 1, target)
    assert target == {"a": b"", "b": b""}  # nothing set


@pytest.mark.parametrize("edit, match", [
    (lambda k: k["a"].__setitem__(1, MAX_BYTES_VALUE + 1), r"bytes value 'a' must be \[offset, length"),
    (lambda k: k["a"].__setitem__(1, 2**40), r"bytes value 'a' must be"),
    (lambda k: k["b"].__setitem__(0, 3), r"bytes value '.' starts at byte"),
    (lambda k: k["b"].__setitem__(2, "zz"), r"bytes value 'b' must be"),
    (lambda k: k.__setitem__("", [0, 0, "0" * 16]), r"bytes value '' must be"),
    (lambda k: k.__setitem__("c", "x"), r"bytes value 'c' must be"),
])
def test_a_damaged_bytes_values_index_is_refused_before_anything_is_allocated(tmp_path, edit, match):
    _one_key(tmp_path)
    _edit_manifest(str(tmp_path), 1, lambda doc: edit(doc["keyed"]))
    with pytest.raises(ManifestError, match=match):
        _load(tmp_path, 0, 1, {"a": b""})


def test_check_lists_every_unsupported_leaf_in_one_error_and_save_refuses_the_same_at_once(tmp_path):
    state = {
        "ok": {"w": torch.zeros(3), "dl": b"bytes are fine", "n": 1},
        "ids": {1, 2},
        "opt": [0.5, object()],
        "buf": bytearray(b"x"),
        ("tuple", "key"): 1,
        "big": b"\x00" * (MAX_BYTES_VALUE + 1),
        "st": ShardedTensor.from_global(W, Shard(0), 1, 2),  # built for another world
    }
    with Checkpointer(str(tmp_path), rank=0, world_size=1, run_id="chk") as ck:
        ck.check({"ok": state["ok"]})  # nothing to say
        with pytest.raises(UnsupportedState) as e:
            ck.check(state)
        names = [n for n, _ in e.value.problems]
        assert names == ["ids", "opt/1", "buf", "('tuple', 'key')", "big", "st"]
        text = str(e.value)
        assert text.startswith("6 leaves of the state cannot be checkpointed:\n  - ids: cannot checkpoint 'ids' of "
                               "type set: use tensors")
        for part in ("of type object", "of type bytearray", "state keys must be str or int",
                     f"more than the {MAX_BYTES_VALUE} a bytes value may hold", "save it as a uint8 tensor",
                     "ShardedTensor for rank 1 of 2"):
            assert part in text, part
        assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)  # as the single errors were
        with pytest.raises(UnsupportedState) as again:  # save(): the same error, on this thread, nothing written
            ck.save(1, state)
        assert [n for n, _ in again.value.problems] == names
        assert os.listdir(tmp_path) == []


def test_check_names_a_dtensors_mesh_and_placements(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group of another test is live in this process")
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())  # torch's fake backend: no peers
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        partial = DTensor.from_local(torch.zeros(4, 3), mesh, (Partial(), Replicate()), run_check=False)
        with Checkpointer(str(tmp_path), rank=1, world_size=4, run_id="chk") as ck:
            with pytest.raises(UnsupportedState) as e:
                ck.check({"layers": {"0": {"wq": partial}}, "loader": {"odd": {1}}})
    finally:
        dist.destroy_process_group()
    (name, exc), (name2, _) = e.value.problems
    assert (name, name2) == ("layers/0/wq", "loader/odd")
    assert "'layers/0/wq'" in str(exc) and "DeviceMesh(" in str(exc) and "('fsdp', 'tp')" in str(exc)
    assert "Partial" in str(exc)


def test_the_cli_shows_verifies_and_reshards_bytes_values(tmp_path, capsys):
    from flexckpt.cli import main

    src, dst = tmp_path / "src", tmp_path / "dst"
    assert _save(src, 4, lambda r: _state(r, 4, tp=2)) == [1] * 4
    assert main(["inspect", str(src)]) == 0
    assert "bytes ('data', 'dp_rank_1'): " in capsys.readouterr().out
    assert main(["reshard", str(src), str(dst), "--world", "2"]) == 0
    for rank in range(2):  # every key moved, once, and loads by key at the new world
        target = _state(rank, 2, tp=1, position=lambda d: -1)
        assert _load(dst, rank, 2, target) == 1 and target["data"].position == 100 + rank
    assert main(["verify", str(dst)]) == 0
    keyed = dst / step_dir(1) / keyed_name(read_manifest(Storage(str(dst)), 1).attempt)
    keyed.write_bytes(keyed.read_bytes()[:-1] + b"?")
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 1
    assert "bytes values: " in capsys.readouterr().out
