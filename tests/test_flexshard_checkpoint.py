"""The sharded optimizer's state through a real flexckpt checkpoint: saved by 2 ranks,
restored by 3 (owners recomputed, momentum moves with them), 3 more steps bit-identical to
single-process torch.optim.Muon / AdamW fed the same gradients."""
from flexckpt import Checkpointer
from flexshard import Owned
from flexshard.optimizer import ShardedOptimizer, ShardingConfig
from flexshard.spawn import run_workers
from optimizer_runs import (
    CONFIG_A,
    MUON,
    SAVE_AFTER,
    STEPS,
    _feed_reduced,
    _run_steps,
    assert_params_match,
    build,
    initial_params,
    torch_reference,
)


def _save_at(rank, world, url):
    params, opt = build(CONFIG_A, "owned")
    _run_steps(opt, params, 1, SAVE_AFTER, _feed_reduced)
    with Checkpointer(url, run_id="optim-save") as ckpt:
        handle = ckpt.save(SAVE_AFTER, {"optim": opt})
        handle.wait_staged()
        handle.result(timeout=60)
    return {e.name: e.layout for e in opt.entries}


def _restore_and_continue(rank, world, url):
    params = {n: t.clone().requires_grad_() for n, t in initial_params(seed=99).items()}  # wrong on purpose
    opt = ShardedOptimizer(params, *CONFIG_A, ShardingConfig(), muon_params=MUON)
    with Checkpointer(url, run_id="optim-load") as ckpt:
        step = ckpt.load({"optim": opt})
        read = ckpt.last_load_stats.bytes_read
    _run_steps(opt, params, step + 1, STEPS, _feed_reduced)
    return {"step": step, "params": {n: p.detach().clone() for n, p in params.items()},
            "layouts": {e.name: e.layout for e in opt.entries}, "read": read}


def test_optimizer_state_saved_at_world_2_restores_at_world_3_through_flexckpt_bit_identically(tmp_path):
    want, _ = torch_reference(CONFIG_A)
    saved_layouts = run_workers(_save_at, 2, str(tmp_path), timeout=120)[0]
    results = run_workers(_restore_and_continue, 3, str(tmp_path), timeout=120)
    for rank, res in enumerate(results):
        assert res["step"] == SAVE_AFTER
        assert_params_match(res["params"], want, f"restored through flexckpt, rank {rank}/3")
    moved = [n for n in MUON if saved_layouts[n] != results[0]["layouts"][n]]
    assert moved and all(isinstance(results[0]["layouts"][n], Owned) for n in MUON)
    # each rank reads only what it now holds, not the whole checkpoint
    total = sum(r["read"] for r in results)
    assert max(r["read"] for r in results) < total
