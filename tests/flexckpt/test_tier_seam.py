"""The fast tier's seams: it needs only the ``TierHost`` and ``StagedSaves`` protocols of
what it is composed with, and it writes its files and builds its manifest through the
persistent save's writer and the committer's builder."""
from __future__ import annotations

import os
import re
import time

import orjson
import torch

import flexckpt.tier

from flexckpt import Checkpointer, PerRank
from flexckpt.catalog import read_manifest
from flexckpt.format.jsondoc import unseal
from flexckpt.format.manifest_parse import parse_manifest
from flexckpt.format.names import MANIFEST, step_dir, table_name, values_name
from flexckpt.storage import Storage
from flexckpt.tier import LocalTier
from flexckpt.tier.fast import FastTier
from flexckpt.tier.inventory import choose, scan
import flexckpt.tier.recover as recover
import flexckpt.tier.save as fast_save
from flexckpt.tier.seam import StagedSaves, TierHost


def make_state(step: int, zero: bool = False) -> dict:
    """One rank's state (a world of one): a tensor, a plain value, a per-rank value."""
    w = torch.arange(4096, dtype=torch.float32) * step
    return {"w": torch.zeros_like(w) if zero else w, "meta": {"step": -1 if zero else step},
            "rng": PerRank({"seed": -1 if zero else step})}


def _members(protocol: type) -> list[str]:
    own = set(vars(protocol)) | set(protocol.__annotations__)
    return sorted(n for n in own if not n.startswith("_"))


class _Only:
    """Exposes ``members`` of ``target`` and nothing else: any other read raises."""

    def __init__(self, target: object, members: list[str]) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_members", set(members))

    def __getattr__(self, name: str) -> object:
        if name not in object.__getattribute__(self, "_members"):
            raise AttributeError(f"the fast tier read {name!r}, which its protocol does not name")
        return getattr(object.__getattribute__(self, "_target"), name)


def test_the_protocols_name_what_the_tier_needs():
    assert _members(TierHost) == ["group", "rank", "read_threads", "run_id", "session", "storage", "world_size"]
    assert _members(StagedSaves) == ["capture", "plan_for", "release", "share_staged"]


def test_the_checkpointer_hands_its_tier_values_not_itself(tmp_path):
    """The tier never calls back into the facade: its host is a TierHost of this rank's
    identity and store, not the Checkpointer (nor a proxy of it)."""
    local = LocalTier(dir=str(tmp_path / "shm"), replicas=0, lineage="host")
    with Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, run_id="host", local=local) as ck:
        host = ck.tier.host
        assert type(host) is TierHost
        assert (host.rank, host.world_size, host.run_id, host.session) == (0, 1, ck.run_id, ck.session)
        assert host.storage is ck.storage and host.read_threads == ck.read_threads


def test_a_fast_tier_saves_and_recovers_through_the_protocols_alone(tmp_path):
    ck = Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, run_id="seam")
    host, staging = _Only(ck, _members(TierHost)), _Only(ck._pipeline, _members(StagedSaves))
    tier = FastTier(LocalTier(dir=str(tmp_path / "shm"), replicas=0, lineage="seam"), host=host, staging=staging)
    try:
        state = make_state(3)
        ck.save(3, state).result(60)
        assert tier.save(3, state).result(60) == 3  # shares the persistent save's staged buffer
        assert tier.save(4, make_state(4)).result(60) == 4  # stages its own
        target = make_state(0, zero=True)
        step, stats = tier.recover(target, True)
        assert step == 4 and stats is not None and tier.last_recovery.source == "tier"
        assert torch.equal(target["w"], make_state(4)["w"]) and target["rng"].value == {"seed": 4}
        assert target["meta"] == {"step": 4}
    finally:
        tier.close()
        ck.close()


def test_the_tier_reads_no_private_member_of_its_host_or_staging():
    root = os.path.dirname(flexckpt.tier.__file__)
    assert "recover.py" in os.listdir(root)
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name)) as f:
                text = f.read()
            assert not re.findall(r"\b(?:host|staging|ckpt)\._", text), name
            assert not re.findall(r"\bckpt\b", text), name


def test_the_tiers_files_and_manifest_are_those_of_the_shared_writer_and_builder(tmp_path, monkeypatch):
    built, wrote = [], []
    real_build, real_write = recover.build_manifest, fast_save.write_rank_files
    monkeypatch.setattr(recover, "build_manifest", lambda **k: built.append(k["step"]) or real_build(**k))
    monkeypatch.setattr(fast_save, "write_rank_files", lambda *a, **k: wrote.append(k["rank"]) or real_write(*a, **k))
    t = LocalTier(dir=str(tmp_path / "shm"), replicas=0, lineage="same")
    ck = Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, run_id="same", local=t)
    try:
        state = make_state(5)  # with a per-rank value: a values file too
        ck.save(5, state).result(60)
        ck.save_local(5, state).result(60)
        ck.save_local(6, make_state(6)).result(60)  # staged by the tier alone
        assert wrote == [0, 0]
        store = read_manifest(ck.storage, 5)
        held = [h for h in scan(ck.tier.storage) if h.step == 5]
        d = choose([held], ck.tier.lineage, held[0].doc["fingerprint"], [])
        assert (d.source, d.step, d.attempt) == ("tier", 5, store.attempt)  # attempt 1 in both tiers
        # one record line, the same files: the tier's line is the committed manifest's entry
        assert held[0].doc["line"] == [store.fingerprint, *store.ranks[0]]
        for rel in (table_name(d.attempt, 0), values_name(d.attempt, 0)):
            with open(ck.tier.storage.path(f"{step_dir(5)}/{rel}"), "rb") as a, \
                 open(ck.storage.path(f"{step_dir(5)}/{rel}"), "rb") as b:
                assert a.read() == b.read(), rel
        m = recover.tier_manifest(ck.tier.storage, d)
        assert built == [5]
        # sealed and read back by the same parser; the same document as the committed one but
        # for its time and the container tree (the tier's markers carry none)
        again = parse_manifest(m.to_bytes())
        assert again.sealed and again.ranks == store.ranks and again.fingerprint == store.fingerprint
        ours = orjson.loads(unseal(m.to_bytes(), "tier")[0])
        with open(ck.storage.path(f"{step_dir(5)}/{MANIFEST}"), "rb") as f:
            theirs = orjson.loads(unseal(f.read(), "store")[0])
        for doc in (ours, theirs):
            doc.pop("time")
            doc.pop("tree", None)
        assert ours == theirs
        assert abs(m.time - time.time()) < 60
        target = make_state(0, zero=True)
        assert ck.load(target) == 6 and built == [5, 6]  # a recovery builds its manifest the same way
        assert target["rng"].value == {"seed": 6} and target["meta"] == {"step": 6}
    finally:
        ck.close()


def test_a_tier_data_file_is_written_by_the_shared_writer(tmp_path, monkeypatch):
    raw = []
    real = fast_save.write_raw
    monkeypatch.setattr(fast_save, "write_raw", lambda s, rel, *a, **k: raw.append((rel, k)) or real(s, rel, *a, **k))
    t = LocalTier(dir=str(tmp_path / "shm"), replicas=0, lineage="raw")
    ck = Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, run_id="raw", local=t)
    try:
        ck.save_local(2, make_state(2)).result(60)
        assert len(raw) == 1 and raw[0][0].endswith(".data") and raw[0][1] == {"fsync": False, "direct": False}
        assert Storage(ck.tier.root, None, None).exists(raw[0][0])
    finally:
        ck.close()
