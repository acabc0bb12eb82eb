"""flexckpt in PyTorch Lightning's own Trainer (CPU; a tiny MLP made here, see helpers/lightning_runs.py):

- DDP on 2 gloo ranks, stopped after epoch 1 and resumed with ``ckpt_path="last"``: the
  losses of the uninterrupted run, bit for bit; single device too, sync and async; FSDP2
  under FlexModelParallelStrategy (Lightning's ModelParallelStrategy runs on CPU/gloo), also
  loaded at 1 rank from 2;
- ModelCheckpoint's paths: top-k removal, ``last.ckpt`` saved a second time at the same step,
  every path a flexckpt folder holding its global step, no file pickled; a ``save_last="link"``
  link removed alone; a removal right after an async save waits for it;
- the whole dict comes back with its types; a torch.save file is refused, never unpickled;
- a hyper-parameter flexckpt cannot represent stops ``fit`` before step 1, naming its key;
  AsyncCheckpointIO is refused, naming the race.
"""
from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e .[lightning])")

import torch  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import lightning_runs as lr  # noqa: E402
from flexckpt_lightning import FlexCheckpointIO  # noqa: E402
from flexckpt import Checkpointer, LoadError, UnsupportedState  # noqa: E402
from flexshard.spawn import run_workers  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def folders(ckpt_dir) -> dict[str, list[int]]:
    """Each checkpoint path under ``ckpt_dir`` -> the flexckpt steps it holds."""
    out = {}
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        assert os.path.isdir(path), f"{path} is a file: Lightning's torch.save wrote it"
        out[name] = Checkpointer(path, rank=0, world_size=1, read_only=True).steps()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """DDP's and FlexModelParallelStrategy's runs on one pair of spawned ranks (Lightning is
    imported once per rank): (the root folder, each rank's results)."""
    root = tmp_path_factory.mktemp("two-ranks")
    per_rank = run_workers(lr.both_strategies, 2, str(root), free_port(), free_port(), backend="none", timeout=300)
    return root, per_rank


def test_ddp_two_ranks_stopped_and_resumed_from_last_gives_the_uninterrupted_losses(two_ranks):
    root, results = two_ranks
    tmp_path = root / "ddp"
    for rank, runs in enumerate(r["ddp"] for r in results):
        assert len(runs["full"]) == 8 and len(runs["stopped"]) == 4, rank  # 2 epochs of 4 steps per rank
        assert runs["stopped"] == runs["full"][:4], rank
        assert runs["resumed"] == runs["full"][4:], rank  # exact: same data, same order, same state
    # steps 2 and 4 (top-2 by step) and last at step 4; epoch 2 then adds 6 and 8, removing 2 and 4
    assert folders(tmp_path / "cut" / "ckpt") == folders(tmp_path / "full" / "ckpt") == {
        "epoch=1-step=6.ckpt": [6], "epoch=1-step=8.ckpt": [8], "last.ckpt": [8]}


def test_model_parallel_fsdp2_resumes_exactly_and_loads_at_another_world_size(two_ranks):
    """Lightning's ModelParallelStrategy runs on CPU/gloo here: the real strategy, FSDP2 DTensors."""
    root, results = two_ranks
    tmp_path = root / "fsdp2"
    per_rank = [r["fsdp2"] for r in results]
    for rank, runs in enumerate(per_rank):
        assert len(runs["full"]) == 8 and runs["stopped"] == runs["full"][:4], rank
        assert runs["resumed"] == runs["full"][4:], rank
    # each rank wrote its own shards: no gather
    step_dir = tmp_path / "full" / "ckpt" / "last.ckpt" / "step-000000000008"
    (attempt,) = [p for p in step_dir.iterdir() if p.is_dir()]
    assert sorted(p.name for p in attempt.glob("*.data")) == ["r00000.data", "r00001.data"]
    # 2 ranks -> 1 rank: the whole parameters the 2 ranks saved, at their global step
    saved = Checkpointer(str(step_dir.parent), rank=0, world_size=1, read_only=True).load_dict()
    assert per_rank[0]["alone_step"] == 8
    for name, value in per_rank[0]["alone"].items():
        assert torch.equal(value, saved["state_dict"][f"net.{name}"]), name


@pytest.mark.parametrize("async_save", [True, False])
def test_single_device_stopped_and_resumed_gives_the_uninterrupted_losses(tmp_path, async_save):
    full = lr.fit(str(tmp_path / "full"), max_epochs=2, async_save=async_save)
    stopped = lr.fit(str(tmp_path / "cut"), max_epochs=1, async_save=async_save)
    assert folders(tmp_path / "cut" / "ckpt") == {
        "epoch=0-step=6.ckpt": [6], "epoch=0-step=8.ckpt": [8], "last.ckpt": [8]}
    resumed = lr.fit(str(tmp_path / "cut"), max_epochs=2, ckpt_path=str(tmp_path / "cut" / "ckpt" / "last.ckpt"),
                     async_save=async_save)
    assert len(full) == 16 and stopped == full[:8] and resumed == full[8:]


def test_async_checkpoint_io_is_refused_naming_the_race(tmp_path):
    with pytest.raises(TypeError, match="AsyncCheckpointIO removes top-k checkpoints"):
        lr.fit(str(tmp_path), max_epochs=1, plugins=[AsyncCheckpointIO()])


def test_checkpoint_dict_comes_back_with_its_types(tmp_path):
    """The whole Lightning dict, hyper-parameters included (a dtype, a Path, a tuple, None)."""
    lr.fit(str(tmp_path), max_epochs=1, model=lr.Tiny(dtype=torch.bfloat16, note=None))
    io = lr.FlexCheckpointing().io
    ckpt = io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    hp = ckpt["hyper_parameters"]
    assert hp["dtype"] is torch.bfloat16 and hp["betas"] == (0.9, 0.99) and hp["note"] is None
    assert isinstance(hp["out"], type(lr.Tiny().hparams.out)) and ckpt["global_step"] == 8
    assert ckpt["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert sorted(ckpt["optimizer_states"][0]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    model = lr.Tiny()
    model.load_state_dict(ckpt["state_dict"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(ckpt["optimizer_states"][0])


def test_a_path_is_a_url_holding_its_global_step_and_removal_waits_for_its_save(tmp_path):
    io = FlexCheckpointIO()  # async: save_checkpoint returns once staged
    path = tmp_path / "epoch=0-step=3.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.arange(4.0), "loops": {"n": [1, (2, None)]}}, path)
    io.save_checkpoint({"global_step": 5, "w": torch.ones(4), "loops": {"n": []}}, path)  # the same path again
    assert io.load_checkpoint(path)["loops"] == {"n": []}
    assert Checkpointer(str(path), rank=0, world_size=1, read_only=True).steps() == [5]  # keep_last=1
    link = tmp_path / "last.ckpt"  # ModelCheckpoint(save_last="link")
    link.symlink_to(path.name)
    assert io.load_checkpoint(link)["global_step"] == 5
    io.remove_checkpoint(link)
    assert not link.exists() and path.is_dir()  # the link went, not what it named
    io.save_checkpoint({"global_step": 7, "w": torch.zeros(4)}, path)
    io.remove_checkpoint(path)  # right after an async save: waits for it, then removes the folder
    assert not path.exists()
    io.teardown()


def test_a_torch_save_file_is_refused_not_unpickled(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(LoadError, match="never unpickles"):
        lr.FlexCheckpointing().io.load_checkpoint(path)


class Opaque:
    """An object with no state_dict: nothing flexckpt can represent."""


def test_unrepresentable_hyper_parameter_stops_fit_before_step_one(tmp_path):
    model = lr.Tiny(extra=Opaque())
    with pytest.raises(UnsupportedState, match="hyper_parameters.*extra"):
        lr.fit(str(tmp_path), max_epochs=1, model=model)
    assert model.losses == []  # no training step ran
    assert not (tmp_path / "ckpt").exists()


def test_a_misspelt_checkpointer_option_is_refused_when_the_plugin_is_made_not_at_its_first_save():
    from flexckpt_lightning import FlexCheckpointing, FlexModelParallelStrategy

    with pytest.raises(TypeError, match=r"^FlexCheckpointIO: 'compresion' is not a Checkpointer option; it takes "):
        FlexCheckpointing(compresion="zstd")
    with pytest.raises(TypeError, match=r"^FlexModelParallelStrategy\(checkpoint_options=...\): 'keeplast' is not a "):
        FlexModelParallelStrategy(checkpoint_options={"keeplast": 2})
    assert FlexCheckpointing(compression="zstd").io.options == {"compression": "zstd"}
