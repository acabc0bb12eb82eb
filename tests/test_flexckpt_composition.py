"""The Checkpointer is composed of its parts: the save pipeline's threads hold the pipeline,
never the Checkpointer, and the fast tier stages through the pipeline's public seam
(``share_staged``, ``plan_for``, ``capture``, ``release``), never through private members."""
import gc
import re
import threading
import time
import weakref
from pathlib import Path

import torch

import flexckpt.save_pipeline as save_pipeline
from flexckpt import Checkpointer
from flexckpt.errors import SaveError
from flexckpt.save_pipeline import SavePipeline
from flexckpt.tier import LocalTier

TIER_SRC = Path(save_pipeline.__file__).resolve().parent / "tier"


def _save_threads(ck_rank: int = 0) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if re.fullmatch(rf"flexckpt-(stage|write|commit)-r{ck_rank}", t.name)]


def test_a_checkpointer_dropped_while_its_writer_works_is_freed_at_once_and_its_threads_end(tmp_path, monkeypatch):
    # before: the writer held the Checkpointer itself while it worked on a save, so a dropped
    # one lived until that write ended; now the threads hold only the pipeline
    gate, writing = threading.Event(), threading.Event()
    real = save_pipeline.write_data_file

    def held(*args, **kwargs):
        writing.set()
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_pipeline, "write_data_file", held)
    before = len(_save_threads())
    ck = Checkpointer(str(tmp_path), run_id="dropped", direct_io=False)
    handle = ck.save(1, {"w": torch.arange(1000.0)})
    assert writing.wait(30)
    ref = weakref.ref(ck)
    del ck
    gc.collect()
    try:
        assert ref() is None  # freed while its writer is still inside the save
    finally:
        gate.set()
    try:  # the save in flight ends, one way or the other: it never hangs
        assert handle.result(timeout=30) == 1
    except SaveError as e:
        assert "freed without close()" in str(e)
    deadline = time.monotonic() + 10
    while len(_save_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_save_threads()) == before  # the finalizer ended the stager, writer and committer


def test_the_fast_tier_stages_through_the_pipelines_public_methods_only():
    for name in ("share_staged", "plan_for", "capture", "release"):
        assert callable(getattr(SavePipeline, name)) and not name.startswith("_")
    private = re.compile(r"\b(host|staging|ckpt|_host|_staging)\._[a-z]")
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(TIER_SRC.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert found == []


def test_a_fast_save_of_a_new_state_where_a_freed_one_lived_stages_its_own_copy(tmp_path):
    # the persistent save's buffer is shared only with a fast save of the very state object it
    # saved; before, an id() compare let a new dict at a freed state's address take those bytes
    tier = LocalTier(dir=str(tmp_path / "node" / "{node}"), replicas=0, keep_last=2, lineage="id-reuse", stale_after=0)
    with Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, local=tier, fsync=False,
                      stage_delay=1.0) as ck:  # staging waits for the fence: the buffer is still held below
        saved = {"w": torch.full((256,), 1.0)}
        address = id(saved)
        h = ck.save(5, saved)
        del saved
        # a freed dict's memory is the next dict's (CPython's free list): on main, the first new
        # dict lived at the saved state's address; now the save holds its state until it is written
        candidates = [{} for _ in range(100)]
        other = next((d for d in candidates if id(d) == address), candidates[0])
        other["w"] = torch.full((256,), 2.0)
        hf = ck.save_local(5, other)
        h.wait_staged()
        assert h.result(30) == hf.result(30) == 5
        assert ck.tier._buffer.data is not None  # its own staging copy: nothing of step 5's persistent save
        target = {"w": torch.zeros(256)}
        assert ck.load(target) == 5 and ck.tier.last_recovery.source == "tier"
        assert torch.equal(target["w"], torch.full((256,), 2.0))


def test_a_checkpointer_with_a_fast_tier_dropped_without_close_is_freed(tmp_path):
    # the tier's thread holds the tier, and the tier its host: through a weak proxy only, so
    # the tier never keeps the Checkpointer alive
    tier = LocalTier(dir=str(tmp_path / "node" / "{node}"), replicas=0, keep_last=2, lineage="dropped", stale_after=0)
    ck = Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, local=tier, fsync=False)
    state = {"w": torch.arange(256.0)}
    ck.save(1, state).result(30)
    assert ck.save_local(1, state).result(30) == 1  # the tier's thread is running
    ref = weakref.ref(ck)
    del ck
    gc.collect()
    assert ref() is None
