"""Sharded-optimizer runs against torch.optim's Muon and AdamW: the configurations, the parameters
built per rank, the steps run and the comparison, shared by the optimizer and checkpoint tests."""
import dataclasses
from contextlib import contextmanager

import torch

from flexshard.adamw import AdamWConfig
from flexshard.muon import MuonConfig
from flexshard.optimizer import ShardedOptimizer, ShardingConfig

STEPS = 5

SAVE_AFTER = 2


# Awkward shapes: wide, tall, odd, ragged row counts for BlockShard(32) and Shard(0).
SHAPES = {
    "w_wide": (64, 96),
    "w_tall": (96, 64),
    "w_odd": (33, 40),
    "w_ragged": (130, 20),
    "w_flat": (8, 200),
    "embed": (67, 24),  # 2-D but AdamW, as torch's docs advise for embeddings
    "bias": (96,),
    "norm": (1000,),
    "gain": (),
}

MUON = ["w_wide", "w_tall", "w_odd", "w_ragged", "w_flat"]

CONFIG_A = (MuonConfig(lr=0.02), AdamWConfig(lr=0.01, weight_decay=0.05))


def initial_params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def gradients(step, shapes=SHAPES):
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=g) * (1 + step) for n, s in shapes.items()}


@contextmanager
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def torch_reference(config, steps=STEPS, shapes=SHAPES, muon=MUON):
    """Single-process torch.optim.Muon + AdamW fed the same gradients."""
    muon_cfg, adamw_cfg = config
    params = {n: t.clone().requires_grad_() for n, t in initial_params(shapes=shapes).items()}
    m = torch.optim.Muon([params[n] for n in muon], **dataclasses.asdict(muon_cfg))
    a = torch.optim.AdamW([p for n, p in params.items() if n not in muon], lr=adamw_cfg.lr, betas=adamw_cfg.betas,
                          eps=adamw_cfg.eps, weight_decay=adamw_cfg.weight_decay)
    with one_thread():
        for step in range(1, steps + 1):
            g = gradients(step, shapes)
            for n, p in params.items():
                p.grad = g[n].clone()
            m.step()
            a.step()
    state = {}
    for n, p in params.items():
        s = (m if n in muon else a).state[p]
        state[n] = {k: v for k, v in s.items() if k != "step"}
    return {n: p.detach() for n, p in params.items()}, state


def build(config, placement, **sharding):
    params = {n: t.clone().requires_grad_() for n, t in initial_params().items()}
    opt = ShardedOptimizer(params, *config, ShardingConfig(placement=placement, **sharding), muon_params=MUON)
    return params, opt


def _run_steps(opt, params, first, last, feed):
    for step in range(first, last + 1):
        feed(opt, params, step)
        opt.step()


def _feed_reduced(opt, params, step):
    opt.set_reduced_gradients(gradients(step))


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.int32), b.view(-1).view(torch.int32))


def assert_params_match(got, want, where):
    bad = [n for n in want if not bits_equal(got[n], want[n])]
    assert bad == [], f"{where}: parameters differ from torch.optim: {bad}"
