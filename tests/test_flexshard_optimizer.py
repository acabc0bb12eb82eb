"""The sharded optimizer against single-process torch.optim.Muon / torch.optim.AdamW, at
world 1..4, in both placements; its state dict and a save-at-2 / restore-at-3 round trip;
and an end-to-end data-parallel run.

Each world size is one launch (``launch``) running every check; the tests read its results.
References run in this process on one thread, like each worker."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from flexshard import BlockShard, FlatRange, Owned, Shard, ShardedTensor, assign_owners, covering, layout_from_json
from flexshard.adamw import AdamWConfig
from flexshard.muon import MuonConfig
from flexshard.mxfp8 import dequantize, quantize
from flexshard.newton_schulz import adjust_lr, newton_schulz_flops, orthogonalize
from flexshard.optimizer import ShardedOptimizer, ShardingConfig
from flexshard.spawn import run_workers
from optimizer_runs import CONFIG_A, MUON, SAVE_AFTER, SHAPES, STEPS, _feed_reduced, _run_steps, assert_params_match, bits_equal, build, gradients, initial_params, one_thread, torch_reference

CONFIG_B = (
    MuonConfig(lr=0.03, weight_decay=0.02, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"),
    AdamWConfig(lr=0.005, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
)


def pieces(opt):
    """A picklable copy of this rank's state: (layout json, global shape, range, local)."""
    sd = opt.state_dict()
    out = {}
    for name, states in sd["params"].items():
        for key, st in states.items():
            out[(name, key)] = (st.layout.to_json(), st.global_shape, tuple(st.flat_range), st.local.clone())
    return sd["step"], out


def rebuild(per_rank_pieces):
    """Global tensors from every rank's saved pieces, with ``covering``."""
    out = {}
    for key in per_rank_pieces[0]:
        _, shape, _, local = per_rank_pieces[0][key]
        ranges = [FlatRange(*p[key][2]) for p in per_rank_pieces]
        flat = torch.empty(math.prod(shape), dtype=local.dtype)
        for ov in covering(FlatRange(0, flat.numel()), ranges):
            src = per_rank_pieces[ov.source_index][key][3].reshape(-1)
            flat[ov.start : ov.stop] = src[ov.source_offset : ov.source_offset + ov.stop - ov.start]
        out[key] = flat.view(shape)
    return out


# --- end to end: a tiny data-parallel MLP ------------------------------------------------------

E2E_BATCH, E2E_STEPS = 24, 10


def e2e_model(seed=5):
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(256, 64, generator=g) / 8,
        "fc1.bias": torch.zeros(256),
        "fc2.weight": torch.randn(16, 256, generator=g) / 16,
        "fc2.bias": torch.zeros(16),
    }


def e2e_batch(step):
    g = torch.Generator().manual_seed(77 + step)
    x = torch.randn(E2E_BATCH, 64, generator=g)
    return x, torch.sin(x[:, :16] * 2)


def e2e_loss(p, x, y):
    h = torch.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    return F.mse_loss(h @ p["fc2.weight"].T + p["fc2.bias"], y)


E2E_MUON = ["fc1.weight", "fc2.weight"]
E2E_CONFIG = (MuonConfig(lr=0.05), AdamWConfig(lr=0.01))


def e2e_reference():
    p = {n: t.clone().requires_grad_() for n, t in e2e_model().items()}
    m = torch.optim.Muon([p[n] for n in E2E_MUON], **dataclasses.asdict(E2E_CONFIG[0]))
    a = torch.optim.AdamW([p["fc1.bias"], p["fc2.bias"]], lr=E2E_CONFIG[1].lr)
    losses = []
    with one_thread():
        for step in range(E2E_STEPS):
            x, y = e2e_batch(step)
            loss = e2e_loss(p, x, y)
            loss.backward()
            losses.append(loss.item())
            m.step()
            a.step()
            m.zero_grad()
            a.zero_grad()
    return {n: t.detach() for n, t in p.items()}, losses


# --- the launch ---------------------------------------------------------------------------------


def _feed_split(opt, params, step):
    # rank r holds the elements whose flat index is r mod W, zeros elsewhere: the sum over
    # ranks is exact, so the reduce path itself must give the reference's bits
    rank, world = opt.rank, opt.world_size
    for n, g in gradients(step).items():
        keep = (torch.arange(g.numel()) % world == rank).view(g.shape)
        params[n].grad = torch.where(keep, g, torch.zeros_like(g))
    opt.reduce_gradients()


def _optimizer_checks(rank, world, saved):
    out = {}
    for label, config, placement, feed, extra in [
        ("owned/reduced", CONFIG_A, "owned", _feed_reduced, {}),
        ("fsdp/reduced", CONFIG_B, "fsdp", _feed_reduced, {}),
        ("owned/split", CONFIG_A, "owned", _feed_split, {"average_gradients": False}),
        ("fsdp/split", CONFIG_A, "fsdp", _feed_split, {"average_gradients": False}),
    ]:
        params, opt = build(config, placement, **extra)
        _run_steps(opt, params, 1, STEPS, feed)
        out[label] = {
            "params": {n: p.detach().clone() for n, p in params.items()},
            "pieces": pieces(opt)[1],
            "layouts": {e.name: e.layout.to_json() for e in opt.entries},
            "ns_flops": opt.ns_flops,
            "wire": opt.stats.bytes_sent,
        }
    if world > 1:  # the NCCL path (the backend's own all-gather, packed buckets), run on gloo
        import flexshard.collectives as collectives
        import flexshard.optimizer as optimizer
        plain, gather, native_calls = collectives.sends_point_to_point, collectives._ALL_GATHER_SINGLE, []

        def counted_gather(*args, **kwargs):
            native_calls.append(1)
            return gather(*args, **kwargs)

        collectives.sends_point_to_point = optimizer.sends_point_to_point = lambda group=None: False
        collectives._ALL_GATHER_SINGLE = counted_gather
        try:
            params, opt = build(CONFIG_A, "owned")
            _run_steps(opt, params, 1, STEPS, _feed_reduced)
        finally:
            collectives.sends_point_to_point = optimizer.sends_point_to_point = plain
            collectives._ALL_GATHER_SINGLE = gather
        out["owned/native-gather"] = {"params": {n: p.detach().clone() for n, p in params.items()},
                                      "native_calls": len(native_calls)}
    # MXFP8 compute copy: masters stay exact, parameters are their MXFP8 image
    mx_shapes = {n: s for n, s in SHAPES.items() if n != "gain"}
    params = {n: t.clone().requires_grad_() for n, t in initial_params(shapes=mx_shapes).items()}
    opt = ShardedOptimizer(params, *CONFIG_A, ShardingConfig(compute_copy="mxfp8", mx_blocks="column"),
                           muon_params=MUON)
    for step in range(1, STEPS + 1):
        opt.set_reduced_gradients(gradients(step, mx_shapes))
        opt.step()
    out["mx"] = {"params": {n: p.detach().clone() for n, p in params.items()}, "pieces": pieces(opt)[1]}
    # state at SAVE_AFTER steps, for the restore test at another world size
    if world == 2:
        params, opt = build(CONFIG_A, "owned")
        _run_steps(opt, params, 1, SAVE_AFTER, _feed_reduced)
        out["saved"] = pieces(opt)
    if saved is not None:
        out["restored"] = _restore_and_continue(rank, world, saved)
    if world > 1:
        out["e2e"] = _e2e(rank, world)
    return out


def _restore_and_continue(rank, world, saved):
    step, globals_ = saved
    params = {n: t.clone().requires_grad_() for n, t in initial_params(seed=99).items()}  # wrong on purpose
    opt = ShardedOptimizer(params, *CONFIG_A, ShardingConfig(), muon_params=MUON)
    sd = opt.state_dict()
    for (name, key), whole in globals_.items():
        st = sd["params"][name][key]  # the checkpointer's part: load in place, by flat range
        r = st.flat_range
        st.local.view(-1).copy_(whole.reshape(-1)[r.start : r.stop])
    sd["step"] = step
    opt.load_state_dict(sd)
    after_load = {n: p.detach().clone() for n, p in params.items()}
    _run_steps(opt, params, step + 1, STEPS, _feed_reduced)
    return {
        "after_load": after_load,
        "params": {n: p.detach().clone() for n, p in params.items()},
        "layouts": {e.name: e.layout.to_json() for e in opt.entries},
    }


def _e2e(rank, world):
    params = {n: t.clone().requires_grad_() for n, t in e2e_model().items()}
    opt = ShardedOptimizer(params, *E2E_CONFIG, muon_params=E2E_MUON)
    per = E2E_BATCH // world
    for step in range(E2E_STEPS):
        x, y = e2e_batch(step)
        loss = e2e_loss(params, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.reduce_gradients()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in params.items()}


_LAUNCHES: dict[int, list] = {}


def launch(world):
    if world not in _LAUNCHES:
        saved = None
        if world == 3:
            step, per_rank = zip(*[r["saved"] for r in launch(2)])
            saved = (step[0], rebuild(list(per_rank)))
        if world == 1:
            with one_thread():
                _LAUNCHES[world] = [_optimizer_checks(0, 1, saved)]
        else:
            _LAUNCHES[world] = run_workers(_optimizer_checks, world, saved, timeout=170)
    return _LAUNCHES[world]


@pytest.fixture(scope="module")
def references():
    return {"A": torch_reference(CONFIG_A), "B": torch_reference(CONFIG_B)}


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def world(request):
    return request.param


# --- equivalence --------------------------------------------------------------------------------

def test_backends_own_all_gather_nccls_path_gives_the_same_bits(world, references):
    if world == 1:
        pytest.skip("no gather at world 1")
    want, _ = references["A"]
    for rank, res in enumerate(launch(world)):
        assert res["owned/native-gather"]["native_calls"] == STEPS, f"rank {rank}/{world} ran the point-to-point path"
        assert_params_match(res["owned/native-gather"]["params"], want, f"native gather rank {rank}/{world}")


@pytest.mark.parametrize("label, ref", [("owned/reduced", "A"), ("fsdp/reduced", "B")])
def test_five_steps_are_bit_identical_to_torch_muon_and_adamw(world, references, label, ref):
    want, _ = references[ref]
    for rank, res in enumerate(launch(world)):
        assert_params_match(res[label]["params"], want, f"{label} rank {rank}/{world}")


@pytest.mark.parametrize("label", ["owned/split", "fsdp/split"])
def test_gradients_reduced_by_layout_give_the_same_bits(world, references, label):
    want, _ = references["A"]
    for rank, res in enumerate(launch(world)):
        assert_params_match(res[label]["params"], want, f"{label} rank {rank}/{world}")


@pytest.mark.parametrize("label, ref", [("owned/reduced", "A"), ("fsdp/reduced", "B")])
def test_sharded_state_holds_torchs_momentum_and_moments(world, references, label, ref):
    want_params, want_state = references[ref]
    got = rebuild([res[label]["pieces"] for res in launch(world)])
    for name, state in want_state.items():
        assert bits_equal(got[(name, "master")], want_params[name]), name
        for key, tensor in state.items():
            assert bits_equal(got[(name, key)], tensor), (name, key)


def test_owned_placement_splits_newton_schulz_work_and_fsdp_repeats_it(world):
    results = launch(world)
    total = sum(newton_schulz_flops(SHAPES[n]) for n in MUON)
    owned = [r["owned/reduced"]["ns_flops"] for r in results]
    fsdp = [r["fsdp/reduced"]["ns_flops"] for r in results]
    assert sum(owned) == STEPS * total  # each matrix once per step, somewhere
    assert fsdp == [STEPS * total] * world  # every matrix on every rank
    layouts = results[0]["owned/reduced"]["layouts"]
    assert {n: layout_from_json(layouts[n]) for n in MUON} == {n: Owned(layouts[n]["owner"]) for n in MUON}
    assert layout_from_json(layouts["norm"]) == BlockShard(32)
    assert all(layout_from_json(v) == Shard(0) for v in results[0]["fsdp/reduced"]["layouts"].values())


def test_owned_placement_sends_fewer_bytes_than_fsdp(world):
    if world == 1:
        pytest.skip("nothing on the wire at world 1")
    for res in launch(world):
        # owned: gradient reduce-scatter + fp32 parameter all-gather; fsdp adds a bf16
        # all-gather of every matrix's update
        assert res["owned/reduced"]["wire"] < res["fsdp/reduced"]["wire"]


def test_mxfp8_compute_copy_is_the_mx_image_of_exact_masters(world, references):
    want, _ = references["A"]
    mx_names = [n for n in SHAPES if n != "gain"]
    results = launch(world)
    masters = rebuild([r["mx"]["pieces"] for r in results])
    for name in mx_names:
        assert bits_equal(masters[(name, "master")], want[name]), name
        blocks = "column" if want[name].ndim == 2 else "row"
        image = dequantize(quantize(want[name], blocks=blocks))
        for rank, res in enumerate(results):
            assert bits_equal(res["mx"]["params"][name], image), (name, rank)


# --- state: save at world 2, restore at world 3 ------------------------------------------------

def test_state_saved_at_world_2_restores_at_world_3_and_continues_bit_identically(references):
    want, _ = references["A"]
    saved_layouts = launch(2)[0]["owned/reduced"]["layouts"]
    results = launch(3)
    for rank, res in enumerate(results):
        assert_params_match(res["restored"]["params"], want, f"restored rank {rank}/3")
    # the uninterrupted distributed run at world 2 ended with the same bits
    assert_params_match(launch(2)[0]["owned/reduced"]["params"], want, "uninterrupted world 2")
    new_layouts = results[0]["restored"]["layouts"]
    moved = [n for n in MUON if saved_layouts[n] != new_layouts[n]]
    assert moved, "owners at world 3 should differ from world 2 for some matrix (momentum must move)"


def test_loading_state_regathers_the_parameters_from_the_masters(references):
    saved_step, saved = zip(*[r["saved"] for r in launch(2)])
    masters = rebuild(list(saved))
    for res in launch(3):
        for name in SHAPES:
            assert bits_equal(res["restored"]["after_load"][name], masters[(name, "master")]), name


def test_state_dict_is_sharded_tensors_and_ints_created_eagerly_with_the_same_structure_everywhere(monkeypatch):
    # the structure depends on shapes only: emulate the ranks of a world of 3 without processes
    sds = [_optimizer_at(monkeypatch, initial_params(), rank, 3).state_dict() for rank in range(3)]
    for sd in sds:
        assert set(sd) == {"step", "params"} and sd["step"] == 0
        for name, states in sd["params"].items():
            kinds = {"master", "momentum_buffer"} if name in MUON else {"master", "exp_avg", "exp_avg_sq"}
            assert set(states) == kinds, name
            assert all(isinstance(st, ShardedTensor) and st.global_shape == tuple(SHAPES[name])
                       for st in states.values())
    structure = [{n: {k: (st.layout, st.global_shape) for k, st in s.items()} for n, s in sd["params"].items()}
                 for sd in sds]
    assert structure[0] == structure[1] == structure[2]
    for n in MUON:  # an Owned tensor exists on every rank, empty but on its owner
        sizes = [sd["params"][n]["momentum_buffer"].local.numel() for sd in sds]
        assert sorted(sizes) == [0, 0, math.prod(SHAPES[n])], n


def _optimizer_at(monkeypatch, params, rank, world, **kwargs):
    """An optimizer that believes it is ``rank`` of ``world`` (no process group)."""
    monkeypatch.setattr("flexshard.optimizer.current_world", lambda group=None: (rank, world))
    params = {n: t.clone() for n, t in params.items()}
    return ShardedOptimizer(params, muon_params=kwargs.pop("muon_params", MUON), **kwargs)


def test_state_dict_locals_are_the_live_state():
    params = {n: t.clone().requires_grad_() for n, t in initial_params().items()}
    opt = ShardedOptimizer(params, *CONFIG_A, muon_params=MUON)
    sd = opt.state_dict()
    opt.set_reduced_gradients(gradients(1))
    opt.step()
    assert sd["params"]["w_odd"]["momentum_buffer"].local.abs().sum() > 0  # same tensor, updated
    sd["params"]["norm"]["master"].local.fill_(3.0)
    sd["step"] = 7
    opt.load_state_dict(sd)
    assert opt.step_count == 7 and torch.equal(params["norm"].detach(), torch.full((1000,), 3.0))


def test_load_state_dict_rejects_state_laid_out_for_another_world():
    params = {n: t.clone() for n, t in initial_params().items()}
    opt = ShardedOptimizer(params, muon_params=MUON)
    sd = opt.state_dict()
    st = sd["params"]["norm"]["exp_avg"]
    sd["params"]["norm"]["exp_avg"] = ShardedTensor(torch.zeros(1000), Shard(0), (1000,), 0, 1)
    with pytest.raises(ValueError, match=r"params\.norm\.exp_avg.*load the saved pieces into the ShardedTensors"):
        opt.load_state_dict(sd)
    sd["params"]["norm"]["exp_avg"] = st
    del sd["params"]["bias"]
    with pytest.raises(ValueError, match=r"missing \['bias'\]"):
        opt.load_state_dict(sd)


# --- end to end ------------------------------------------------------------------------------------

def test_data_parallel_training_stays_within_bf16_newton_schulz_noise_of_single_process(world):
    """Real gradient reduction: each rank's mean-loss gradient over its 24/W samples,
    summed and divided by W, equals the full-batch gradient only up to fp32 summation
    order (relative ~1e-7). Muon's Newton-Schulz runs in bf16 (8 significant bits): such a
    change usually leaves every bf16 input equal, but when one input rounds the other way
    the orthogonalized update moves by a few bf16 ulps (a one-ulp flip of 3 inputs moves
    O by up to 0.012 where max|O| ~ 0.4, measured on 48x16 to 256x256 matrices). From then
    on the runs see slightly different gradients, so AdamW's normalized update (O(1) per
    element, like O) moves too. Bound tested, per element: the sum over steps of
    lr_eff * 2^-5, lr_eff being Muon's shape-adjusted lr for matrices and AdamW's lr for the
    rest, i.e. each step's normalized update may differ by 2^-5 (8 bf16 ulps at 1)."""
    if world == 1:
        pytest.skip("the end-to-end run needs at least two ranks")
    want, losses = e2e_reference()
    assert losses[-1] < losses[0]  # the reference does learn
    for rank, got in enumerate(r["e2e"] for r in launch(world)):
        for name, ref in want.items():
            if name in E2E_MUON:
                lr_eff = adjust_lr(E2E_CONFIG[0].lr, None, ref.shape)
            else:
                lr_eff = E2E_CONFIG[1].lr
            diff = (got[name] - ref).abs().max().item()
            assert diff <= E2E_STEPS * lr_eff * 2.0**-5, (name, rank, diff)


# --- units ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (33, 40), (1, 7), (7, 1)])
def test_newton_schulz_matches_torchs_private_implementation_bit_for_bit(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    ours = orthogonalize(g)
    theirs = _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


def test_newton_schulz_flops_count_three_matmuls_per_step():
    assert newton_schulz_flops((64, 96)) == 5 * (4 * 64 * 64 * 96 + 2 * 64**3)
    assert newton_schulz_flops((96, 64)) == newton_schulz_flops((64, 96))


def test_owners_balance_newton_schulz_flops_not_bytes(monkeypatch):
    # By bytes, "big" (1 MiB) would share a rank with a 64x2048 matrix; by Newton-Schulz
    # cost it is 6x everything else together, so it gets a rank to itself.
    shapes = {"big": (512, 512), "long": (64, 4096), "thin_a": (64, 2048), "thin_b": (64, 2048)}
    params = {n: torch.zeros(s) for n, s in shapes.items()}
    opt = _optimizer_at(monkeypatch, params, 0, 2, muon_params=None)
    costs = {n: newton_schulz_flops(s) for n, s in shapes.items()}
    others = {opt.owners[n] for n in shapes if n != "big"}
    assert others == {1 - opt.owners["big"]}
    by_bytes = assign_owners({n: math.prod(s) * 4 for n, s in shapes.items()}, 2)
    assert by_bytes["thin_a"] == by_bytes["big"]  # what a bytes-only balancer would have done
    assert max(opt.owner_loads()) == costs["big"]
    assert opt.load_ratio() == costs["big"] / (costs["long"] + costs["thin_a"] + costs["thin_b"])


def test_configuration_errors_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="ShardingConfig.placement must be one of"):
        ShardingConfig(placement="zero3")
    with pytest.raises(ValueError, match="MuonConfig.adjust_lr_fn"):
        MuonConfig(adjust_lr_fn="cosine")
    with pytest.raises(ValueError, match="Muon needs 2-D matrices.*Leave them to AdamW"):
        ShardedOptimizer({"b": torch.zeros(3)}, muon_params=["b"])
    with pytest.raises(ValueError, match="compute_copy='mxfp8' handles 1-D and 2-D"):
        ShardedOptimizer({"g": torch.zeros(())}, sharding=ShardingConfig(compute_copy="mxfp8"))
    opt = ShardedOptimizer({"w": torch.zeros(4, 4, requires_grad=True)})
    with pytest.raises(ValueError, match="'w' has no gradient"):
        opt.reduce_gradients()


@pytest.mark.parametrize("offset", [0, 5])
def test_adamw_in_cache_sized_pieces_gives_torchs_bits_on_a_large_unaligned_piece(offset):
    # several CPU_CHUNK pieces and a ragged tail, starting at an odd element of its storage
    # (as a row piece of a flat bucket does): the same bits as torch.optim.AdamW's one pass
    from flexshard.adamw import CPU_CHUNK, adamw_step_

    n = 3 * CPU_CHUNK + 1001
    g = torch.Generator().manual_seed(11)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * (1 + s) for s in range(4)]
    cfg = AdamWConfig(lr=0.01, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.05)
    ref = start.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            foreach=False)
    store = torch.zeros(3, n + offset)  # param, exp_avg, exp_avg_sq as unaligned pieces of flat buffers
    param, exp_avg, exp_avg_sq = (store[i, offset:] for i in range(3))
    param.copy_(start)
    for step, grad in enumerate(grads, start=1):
        ref.grad = grad.clone()
        opt.step()
        adamw_step_(param, grad, exp_avg, exp_avg_sq, step, cfg)
    st = opt.state[ref]
    for ours, theirs in ((param, ref.detach()), (exp_avg, st["exp_avg"]), (exp_avg_sq, st["exp_avg_sq"])):
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
