"""A tiny Accelerate training loop for tests/integrations/test_accelerate.py, run on spawned ranks with
torchrun's environment (Accelerator(cpu=True): gloo when there are 2 processes)."""
from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 32


def torchrun_env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    torch.set_num_threads(1)


def train(url: str, *, epochs: int = 2, stop_at: int | None = None) -> dict[int, float]:
    """Train 2 epochs of 32 samples in global batches of 4 (``split_batches``: the loader's
    batch is split across processes, and a prepared scheduler steps once per step at any
    count), saving every 3 steps through AcceleratorCheckpoint and resuming from ``url``
    when it holds a step; stop after step ``stop_at``. Returns the mean loss per step."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from flexckpt_accelerate import AcceleratorCheckpoint

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, split_batches=True))
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    ckpt = AcceleratorCheckpoint(acc, url, keep_last=2)
    step = ckpt.load()
    losses: dict[int, float] = {}
    try:
        for epoch in range(ckpt.epoch, epochs):
            for xb, yb in ckpt.batches(loader, epoch):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                losses[step] = acc.reduce(loss.detach(), "mean").item()
                if step % 3 == 0:
                    ckpt.save(step)
                if step == stop_at:
                    return losses
        return losses
    finally:
        ckpt.close()


def runs(rank: int, world: int, root: str, port: int) -> dict:
    """The uninterrupted run, a run stopped after step 9 (one batch into epoch 2), and its resume."""
    import shutil

    import torch.distributed as dist

    torchrun_env(rank, world, port)
    full = train(os.path.join(root, "full"))
    stopped = train(os.path.join(root, "cut"), stop_at=9)
    dist.barrier()
    if rank == 0:  # for resume_alone: the resume below moves "cut" on (and retention drops step 9)
        shutil.copytree(os.path.join(root, "cut"), os.path.join(root, "alone"))
    dist.barrier()
    resumed = train(os.path.join(root, "cut"))
    return {"full": full, "stopped": stopped, "resumed": resumed}


def resume_alone(rank: int, world: int, root: str, port: int) -> dict[int, float]:
    """One process resumes the 2-process run's step 9 (the same global batch, 4)."""
    torchrun_env(rank, world, port)
    return train(os.path.join(root, "alone"))
