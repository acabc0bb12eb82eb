"""Tiny Lightning runs for tests/integrations/test_lightning.py, importable in spawned ranks.

A 2-layer MLP with AdamW and a StepLR schedule on 32 seeded random samples, its
hyper-parameters the kinds a trainer's dict holds (a dtype, a path, a tuple, None); every
rank records its training losses. ``fit`` runs one ``Trainer.fit`` and returns them.
"""
from __future__ import annotations

import os
import pathlib

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from flexckpt_lightning import FlexCheckpointing

SAMPLES = 32


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8, dtype: torch.dtype = torch.float32, out: pathlib.Path = pathlib.Path("/tmp"),
                 betas: tuple = (0.9, 0.99), note: str | None = None, extra: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05, betas=self.hparams.betas)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def data(batch_size: int, shuffle: bool) -> DataLoader:
    """32 samples; shuffled under DDP (Lightning's DistributedSampler: an order per epoch from
    seed and epoch), in order on one device (a plain shuffle's order would follow the loader's
    generator, which a new process starts afresh)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=g)
    y = x.sum(1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


class Sharded(Tiny):
    """Tiny, sharded by FSDP2 over the data-parallel mesh in ``configure_model``."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if not getattr(self, "_sharded", False):
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
            self._sharded = True


def fit(root: str, *, max_epochs: int, ckpt_path: str | None = None, devices: int = 1, batch_size: int = 4,
        plugins: list | None = None, async_save: bool = True, model: Tiny | None = None,
        sharded: bool = False) -> list[float]:
    """One ``Trainer.fit`` with flexckpt; checkpoints every 2 steps into ``root/ckpt`` (the
    newest 2 by step, and last.ckpt). ``sharded``: FSDP2 under FlexModelParallelStrategy.
    Returns this rank's losses."""
    from flexckpt_lightning import FlexModelParallelStrategy

    pl.seed_everything(0, verbose=False)
    model = model or (Sharded(dtype=None, out=None) if sharded else Tiny())
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=os.path.join(root, "ckpt"), every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
        save_last=True)
    strategy = (FlexModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if sharded
                else "ddp" if devices > 1 else "auto")
    trainer = pl.Trainer(
        default_root_dir=root, max_epochs=max_epochs, accelerator="cpu", devices=devices, strategy=strategy,
        plugins=plugins, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[FlexCheckpointing(async_save=async_save), checkpoint])
    trainer.fit(model, data(batch_size, shuffle=devices > 1), ckpt_path=ckpt_path)
    return model.losses


def both_strategies(rank: int, world: int, root: str, port: int, port_alone: int) -> dict:
    """DDP's then FlexModelParallelStrategy's runs (see stop_and_resume), in the same 2 processes."""
    return {"ddp": stop_and_resume(rank, world, os.path.join(root, "ddp"), port),
            "fsdp2": stop_and_resume(rank, world, os.path.join(root, "fsdp2"), port, True, port_alone)}


def stop_and_resume(rank: int, world: int, root: str, port: int, sharded: bool = False,
                    port_alone: int = 0) -> dict:
    """On each of 2 spawned ranks (Lightning with processes made outside it, as torchrun
    does): the uninterrupted 2-epoch run, a run stopped after epoch 1, its resume from
    ``last``. ``sharded``: then rank 0 alone (a group of 1) loads the full run's last
    checkpoint and returns its parameters, whole, and its global step."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    out = {"full": fit(os.path.join(root, "full"), max_epochs=2, devices=world, sharded=sharded),
           "stopped": fit(os.path.join(root, "cut"), max_epochs=1, devices=world, sharded=sharded),
           "resumed": fit(os.path.join(root, "cut"), max_epochs=2, devices=world, ckpt_path="last",
                          sharded=sharded)}
    if sharded:
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            os.environ.update(MASTER_PORT=str(port_alone), WORLD_SIZE="1")
            model = Sharded(dtype=None, out=None)
            fit(os.path.join(root, "alone"), max_epochs=2, devices=1, model=model, sharded=True,
                ckpt_path=os.path.join(root, "full", "ckpt", "last.ckpt"))  # at the end already: no step runs
            out["alone"] = {k: v.full_tensor() for k, v in model.net.state_dict().items()}
            out["alone_step"] = model.trainer.global_step
    return out
