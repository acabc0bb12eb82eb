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


@pytest.fixture(scope="module")
def zephon_run(assets, tmp_path_factory):
    """The uninterrupted 2-rank run (checkpoints at steps 4 and 8) and, in the same
    processes, its resume from step 4 at 2 ranks."""
    dump = tmp_path_factory.mktemp("tt-zephon")
    base = ["--config", "flex_zephon", "--dump_folder", str(dump), "--checkpoint.enable", *SHORT]
    plan = [(base, None), ([*base, "--checkpoint.load_step", "2"], None)]
    ranks = run_workers(_runs, 2, plan, timeout=TIMEOUT)
    return dump, [r[0] for r in ranks], [r[1] for r in ranks]


def test_fsdp2_resume_at_2_ranks_is_bit_exact(zephon_run):
    _, full, resumed = zephon_run
    assert sorted(full[0]["losses"]) == [1, 2, 3, 4]
    assert sorted(resumed[0]["losses"]) == [3, 4]
    for step in (3, 4):
        assert resumed[0]["losses"][step] == full[0]["losses"][step], step  # bit for bit
    assert global_digests(resumed) == global_digests(full)[2:]


def test_zephon_resume_at_1_rank_yields_the_same_global_batches(zephon_run):
    dump, full, _ = zephon_run
    args = ["--config", "flex_zephon", "--dump_folder", str(dump), "--checkpoint.enable", *SHORT,
            "--checkpoint.load_step", "2"]
    one = run_workers(_runs, 1, [(args, None)], timeout=TIMEOUT)
    one = [r[0] for r in one]
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
