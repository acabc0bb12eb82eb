"""flexckpt as torchtitan's checkpoint manager and zephon_state as its data loader, in
torchtitan 0.3.0's own trainer (CPU, gloo, a 2-layer debug model; see torchtitan_cpu.py):

- a 2-rank FSDP2 run resumed from its half-way checkpoint (step 2 of 4) at 2 ranks gives the same losses,
  bit for bit, and the same global batches as the uninterrupted run;
- resumed at 1 rank, the zephon loader yields the same global batches (equal
  global_batch_sha256 at every resumed step);
- a lane count or a global batch that does not split fails at start, naming sizes that work.

The full matrix (DCP baselines, 4 ranks, the default loader's refusal) runs with
``python3 dev.py test-torchtitan`` (tests/torchtitan_matrix.py).
"""
from __future__ import annotations

import sys

import pytest

if sys.version_info < (3, 11):
    pytest.skip("torchtitan 0.3.0 needs Python >= 3.11", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e .[test] on Python >= 3.11)")

import torchtitan_cpu as tt  # noqa: E402

from flexshard.spawn import run_workers  # noqa: E402
from zephon_state import global_batch_digest  # noqa: E402

TIMEOUT = 240.0
# 4 steps, a checkpoint every 2 (command-line overrides of the config function's 8 and 4)
SHORT = ["--training.steps", "4", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, monkeypatch_module):
    folder = tt.make_assets(tmp_path_factory.mktemp("tt-assets"))
    monkeypatch_module.setenv("TT_ASSETS", str(folder))
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(folder / "hf-cache"))
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _runs(rank: int, world: int, plan: list[tuple[list[str], int | None]]) -> list[dict]:
    return [tt.run_trainer(rank, world, args, stop_after) for args, stop_after in plan]


def global_digests(per_rank: list[dict]) -> list[str]:
    """global_batch_sha256 per step: every rank's lane digests, combined in lane order."""
    steps = len(per_rank[0]["digests"])
    out = []
    for i in range(steps):
        lanes = {int(k): bytes.fromhex(v) for r in per_rank for k, v in r["digests"][i].items()}
        out.append(global_batch_digest(lanes))
    return out


def _runs_then_alone(rank: int, world: int, plan: list[tuple[list[str], int | None]],
                     alone: list[str]) -> tuple[list[dict], dict | None]:
    """``_runs``, then rank 0 runs ``alone`` in a group of its own (world 1): a resume at
    1 rank without starting (and importing torchtitan in) another process."""
    import torch.distributed as dist

    runs = _runs(rank, world, plan)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return runs, None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return runs, tt.run_trainer(0, 1, alone)


@pytest.fixture(scope="module")
def zephon_run(assets, tmp_path_factory):
    """The uninterrupted 2-rank run (checkpoints at steps 2 and 4), in the same processes
    its resume from step 2 at 2 ranks, then rank 0's resume from step 2 at 1 rank."""
    dump = tmp_path_factory.mktemp("tt-zephon")
    base = ["--config", "flex_zephon", "--dump_folder", str(dump), "--checkpoint.enable", *SHORT]
    resume = [*base, "--checkpoint.load_step", "2"]
    ranks = run_workers(_runs_then_alone, 2, [(base, None), (resume, None)], resume, timeout=TIMEOUT)
    return [r[0][0] for r in ranks], [r[0][1] for r in ranks], [ranks[0][1]]


def test_fsdp2_resume_at_2_ranks_is_bit_exact(zephon_run):
    full, resumed, _ = zephon_run
    assert sorted(full[0]["losses"]) == [1, 2, 3, 4]
    assert sorted(resumed[0]["losses"]) == [3, 4]
    for step in (3, 4):
        assert resumed[0]["losses"][step] == full[0]["losses"][step], step  # bit for bit
    assert global_digests(resumed) == global_digests(full)[2:]


def test_zephon_resume_at_1_rank_yields_the_same_global_batches(zephon_run):
    full, _, one = zephon_run
    assert sorted(one[0]["losses"]) == [3, 4]
    assert global_digests(one) == global_digests(full)[2:]


@pytest.mark.parametrize("lanes, dp, global_batch, fix", [
    (4, 3, 12, "Use a lane count that is a multiple of 3 (e.g. 12"),
    (4, 2, 6, "Use a global batch that is a multiple of 4 (e.g. 8)"),
])
def test_bad_lanes_or_batch_fail_at_start(assets, lanes, dp, global_batch, fix):
    from flexckpt_torchtitan import ZephonDataLoader

    tt.cpu_device()
    config = ZephonDataLoader.Config(dataset_path=str(assets / "data" / "train.jsonl"), lanes=lanes,
                                     global_batch_size=global_batch, tokenizer_path=str(assets / "tokenizer"))
    with pytest.raises(ValueError) as err:
        config.build(dp_world_size=dp, dp_rank=0, tokenizer=None, seq_len=64, local_batch_size=2,
                     snapshot_every_n_steps=None)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"ZephonDataLoader (dataloader.lanes={lanes}, global batch {global_batch}, "
                              f"data-parallel degree {dp}, local batch 2): ")
    assert fix in message


class _Stateful:
    def __init__(self, **values):
        self.values = dict(values)

    def state_dict(self):
        return dict(self.values)

    def load_state_dict(self, sd):
        self.values = dict(sd)


def _manager(tmp_path, dataloader=None, **fields):
    """The manager around a 1-process state (no trainer): a Linear, and stand-ins for the
    optimizers, schedulers and train state."""
    import torch
    from flexckpt_torchtitan import FlexCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    config = FlexCheckpointManager.Config(enable=True, folder="ckpt", **fields)
    train = _Stateful(step=0)
    manager = config.build(dataloader=dataloader, model_parts=[model], optimizers=_Stateful(lr=0.5),
                           lr_schedulers=_Stateful(last_epoch=0), states={"train_state": train},
                           sd_adapter=None, base_folder=str(tmp_path))
    return manager, model, train


def test_manager_owns_interval_first_and_last_step_and_load_only(tmp_path):
    manager, _, train = _manager(tmp_path, interval=3, enable_first_step_checkpoint=True,
                                 last_save_model_only=False)
    saved = [s for s in range(1, 8) if manager.save(s, last_step=s == 7)]
    manager.close()
    assert saved == [1, 3, 6, 7]
    assert manager.ckpt is None
    reader, _, _ = _manager(tmp_path, load_only=True, interval=1)
    assert reader.ckpt.steps() == [1, 3, 6, 7]
    assert not reader.save(8) and reader.ckpt.steps() == [1, 3, 6, 7]
    reader.close()


def test_a_model_only_last_save_is_an_export_and_is_not_resumed(tmp_path):
    import torch
    from flexckpt import LoadError

    manager, model, train = _manager(tmp_path, interval=2, export_dtype="bfloat16")
    train.values["step"] = 2
    assert manager.save(2) and manager.save(3, last_step=True)
    manager.close()
    other, model2, train2 = _manager(tmp_path)
    contents = other.ckpt.contents(3).by_name()
    assert {info.dtype for info in contents.tensors.values()} == {torch.bfloat16}
    assert not any(name.startswith("train_state/") for name in contents.plain)
    with pytest.raises(LoadError, match=r"^step 3 under .* is a model-only export \(last_save_model_only=True\)"):
        other.load()
    with torch.no_grad():
        model2.weight.zero_()
    assert other.load(step=2) and train2.values["step"] == 2
    assert torch.equal(model2.weight, model.weight)
    other.close()


def test_unknown_exclude_from_loading_key_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match=r"exclude_from_loading names 'dataloadr'; the state has \["):
        _manager(tmp_path, exclude_from_loading=["dataloadr"])


def _titan_loader(dp_rank: int, dp_world_size: int):
    """torchtitan's own loader (``ParallelAwareDataloader``) over 12 numbers."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    return ParallelAwareDataloader(list(range(12)), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=2)


def test_torchtitan_loader_state_is_bytes_by_key_and_resumes_only_at_its_dp_degree(tmp_path):
    """torchtitan's loader saves {"dp_rank_<d>": pickled bytes, "world_size": dp}: flexckpt
    stores the bytes by key and hands them back as saved; at another dp degree the load is
    refused in one line naming the fix, and exclude_from_loading=["dataloader"] loads the rest."""
    from flexckpt import LoadError

    loader = _titan_loader(dp_rank=1, dp_world_size=2)  # rank 1 of dp 2, as one TP peer sees it
    batches = iter(loader)
    consumed = [next(batches).tolist() for _ in range(2)]
    saved = loader.state_dict()
    manager, _, train = _manager(tmp_path, dataloader=loader, interval=1)
    train.values["step"] = 1
    assert manager.save(1)
    manager.close()

    resumed = _titan_loader(dp_rank=1, dp_world_size=2)
    reader, _, train2 = _manager(tmp_path, dataloader=resumed)
    contents = reader.ckpt.contents(1).by_name()
    assert contents.keyed == ["dataloader/dp_rank_1"] and contents.plain["dataloader/world_size"] == 2
    assert reader.load() and train2.values["step"] == 1
    assert resumed.state_dict() == saved  # the same bytes: the pickled position, restored as saved
    assert consumed == [[0, 1], [2, 3]] and next(iter(resumed)).tolist() == [4, 5]
    reader.close()

    other = _titan_loader(dp_rank=0, dp_world_size=1)
    reader, _, _ = _manager(tmp_path, dataloader=other)
    with pytest.raises(LoadError) as err:
        reader.load()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("the data loader's state was saved at data-parallel degree 2 and this run's is 1: ")
    assert "use ZephonDataLoader" in message and "checkpoint.exclude_from_loading=['dataloader']" in message
    reader.close()

    untouched = _titan_loader(dp_rank=0, dp_world_size=1).state_dict()
    reader, _, train3 = _manager(tmp_path, dataloader=other, exclude_from_loading=["dataloader"])
    assert reader.load() and train3.values["step"] == 1
    assert other.state_dict() == untouched  # excluded: it keeps what it holds
    reader.close()
