"""Pipeline and expert parallelism: ranks whose structures differ.

Every rank of a world is played in this one process on torch's fake process-group backend
(``init_process_group("fake")`` per rank, DTensors built with ``from_local(run_check=False)``
on the rank's own meshes). A pipeline stage's ranks hold only the stage's keys, each on the
stage's own mesh (a mesh spanning part of the world); experts live on an ``(efsdp, ep)``
mesh of the stage's ranks, in both placements torchtitan uses. Saved, then loaded at
another pipeline degree and expert degree, bit for bit; zero collectives during the save;
a key the target wants and the checkpoint lacks is named (Megatron-LM #7452 copied the
first stage's layers into later stages instead)."""
from __future__ import annotations

import functools
import glob
from contextlib import nullcontext
import inspect
import uuid

import orjson
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from flexckpt import Checkpointer
from flexckpt.errors import SaveError, StructureMismatch
from flexshard import MeshLayout, ShardedTensor
from collective_counts import LOCAL_QUERIES
from mesh_states import _bits_equal, _global, dtensor_on

LAYERS = 4


def _stage_model(rank: int, world: int, stages: int, ep: int, fill: bool, layers: int = LAYERS) -> dict:
    """This rank's part of the model: the layers of its stage (layer ``i`` on stage
    ``i * stages // layers``), a weight ``Shard(0)`` and a norm ``Replicate()`` on the stage's
    own dp mesh, and (``ep`` > 0) two experts' weights on the stage's ``(efsdp, ep)`` mesh:
    ``(_StridedShard(0, sf=ep), Shard(0))`` and ``(Shard(1), Shard(0))``. Built inside a fake
    world of ``world`` ranks; every piece cut where torch says it is."""
    per = world // stages
    s = rank // per
    ranks = torch.arange(s * per, (s + 1) * per)
    dp = DeviceMesh("cpu", ranks, mesh_dim_names=("dp",))
    e = min(ep, per)
    emesh = DeviceMesh("cpu", ranks.view(per // e, e), mesh_dim_names=("efsdp", "ep")) if ep else None
    out = {}
    for i in range(layers):
        if i * stages // layers != s:
            continue
        want = {f"layers.{i}.w": (dp, (6, 5), ("S0",)), f"layers.{i}.norm": (dp, (5,), ("R",))}
        if ep:
            want[f"layers.{i}.experts.w1"] = (emesh, (4, 6, 5), (f"SS0:{e}", "S0"))
            want[f"layers.{i}.experts.w2"] = (emesh, (4, 5, 6), ("S1", "S0"))
        for name, (mesh, shape, codes) in want.items():
            out[name] = dtensor_on(mesh, name, shape, codes, fill)
    return out


def _in_fake_world(rank: int, world: int, fn):
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        return fn()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def counts(monkeypatch) -> dict:
    """Calls of every torch.distributed function (undone after the test)."""
    calls: dict[str, int] = {}
    for module in (dist, dist.distributed_c10d):
        for name, fn in list(vars(module).items()):
            if inspect.isfunction(fn) and fn.__module__.startswith("torch.distributed") and name != "reduce_op":
                @functools.wraps(fn)
                def wrapper(*a, __fn=fn, __name=name, **k):
                    calls[__name] = calls.get(__name, 0) + 1
                    return __fn(*a, **k)
                monkeypatch.setattr(module, name, wrapper)
    return calls


def _communication(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if k not in LOCAL_QUERIES and v != before.get(k, 0)}


def _save(url: str, world: int, stages: int, ep: int, counts: dict, steps=(1,)) -> tuple[dict, list[Checkpointer]]:
    """Every rank saves its stage's model (and the step, a plain value every rank holds) at
    each of ``steps``; rank 0 last (it commits). Returns the calls made during save() and
    the commit, and the (closed) checkpointers by rank."""
    run = uuid.uuid4().hex[:8]
    during: dict[str, int] = {}

    def count(before: dict) -> None:
        for k, v in _communication(before, counts).items():
            during[k] = during.get(k, 0) + v

    order = list(range(1, world)) + [0]
    models = {r: _in_fake_world(r, world, lambda r=r: _stage_model(r, world, stages, ep, fill=True)) for r in order}
    cks = {r: Checkpointer(url, rank=r, world_size=world, run_id=run) for r in order}
    for step in steps:
        handles = []
        for rank in order:
            def save(rank=rank):
                before = dict(counts)
                h = cks[rank].save(step, {"model": models[rank], "step": 1})
                h.wait_staged()
                count(before)
                return h
            handles.append(_in_fake_world(rank, world, save))
        before = dict(counts)
        for h in handles[::-1]:
            h.result(timeout=60)
        count(before)
    for ck in cks.values():
        ck.close()
    return during, [cks[r] for r in range(world)]


def _records(url: str, step: int) -> list[dict]:
    return [orjson.loads(open(f, "rb").read()) for f in sorted(glob.glob(f"{url}/step-{step:012d}/*/rec/*/*.json"))]


def _load(url: str, world: int, stages: int, ep: int) -> int:
    """Every rank of the target loads its stage's model; each tensor must equal the saved
    global tensor's piece bit for bit. Returns the tensors checked."""
    checked = 0
    for rank in range(world):
        model = _in_fake_world(rank, world, lambda: _stage_model(rank, world, stages, ep, fill=False))
        state = {"model": model, "step": -1}
        with Checkpointer(url, rank=rank, world_size=world, run_id="load") as ck:
            ck.load(state)
        assert state["step"] == 1
        want = _in_fake_world(rank, world, lambda: _stage_model(rank, world, stages, ep, fill=True))
        assert sorted(model) == sorted(want)
        for name in want:
            got, exp = model[name]._local_tensor, want[name]._local_tensor
            assert _bits_equal(got, exp), (world, stages, ep, rank, name)
            checked += 1
    return checked


def test_two_stages_of_two_ranks_reload_at_one_and_four_stages_bit_exact_with_zero_collectives(tmp_path, counts):
    url = str(tmp_path / "pp")
    during, cks = _save(url, 4, 2, 0, counts, steps=(1, 2))
    assert counts and during == {}  # the counters count (mesh building calls them); zero collectives on save
    # one structure per stage reached rank 0, not one per rank; the second save sends none
    assert len(cks[0]._committer.structures) == 2
    assert [("structure" in d) for d in _records(url, 1)] == [True] * 3
    assert [("structure" in d) for d in _records(url, 2)] == [False] * 3
    with Checkpointer(url) as ck:
        tensors = ck.contents(step=1).by_name().tensors
    assert sorted(tensors) == sorted(f"model/layers.{i}.{k}" for i in range(LAYERS) for k in ("w", "norm"))
    assert tensors["model/layers.3.w"].layout == MeshLayout((2,), ("S0",), offset=2)
    assert _load(url, 2, 1, 0) == 2 * 2 * LAYERS  # one stage of two ranks
    assert _load(url, 1, 1, 0) == 2 * LAYERS
    assert _load(url, 4, 4, 0) == 2 * LAYERS  # four stages of one rank


def test_experts_on_efsdp_ep_meshes_of_each_stage_reload_at_other_pipeline_and_expert_degrees(tmp_path, counts):
    """2 stages of 4 ranks, experts on each stage's (efsdp 2, ep 2) mesh in both placements,
    dense weights on the stage's dp mesh; loaded at 1 stage of 4 with ep 4 (efsdp 1), and at
    4 stages of 2 with ep 1 (efsdp 2)."""
    url = str(tmp_path / "ep")
    during, _ = _save(url, 8, 2, 2, counts)
    assert during == {}
    with Checkpointer(url) as ck:
        tensors = ck.contents().by_name().tensors
    assert tensors["model/layers.2.experts.w1"].layout == MeshLayout((2, 2), ("SS0:2", "S0"), offset=4)
    assert tensors["model/layers.2.experts.w2"].layout == MeshLayout((2, 2), ("S1", "S0"), offset=4)
    assert _load(url, 4, 1, 4) == 4 * 4 * LAYERS
    assert _load(url, 8, 4, 1) == 8 * 4 * LAYERS // 4


def test_a_layer_the_checkpoint_lacks_is_named_never_copied_from_another_stage(tmp_path, counts):
    """Megatron-LM #7452: after a change of pipeline stages a load silently copied the first
    stage's layers into later stages. Here the target has a fifth layer on its last stage:
    the load stops naming it, and nothing is written into the target."""
    url = str(tmp_path / "pp")
    _save(url, 4, 2, 0, counts)
    world, stages = 2, 2  # stage 1 (rank 1) holds layers 3 and 4 of five
    model = _in_fake_world(1, world, lambda: _stage_model(1, world, stages, 0, fill=False, layers=5))
    assert sorted(model) == ["layers.3.norm", "layers.3.w", "layers.4.norm", "layers.4.w"]
    with Checkpointer(url, rank=1, world_size=world, run_id="load") as ck:
        with pytest.raises(StructureMismatch, match=r"has no tensors \['model/layers.4.norm', 'model/layers.4.w'\]"):
            ck.load({"model": model, "step": -1})
    assert all(torch.isnan(t._local_tensor).all() for t in model.values())


def _sharded(rank: int, world: int, layouts: dict) -> dict:
    return {n: ShardedTensor.from_global(_global(n, shape), layout, rank=rank, world_size=world)
            for n, (shape, layout) in layouts.items()}


def _save_states(url: str, states: dict) -> list:
    """Saves ``states[rank]`` on every rank (rank 0 last); returns rank 0's error or None."""
    run = uuid.uuid4().hex[:8]
    world = len(states)
    cks = [Checkpointer(url, rank=r, world_size=world, run_id=run, commit_timeout=20) for r in range(world)]
    hs = []
    for r in list(range(1, world)) + [0]:
        h = cks[r].save(1, states[r])
        h.wait_staged()
        hs.append(h)
    errors = []
    for h in hs[::-1]:
        try:
            h.result(timeout=60)
            errors.append(None)
        except SaveError as e:
            errors.append(str(e))
    for ck in cks:
        ck.close()
    return errors[0]


@pytest.mark.parametrize("case", ["shape", "world_key", "mesh_rank", "replicas"])
def test_stages_that_disagree_on_a_key_fail_the_save_naming_it(tmp_path, case):
    """Ranks that share a key must agree on its dtype, shape and layout; a key written by
    the whole world's rules must be on every rank; every rank of a key's mesh must hold it."""
    stage = [MeshLayout((2,), ("S0",), offset=2 * s) for s in range(2)]
    states = {r: {"model": _sharded(r, 4, {f"layers.{r // 2}.w": ((6, 5), stage[r // 2])})} for r in range(4)}
    if case == "shape":  # rank 3 says layer 0 (stage 0's) has another shape
        states[3]["model"]["layers.0.w"] = ShardedTensor.from_global(torch.zeros(7, 5), stage[0], rank=3, world_size=4)
        match = r"tensor 'model/layers.0.w' differs between ranks that hold it"
    elif case == "world_key":  # a plain tensor on stage 1 only: the whole world's rules would write it
        states[2]["head"] = states[3]["head"] = torch.ones(3)
        match = r"tensor 'head' .* rank 0 does not hold it.*DTensor on that part's mesh"
    elif case == "replicas":  # DDP x TP: one key on the tp mesh of each data-parallel replica
        states = {r: {"model": _sharded(r, 4, {"w": ((6, 5), stage[r // 2])})} for r in range(4)}
        match = r"tensor 'model/w' is held on \[2\] meshes of different ranks by rank 0 and rank 2 .*one mesh"
    else:  # rank 1 of stage 0's mesh lacks stage 0's layer
        states[1]["model"] = {}
        match = r"tensor 'model/layers.0.w' lives on .* rank 1 of that mesh does not hold it"
    error = _save_states(str(tmp_path / case), states)
    assert error is not None and __import__("re").search(match, error), error


def test_group_records_carry_one_structure_per_stage_and_rank_0_builds_the_union(tmp_path):
    """W=256, 4 stages of 64 ranks, stage s on ranks [64 s, 64 s + 64) shifted by 32 so that
    every record group (64 ranks) straddles two stages: each group's record carries the
    structures of its ranks once per fingerprint (2, not 64), and the union rank 0 builds
    from them holds every stage's keys, with each element written by exactly one rank."""
    from flexckpt.save.commit import gather, keyed_entries, lead_group, record_doc
    from flexckpt.format.names import GROUP, group_name, record_name, step_dir
    from flexckpt.save.stage_union import union_structure
    from flexckpt.storage import Storage
    from flexckpt.state.structure import fingerprint

    world, attempt, run = 256, "run.s.1", "run"
    stage_of = lambda r: ((r + 32) // 64) % 4  # noqa: E731 - stage 0 also holds ranks 224..255
    tables = {s: [(64 * s - 32 + i) % world for i in range(64)] for s in range(4)}
    structures = {}
    for s in range(4):
        layout = MeshLayout((64,), ("S0",), tuple(sorted(tables[s])))
        t = {"name": f"layers.{s}.w", "dtype": "float32", "shape": [640, 3], "layout": layout.to_json()}
        structures[s] = {"tensors": [t], "plain": ["step"], "lanes": [], "per_rank": []}
    storage = Storage(str(tmp_path))

    def own(r: int) -> bytes:
        st = structures[stage_of(r)]
        return record_doc(run_id=run, attempt=attempt, step=1, world_size=world,
                          entries={r: [fingerprint(st), "c", 1, 1, "", 0]}, lanes={},
                          structure=orjson.dumps(st), keyed=keyed_entries(r, {}))

    for r in range(world):
        if r % GROUP:
            rel = f"{step_dir(1)}/{record_name(attempt, r)}"
            storage.makedirs(rel.rsplit("/", 1)[0])
            storage.put_atomic(rel, own(r), fsync=False)
    for g in range(1, world // GROUP):
        doc = lead_group(storage, step=1, run_id=run, attempt=attempt, world_size=world, rank=g * GROUP,
                         own=own(g * GROUP), timeout=10, max_delay=0.01)
        assert len(orjson.loads(doc)["structures"]) == 2  # one per stage in the group, not one per rank
        rel = f"{step_dir(1)}/{group_name(attempt, g)}"
        storage.makedirs(rel.rsplit("/", 1)[0])
        storage.put_atomic(rel, doc, fsync=False)
    seen: dict[str, dict] = {}
    entries, _ = gather(storage, step=1, run_id=run, attempt=attempt, world_size=world, own=own(0), timeout=10,
                        max_delay=0.01, structures=seen)
    assert len(seen) == 4 and len(entries) == world
    specs, structure, _fp = union_structure(entries, 1, fingerprint(structures[0]), structures[0], seen, world)
    assert [s.name for s in specs] == [f"layers.{s}.w" for s in range(4)]
    from flexckpt.format.write_plan import PlanRules, WritePlan
    plan = WritePlan(specs, world, PlanRules(1 << 20))
    for i, spec in enumerate(plan.specs):
        writers = [r for r in range(world) for p in plan.rank_plan(r).pieces if p.spec_index == i]
        assert sorted(writers) == sorted(tables[i]), i  # each of the stage's 64 ranks writes its 10 rows
        assert sum(p.nbytes for r in writers for p in plan.rank_plan(r).pieces if p.spec_index == i) == 640 * 3 * 4
        # each rank's plan from its own structure alone equals the union's plan for it
        for r in writers[:3]:
            alone = WritePlan([s for s in specs if s.name == spec.name], world, PlanRules(1 << 20))
            assert alone.rank_plan(r).nbytes == plan.rank_plan(r).nbytes


def test_a_stage_structure_is_sent_again_until_a_save_carrying_it_commits(tmp_path, monkeypatch):
    """Rank 0's first commit fails before it reads any record: the next save's records carry
    the stages' structures again (a rank stops sending its structure only once it sees a
    save that carried it committed), so that save commits with the union."""
    import flexckpt.save.committer as checkpointer_module

    real, calls = checkpointer_module.gather, []

    def failing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("storage hiccup")
        return real(*a, **k)

    monkeypatch.setattr(checkpointer_module, "gather", failing_once)
    url, run = str(tmp_path / "pp"), uuid.uuid4().hex[:8]
    stage = [MeshLayout((2,), ("S0",), offset=2 * s) for s in range(2)]
    cks = [Checkpointer(url, rank=r, world_size=4, run_id=run, commit_timeout=20) for r in range(4)]
    states = {r: {"model": _sharded(r, 4, {f"layers.{r // 2}.w": ((6, 5), stage[r // 2])})} for r in range(4)}
    outcome = {}
    for step in (1, 2, 3):
        hs = {}
        for r in (1, 2, 3, 0):
            hs[r] = cks[r].save(step, states[r])
            hs[r].wait_staged()
        try:
            hs[0].result(timeout=60)
            outcome[step] = "ok"
        except SaveError as e:
            outcome[step] = str(e)
        for r in (1, 2, 3):  # they learn of the commit, or of rank 0's failure, from storage
            with pytest.raises(SaveError, match="rank 0 failed while committing") if step == 1 else nullcontext():
                hs[r].result(timeout=60)
    for ck in cks:
        ck.close()
    assert outcome == {1: "save of step 1 failed: storage hiccup", 2: "ok", 3: "ok"}
    assert [("structure" in d) for d in _records(url, 2)] == [True] * 3  # step 1 never committed: sent again
    assert [("structure" in d) for d in _records(url, 3)] == [False] * 3
    with Checkpointer(url) as ck:
        assert sorted(ck.contents(step=2).by_name().tensors) == ["model/layers.0.w", "model/layers.1.w"]
