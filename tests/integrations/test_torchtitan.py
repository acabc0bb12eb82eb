"""flexckpt as torchtitan's checkpoint manager and zephon_state as its data loader, in
torchtitan 0.3.0's own trainer (CPU, gloo, a 2-layer debug model; see helpers/torchtitan_cpu.py):

- a 2-rank FSDP2 run resumed from its half-way checkpoint (step 2 of 4) at 2 ranks gives the same losses,
  bit for bit, and the same global batches as the uninterrupted run;
- resumed at 1 rank, the zephon loader yields the same global batches (equal
  global_batch_sha256 at every resumed step);
- a lane count or a global batch that does not split fails at start, naming sizes that work;
- the zephon loader under torchtitan's own DCP manager resumes at 2 and 1 ranks (in the
  same processes), and what a user sets up is parsed and checked at start (issue 25).

The full matrix (DCP baselines, 4 ranks, the default loader's refusal) runs with
``python3 dev.py test-torchtitan`` (tests/helpers/torchtitan_matrix.py).
"""
from __future__ import annotations

import os
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
                     alone: list[str], dcp_folder: str) -> tuple[list[dict], dict | None, list]:
    """``_runs`` and ``_dcp_rounds``, then rank 0 runs ``alone`` and resumes the DCP save in a
    group of its own (world 1): a resume at 1 rank without starting (and importing torchtitan
    in) another process."""
    import torch.distributed as dist

    runs = _runs(rank, world, plan)
    dcp = _or_error(_dcp_rounds, rank, world, dcp_folder)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return runs, None, dcp
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return runs, tt.run_trainer(0, 1, alone), [*dcp, _or_error(_dcp_resume, 0, 1, dcp_folder)]


def _or_error(fn, *args):
    """``fn(*args)``, or the error it raised as text (one failing part fails its own test)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return [f"{type(e).__name__}: {e}"]


@pytest.fixture(scope="module")
def zephon_run(assets, tmp_path_factory):
    """The uninterrupted 2-rank run (checkpoints at steps 2 and 4), in the same processes
    its resume from step 2 at 2 ranks, then rank 0's resume from step 2 at 1 rank; and the
    zephon loader under torchtitan's DCP manager (``_dcp_rounds``)."""
    dump = tmp_path_factory.mktemp("tt-zephon")
    base = ["--config", "flex_zephon", "--dump_folder", str(dump), "--checkpoint.enable", *SHORT]
    resume = [*base, "--checkpoint.load_step", "2"]
    ranks = run_workers(_runs_then_alone, 2, [(base, None), (resume, None)], resume,
                        str(tmp_path_factory.mktemp("tt-dcp")), timeout=TIMEOUT)
    return [r[0][0] for r in ranks], [r[0][1] for r in ranks], [ranks[0][1]], [r[2] for r in ranks]


def test_fsdp2_resume_at_2_ranks_is_bit_exact(zephon_run):
    full, resumed, _, _ = zephon_run
    assert sorted(full[0]["losses"]) == [1, 2, 3, 4]
    assert sorted(resumed[0]["losses"]) == [3, 4]
    for step in (3, 4):
        assert resumed[0]["losses"][step] == full[0]["losses"][step], step  # bit for bit
    assert global_digests(resumed) == global_digests(full)[2:]


def test_zephon_resume_at_1_rank_yields_the_same_global_batches(zephon_run):
    full, _, one, _ = zephon_run
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


def _manager(tmp_path, dataloader=None, train=None, **fields):
    """The manager around a 1-process state (no trainer): a Linear, and stand-ins for the
    optimizers, schedulers and train state."""
    import torch
    from flexckpt_torchtitan import FlexCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    config = FlexCheckpointManager.Config(enable=True, folder="ckpt", **fields)
    train = train or _Stateful(step=0)
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


# -- issue 25: what a user turning the integration on trips over ---------------------------------

def _loader(assets, dp_rank: int = 0, dp: int = 1, path: str | None = None, **fields):
    """A ZephonDataLoader over the test corpus: 4 lanes, global batch 8, micro batch 2, rows of 64."""
    from flexckpt_torchtitan import ZephonDataLoader

    tt.cpu_device()
    fields = {"lanes": 4, "global_batch_size": 8, "shuffle_buffer": 16, **fields}
    config = ZephonDataLoader.Config(dataset_path=path or str(assets / "data" / "train.jsonl"),
                                     tokenizer_path=str(assets / "tokenizer"), **fields)
    return config.build(dp_world_size=dp, dp_rank=dp_rank, tokenizer=None, seq_len=64, local_batch_size=2,
                        snapshot_every_n_steps=None)


def _steps(loader, count: int) -> list[dict[int, bytes]]:
    """Lane digests of the next ``count`` optimizer steps."""
    batches, first = iter(loader), len(loader.step_digests)
    while len(loader.step_digests) < first + count:
        next(batches)
    return loader.step_digests[first:]


def test_every_torchtitan_checkpoint_field_is_a_command_line_override():
    """--checkpoint.async_mode and every other field of torchtitan's CheckpointManager.Config
    parse with the flexckpt manager configured, as they do with torchtitan's. Parsed as
    torchtitan's ConfigManager parses a config (tyro, its registry, the type of the config
    function's value), on a config of the checkpoint section alone (the Trainer's would import
    its models: seconds)."""
    from dataclasses import field, fields, make_dataclass

    import tyro
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.config.manager import ConfigManager, custom_registry

    from flexckpt_torchtitan import FlexCheckpointManager

    # as Trainer.Config declares its checkpoint section
    Run = make_dataclass("Run", [("checkpoint", BaseCheckpointManager.Config,
                                  field(default_factory=CheckpointManager.Config))])

    given = {"enable": True, "folder": "ck", "interval": 7, "initial_load_path": "/tmp/seed",
             "initial_load_model_only": True, "initial_load_in_hf": True, "initial_load_in_hf_quantized": True,
             "last_save_model_only": False, "last_save_in_hf": False, "export_dtype": "bfloat16",
             "keep_latest_k": 3, "load_step": 5, "exclude_from_loading": ["lr_scheduler", "train_state"],
             "enable_first_step_checkpoint": True, "create_seed_checkpoint": True, "load_only": True,
             "async_mode": "async_with_pinned_mem"}
    assert set(given) == {f.name for f in fields(CheckpointManager.Config)}  # torchtitan's fields, all of them
    args = ["--checkpoint.compression", "zstd"]
    for name, value in given.items():
        if isinstance(value, bool):
            args.append(f"--checkpoint.{'' if value else 'no-'}{name.replace('_', '-')}")
        else:
            args += [f"--checkpoint.{name}", ",".join(value) if isinstance(value, list) else str(value)]
    ConfigManager()  # registers torchtitan's parsing rules (lists of strings)
    default = Run(checkpoint=FlexCheckpointManager.Config(interval=500, last_save_model_only=True))
    config = tyro.cli(Run, args=args, default=default, registry=custom_registry).checkpoint
    assert type(config) is FlexCheckpointManager.Config and config.compression == "zstd"
    assert {name: getattr(config, name) for name in given} == given


def test_async_mode_disabled_commits_in_save_and_async_returns_before(tmp_path):
    manager, _, train = _manager(tmp_path / "sync", interval=1, async_mode="disabled")
    assert manager.save(1) and manager.save_future is None
    assert manager.ckpt.steps() == [1]  # committed when save() returned
    manager.close()
    manager, _, train = _manager(tmp_path / "async", interval=1)
    assert manager.config.async_mode == "async"
    assert manager.save(1) and manager.save_future is not None
    assert manager.save_future.result() == 1
    manager.close()


def test_save_future_exception_waits_for_the_save_through_the_handles_public_wait(tmp_path):
    manager, _, _ = _manager(tmp_path, interval=1)
    assert manager.save(1)
    future = manager.save_future
    assert future.exception(timeout=60) is None and future.done()  # waited: no poll needed
    manager.close()


def _dcp_manager(loader, folder: str):
    """torchtitan's own manager (DCP, synchronous) around the loader and stand-ins."""
    import torch
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
    return config.build(dataloader=loader, model_parts=[torch.nn.Linear(2, 2)], optimizers=_Stateful(lr=0.5),
                        lr_schedulers=_Stateful(last_epoch=0), states={"train_state": _Stateful(step=2)},
                        sd_adapter=None, base_folder=folder)


def _dcp_rounds(rank: int, world: int, folder: str) -> list[list[dict[int, bytes]]]:
    """The zephon loader under torchtitan's DCP manager: 2 steps, a save, 2 more steps; a
    new loader and manager resumed from the save at the same degree. Lane digests of the
    steps after the save, uninterrupted and resumed."""
    from pathlib import Path

    loader = _loader(Path(os.environ["TT_ASSETS"]), rank, world)
    _steps(loader, 2)
    manager = _dcp_manager(loader, folder)
    assert manager.save(2)
    manager.close()
    after = _steps(loader, 2)
    loader.close()
    return [after, _dcp_resume(rank, world, folder)]


def _dcp_resume(rank: int, world: int, folder: str) -> list[dict[int, bytes]]:
    from pathlib import Path

    loader = _loader(Path(os.environ["TT_ASSETS"]), rank, world)
    manager = _dcp_manager(loader, folder)
    assert manager.load(step=2)
    manager.close()
    steps = _steps(loader, 2)
    loader.close()
    return steps


def test_zephon_loader_resumes_under_torchtitans_dcp_manager_at_2_and_1_ranks(zephon_run):
    """DCP keeps one copy of each key: every lane is saved under its own key, so each rank
    finds the lanes it hosts, at the saving degree and at another one."""
    per_rank = zephon_run[3]
    errors = [part for r in per_rank for part in r if isinstance(part, str)]
    assert not errors, errors[0]

    def combined(ranks):
        return [global_batch_digest({k: v for r in ranks for k, v in r[i].items()}) for i in range(2)]

    after = combined([r[0] for r in per_rank])
    assert len(per_rank[0][0][0]) == 2  # lanes 0-1 on rank 0, 2-3 on rank 1
    assert combined([r[1] for r in per_rank]) == after
    assert combined([per_rank[0][2]]) == after


def test_dataset_path_folder_reads_its_files_in_name_order(assets, tmp_path):
    lines = (assets / "data" / "train.jsonl").read_text().splitlines(keepends=True)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "b.jsonl").write_text("".join(lines[200:]))
    (folder / "a.jsonl").write_text("".join(lines[:200]))
    loader = _loader(assets, path=str(folder))
    source, = loader.pipeline.plan_fields()["sources"]
    assert (source["name"], source["kind"], source["documents"]) == ("corpus", "jsonl", 400)
    whole = _loader(assets)
    assert _steps(loader, 1) == _steps(whole, 1)  # the files in name order are the whole corpus
    loader.close(), whole.close()
    (folder / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError) as err:
        _loader(assets, path=str(folder))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"ZephonDataLoader: dataloader.dataset_path={str(folder)!r} is a folder holding "
                              f"3 files (c.parquet); it reads a folder of JSON Lines files")
    assert repr(str(folder / "*.jsonl")) in message


def test_a_new_global_batch_on_resume_is_a_new_data_phase_named_in_the_config(assets):
    import json

    from zephon_state import FingerprintMismatch

    loader = _loader(assets)
    _steps(loader, 1)
    saved = loader.state_dict()
    bigger = _loader(assets, global_batch_size=16)
    with pytest.raises(FingerprintMismatch) as err:
        bigger.load_state_dict(saved)
    message = str(err.value)
    assert "global_batch: saved 8, now 16 (pass the saved training.global_batch_size and " \
           "dataloader.global_batch_size)" in message
    assert message.endswith("set --dataloader.data_phase <new name>: the data then starts from its beginning in "
                            "new orders, and the model and optimizer resume")
    assert ".options(" not in message and "new_phase=True" not in message
    phase2 = _loader(assets, global_batch_size=16, data_phase="phase2")
    phase2.load_state_dict(saved)
    state = json.loads(phase2.state_dict()["zephon"])
    assert [p["data_phase"] for p in state["phases"]] == ["main"] and state["plan"]["global_batch"] == 16
    assert len(_steps(phase2, 1)[0]) == 4
    flex_saved = loader.by_lane().state_dict()  # the flexckpt manager's form: one ByLane of cursors
    assert sorted(flex_saved["lanes"].values) == ["0", "1", "2", "3"]
    continued = _steps(loader, 1)
    same = _loader(assets)
    same.by_lane().load_state_dict(flex_saved)
    assert _steps(same, 1) == continued
    for each in (loader, same, bigger, phase2):
        each.close()


def test_the_global_batch_is_taken_from_the_config_and_checked_against_the_trainer(assets, tmp_path):
    import types

    with pytest.raises(ValueError) as err:
        _loader(assets, dp=2, global_batch_size=-1)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("ZephonDataLoader needs dataloader.global_batch_size (now -1), the rows of one "
                              "optimizer step: set it to training.global_batch_size")
    assert message.endswith("e.g. --dataloader.global_batch_size 4 for one microbatch per rank")
    loader = _loader(assets)
    trainer = types.SimpleNamespace(config=types.SimpleNamespace(
        training=types.SimpleNamespace(global_batch_size=16, local_batch_size=2)))
    with pytest.raises(ValueError, match=r"^dataloader.global_batch_size=8 differs from the trainer's global batch, "
                                         r"16 \(training.global_batch_size=16\): set both"):
        _manager(tmp_path, dataloader=loader, train=trainer)
    trainer.config.training.global_batch_size = -1  # torchtitan's default: local batch x dp = 2
    with pytest.raises(ValueError, match=r"global batch, 2 \(training.global_batch_size=-1\)"):
        _manager(tmp_path, dataloader=loader, train=trainer)
    trainer.config.training.global_batch_size = 8
    manager, _, _ = _manager(tmp_path, dataloader=loader, train=trainer)
    manager.close()
    loader.close()


def test_the_package_example_keeps_the_last_step_resumable():
    """The example in flexckpt_torchtitan's docstring, run: a full last save, the loader's
    global batch equal to the trainer's."""
    import types

    import flexckpt_torchtitan

    tt.cpu_device()
    code = "\n".join(line.strip() for line in flexckpt_torchtitan.__doc__.splitlines()
                     if line.startswith("    ") and not line.strip().startswith("``"))
    config = types.SimpleNamespace(training=types.SimpleNamespace())
    exec(code, {"config": config})
    assert config.checkpoint.last_save_model_only is False
    assert config.dataloader.global_batch_size == config.training.global_batch_size > 0
