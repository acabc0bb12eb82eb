"""Plain dicts round-trip (issue 26, part 2): a trainer's checkpoint dict saved and read back
without a template (``Checkpointer.load_dict``) comes back with the same structure, keys,
order and types; values that cannot be represented are refused at save() and check()."""
from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
import struct
from typing import Any

import pytest
import torch

from flexckpt import Checkpointer, UnsupportedState


class Color(enum.Enum):
    RED = 1
    BLUE = "b"


class Level(enum.IntEnum):
    LOW = 1


@dataclasses.dataclass(frozen=True)
class Optim:
    name: str = "adamw"
    betas: tuple = (0.9, 0.95)


@dataclasses.dataclass
class HParams:
    lr: float = 3e-4
    act: type = torch.nn.GELU
    dtype: torch.dtype = torch.bfloat16
    optim: Optim = dataclasses.field(default_factory=Optim)
    layers: list = dataclasses.field(default_factory=lambda: [1, 2])
    extra: dict = dataclasses.field(default_factory=lambda: {1: "one", "1": "str one"})


def assert_same(got: Any, want: Any, path: tuple = ()) -> None:
    """Equal, types included, dict key order included; tensors bit for bit (NaN and -0.0
    included), same dtype, shape and device; floats by their bits (-0.0 included), NaN as NaN."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want) and [type(k) for k in got] == [type(k) for k in want], f"{path}: keys"
        for k in want:
            assert_same(got[k], want[k], path + (k,))
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, path + (i,))
    elif isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.device) == (want.dtype, want.shape, want.device), path
        assert torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got,
                           want.contiguous().reshape(-1).view(torch.uint8) if want.numel() else want), path
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path  # NaN comes back as NaN; its sign and payload bits are not kept
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _round_trip(tmp_path, state: dict, **load: Any) -> dict:
    with Checkpointer(str(tmp_path / "ck"), rank=0, world_size=1, fsync=False) as ck:
        ck.save(5, state).result(timeout=30)
        return ck.load_dict(**load)


def trainer_dict() -> dict:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "epoch": 3, "global_step": 1200, "lr": 0.5, "done": False, "note": None, "name": "run-ü",
        "state_dict": {"layer.weight": base, "layer.bias": torch.zeros(4, dtype=torch.bfloat16)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": base * 2}},
                              "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "foreach": None}]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3}}, "state_dict": {}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_k_models": {}, "kth_value": float("inf")}},
        "int_keys": {1: "int", "1": "str", -2: "neg", "-2": "negstr"},
        "slashes": {"a/b": 1, "a": {"b": 2}, "%2F": 3, "50%": 4},
        "tuple": (1, "two", None, (3.5, [4])), "empty": {}, "empty_list": [], "empty_tuple": (),
        "floats": [float("nan"), float("-inf"), float("inf"), -0.0, 0.0, 1e-310],
        "mixed_list": [torch.ones(2), 7, {"k": b"bytes"}, ["x", torch.zeros(())]],
        "blob": b"\x00\xffdata",
        "tensors": {"zero_d": torch.tensor(7, dtype=torch.int64), "empty": torch.empty(0, 3),
                    "non_contiguous": base.t(), "sliced": base[:, ::2], "bool": torch.tensor([True, False])},
        "hparams": {"dtype": torch.float16, "device": torch.device("cuda", 1), "cpu": torch.device("cpu"),
                    "path": pathlib.Path("/data/run 1"), "pure": pathlib.PurePosixPath("a/b"),
                    "color": Color.BLUE, "level": Level.LOW, "act": torch.nn.GELU, "cfg": HParams(),
                    "dtypes": [torch.float32, torch.int8], "big": 2**64 - 1, "small": -(2**63)},
    }


def test_a_trainer_dict_comes_back_without_a_template_with_its_structure_and_types(tmp_path):
    state = trainer_dict()
    got = _round_trip(tmp_path, state)
    want = dict(state)
    want["tensors"] = {k: v.contiguous() for k, v in state["tensors"].items()}  # strides are not kept
    assert_same(got, want)


def test_int_and_str_keys_of_one_dict_stay_apart(tmp_path):
    got = _round_trip(tmp_path, {"d": {1: torch.ones(1), "1": torch.zeros(1), 2: "a"}, "e": {"2": "s"}})
    assert list(got["d"]) == [1, "1", 2] and got["d"][1].item() == 1.0 and got["d"]["1"].item() == 0.0
    assert list(got["e"]) == ["2"]


def test_an_adamw_state_dict_that_comes_back_loads_into_a_fresh_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    got = _round_trip(tmp_path, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert_same(got["optimizer"], opt.state_dict())
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fresh.load_state_dict(got["model"])
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    opt2.load_state_dict(got["optimizer"])
    assert_same(opt2.state_dict(), opt.state_dict())


def test_tensors_load_onto_the_device_asked_for_and_tied_tensors_come_back_apart(tmp_path):
    w = torch.arange(6.0)
    got = _round_trip(tmp_path, {"emb": w, "head": w, "view": w[1:3]}, device="meta")
    assert {t.device.type for t in got.values()} == {"meta"}
    got = _round_trip(tmp_path / "2", {"emb": w, "head": w})
    assert torch.equal(got["emb"], got["head"]) and got["emb"].data_ptr() != got["head"].data_ptr()
    got["emb"][0] = 100.0
    assert got["head"][0] == 0.0  # sharing does not survive: documented


def test_modules_and_optimizers_in_the_state_come_back_as_their_state_dicts(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = _round_trip(tmp_path, {"model": model, "opt": opt, "step": 1})
    assert_same(got["model"], dict(model.state_dict()))
    assert_same(got["opt"], opt.state_dict())
    assert got["step"] == 1


def test_loading_into_a_template_still_works_and_load_returns_the_step(tmp_path):
    state = {"w": torch.ones(3), "meta": {"epoch": 2, "ids": [1, 2], 4: "four"}, "hp": {"dtype": torch.bfloat16}}
    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        ck.save(9, state).result(timeout=30)
        target = {"w": torch.zeros(3), "meta": {"epoch": 0, "ids": [0], 4: ""}, "hp": {"dtype": torch.float32}}
        assert ck.load(target) == 9
    assert_same(target, state)


def test_exclude_takes_key_paths_and_name_patterns(tmp_path):
    state = {"a/b": torch.ones(1), "a": {"b": torch.zeros(1), "c": 3}, "l": [1, {"x": 2}, "y"], "data": {"k": b"1"}}
    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        ck.save(1, state).result(timeout=30)
        got = ck.load_dict(exclude=(("a/b",), ("l", 1), "data"))
        assert list(got) == ["a", "l"] and list(got["a"]) == ["b", "c"] and got["l"] == [1, "y"]
        got = ck.load_dict(exclude=(("a", "b"),))
        assert list(got) == ["a/b", "a", "l", "data"] and list(got["a"]) == ["c"]


@pytest.mark.parametrize("value, words", [
    ({1, 2}, ["set", "pickle", "use tensors"]),
    (lambda: 1, ["function", "pickle"]),
    (object(), ["object"]),
    (2**64, ["64 bits", "str"]),
    ("\ud800", ["surrogate"]),
    ({(1, 2): "tuple key"}, ["tuple", "str"]),
    ({True: 1}, ["bool", "str"]),
    (complex(1, 2), ["complex"]),
])
def test_a_value_that_cannot_be_represented_is_refused_at_check_and_save_in_one_line(tmp_path, value, words):
    state = {"ok": torch.ones(1), "hp": {"bad": value}}
    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        for call in (lambda: ck.check(state), lambda: ck.save(1, state)):
            with pytest.raises(UnsupportedState) as e:
                call()
            msg = str(e.value)
            assert "\n" not in msg and "hp/bad" in msg, msg
            assert all(w in msg for w in words), msg
        assert ck.steps() == []


def test_a_local_class_or_enum_is_refused_naming_the_fix(tmp_path):
    class Local:
        pass

    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        with pytest.raises(UnsupportedState, match="top level of a module"):
            ck.check({"cls": Local})


def test_contents_names_each_leaf_by_its_key_path(tmp_path):
    state = {"a/b": torch.ones(2), "a": {"b": torch.zeros(3), 1: "int", "1": "str"}, "l": [b"x", {"k": 2.5}],
             "50%": torch.tensor(1)}
    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        ck.save(1, state).result(timeout=30)
        c = ck.contents()
        assert list(c.tensors) == [("a/b",), ("a", "b"), ("50%",)]
        assert c.tensors[("a", "b")].shape == (3,) and c.tensors[("a/b",)].shape == (2,)
        assert c.plain == {("a", 1): "int", ("a", "1"): "str", ("l", 1, "k"): 2.5}
        assert c.keyed == [("l", 0)]
        text = repr(c)
        assert "%" not in text.replace("50%", ""), text  # no escaped names
        assert sorted(c.by_name().tensors) == ["50%25", "a%2Fb", "a/b"]  # the internal names, asked for
        # a key path excludes exactly what it names, on load() as on load_dict()
        target = {"a/b": torch.full((2,), 7.0), "a": {"b": torch.full((3,), 7.0), 1: "", "1": ""}, "l": [b"", {"k": 0.0}],
                  "50%": torch.tensor(0)}
        ck.load(target, exclude=(("a/b",), ("50%",)))
        assert target["a/b"].tolist() == [7.0, 7.0] and target["a"]["b"].tolist() == [0.0] * 3
        assert target["a"][1] == "int" and target["a"]["1"] == "str" and target["50%"].item() == 0


def test_a_version_1_checkpoint_comes_back_as_nested_dicts_of_str_keys(tmp_path):
    import shutil

    from flexckpt import ByLane, PerRank
    from v1_fixture import DATA, fixture

    shutil.copytree(DATA / "v1" / "plain", tmp_path / "ck")
    with Checkpointer(str(tmp_path / "ck"), rank=1, world_size=2, run_id="reader", read_only=True) as ck:
        got = ck.load_dict()
        assert sorted(got) == ["lanes", "rng", "step", "t"] and got["step"] == 3
        want = fixture.global_tensors()
        assert sorted(got["t"]) == sorted(want) and all(torch.equal(got["t"][n], want[n]) for n in want)
        assert got["lanes"] == ByLane({"0": {"doc": 10}, "1": {"doc": 11}})
        assert got["rng"] == PerRank({"seed": 101}) and got["rng"].restored
    with Checkpointer(str(tmp_path / "ck"), rank=0, world_size=1, run_id="reader", read_only=True) as ck:
        with pytest.raises(Exception, match=r"per-rank value \('rng',\).*world size 2.*exclude=\(\('rng',\),\)"):
            ck.load_dict()
        assert sorted(ck.load_dict(exclude=(("rng",),))) == ["lanes", "step", "t"]


# -- DTensors: whole CPU tensors without a template, pieces with one ----------------------------
def _dtensor_round_trip(rank: int, world: int, url: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    state = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)])}, "step": 7, "ids": [rank * 0, 1]}
    with Checkpointer(url) as ck:
        ck.save(1, state).result(timeout=60)
        dist.barrier()
        got = ck.load_dict()
        target = {"model": {"w": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)])}, "step": 0, "ids": []}
        ck.load(target)
        t = target["model"]["w"]
        return {"got": got, "template_is_dtensor": isinstance(t, DTensor), "local": t.to_local().clone(),
                "want_local": state["model"]["w"].to_local().clone()}


def test_dtensors_come_back_as_whole_cpu_tensors_without_a_template_and_as_pieces_with_one(tmp_path):
    from flexshard.spawn import run_workers

    results = run_workers(_dtensor_round_trip, 2, str(tmp_path / "dt"), timeout=120)
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    for r in results:
        assert_same(r["got"], {"model": {"w": full}, "step": 7, "ids": [0, 1]})
        assert r["template_is_dtensor"] and torch.equal(r["local"], r["want_local"])


# -- property: random nested plain structures round-trip exactly --------------------------------
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.binary(max_size=8),
    st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu"), torch.device("cuda", 3), Color.RED,
                     Level.LOW, torch.nn.GELU, pathlib.Path("/a/b"), HParams()]),
    st.builds(lambda n, d: torch.arange(n, dtype=torch.int64).to(d), st.integers(0, 5),
              st.sampled_from([torch.int64, torch.float32, torch.bfloat16, torch.bool])),
)
_key = st.one_of(st.text(min_size=1, max_size=6), st.integers(-3, 3))
_state = st.recursive(
    _leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(tuple),
                            st.dictionaries(_key, inner, max_size=4)),
    max_leaves=20,
)


@hypothesis.settings(max_examples=25, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(st.dictionaries(_key, _state, max_size=5))
def test_random_nested_plain_structures_round_trip_exactly(tmp_path_factory, state):
    root = tmp_path_factory.mktemp("prop")
    with Checkpointer(str(root), rank=0, world_size=1, fsync=False, stage_delay=0) as ck:
        ck.save(1, state).result(timeout=30)
        assert_same(ck.load_dict(), state)


@pytest.mark.parametrize("raw, words", [
    ({"$dataclass": "subprocess:Popen", "fields": {}}, "is not a dataclass"),
    ({"$enum": "subprocess:Popen", "name": "x"}, "has no enum member"),
    ({"$dtype": "load"}, "unexpected object"),
    ({"$class": "os:system"}, "does not define"),
    ({"$class": "flexckpt_no_such_module:Thing"}, "is not imported; import it before loading"),
    ({"$device": "spu:0"}, "not a device this torch knows"),
    ({"$path": "/x", "type": "os"}, "unexpected object"),
    ({"$tuple": [1], "extra": 2}, "unexpected object"),
])
def test_a_hostile_plain_value_in_a_manifest_is_refused_without_importing_or_calling_anything(tmp_path, raw, words):
    import glob
    import sys

    import orjson

    from flexckpt import ManifestError
    from flexckpt.format.jsondoc import SEAL_FIELD, seal

    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        ck.save(1, {"hp": {"v": 1}, "w": torch.ones(1)}).result(timeout=30)
        (path,) = glob.glob(f"{tmp_path}/step-*/manifest.json")
        doc = orjson.loads(open(path, "rb").read())
        doc.pop(SEAL_FIELD)
        doc["plain"]["hp/v"] = raw
        with open(path, "wb") as f:
            f.write(seal(orjson.dumps(doc)))
        with pytest.raises(ManifestError, match=r"plain value \('hp', 'v'\) cannot be"):
            ck.load_dict()
        with pytest.raises(ManifestError, match=words):
            ck.contents()
        assert "flexckpt_no_such_module" not in sys.modules


def test_a_tree_leaf_the_manifest_does_not_save_is_a_damaged_manifest_not_a_missing_key(tmp_path):
    import glob

    import orjson

    from flexckpt import ManifestError
    from flexckpt.format.jsondoc import SEAL_FIELD, seal

    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        ck.save(1, {"w": torch.ones(1), "n": 2}).result(timeout=30)
        (path,) = glob.glob(f"{tmp_path}/step-*/manifest.json")
        doc = orjson.loads(open(path, "rb").read())
        doc.pop(SEAL_FIELD)
        assert doc["tree"] == ["d", ["w", "n"], [0, 0]]
        doc["tree"] = ["d", ["w", "n", "gone"], [0, 0, 0]]
        with open(path, "wb") as f:
            f.write(seal(orjson.dumps(doc)))
        with pytest.raises(ManifestError, match=r"container tree holds \('gone',\), which the manifest does not save"):
            ck.load_dict()


def test_load_dict_gives_back_every_plain_value_without_warning_that_it_left_them_out(tmp_path, caplog):
    # load_dict reads the tensors through a partial load: that must not log the
    # "strict=False left out N key(s)" warning about the plain values it does return.
    with Checkpointer(str(tmp_path), rank=0, world_size=1, fsync=False) as ck:
        ck.save(1, {"w": torch.ones(2), "epoch": 3, "h": {"lr": 0.1}}).result(timeout=30)
        with caplog.at_level("WARNING", logger="flexckpt"):
            got = ck.load_dict()
    assert got["epoch"] == 3 and got["h"] == {"lr": 0.1}
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] == []


def test_load_dict_of_an_empty_url_says_there_is_nothing_to_load_yet(tmp_path):
    from flexckpt.errors import LoadError

    ck = Checkpointer(str(tmp_path / "empty"), rank=0, world_size=1)
    try:
        with pytest.raises(LoadError, match=r"^no committed checkpoint under .*empty: nothing to load yet"):
            ck.load_dict()
        with pytest.raises(LoadError, match=r"^step 3 is not a committed checkpoint under .*; committed: \[\]"):
            ck.load_dict(step=3)
    finally:
        ck.close()
