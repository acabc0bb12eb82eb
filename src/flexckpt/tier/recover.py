"""A fast tier's recovery (``FastTier.recover``, every rank, at ``load()``).

One all-gather of the nodes' inventories on the tier's group chooses the newest step
complete across the surviving nodes (or partly held, its missing saved ranks served by the
store's same save); one all-gather of what each rank asks of its peers: only the byte
ranges its load reads of files its node lacks. The ordinary load then runs over a
``StepView``: the node's folder, the ranges as they arrive (sent with send/recv), the
store's files of missing ranks. Every rank passes every collective, whatever failed
before it, and one all-gather of the outcomes decides: all restored, or the persistent
store serves the load. Phases timed in ``Recovery.timings``: inventory, plan (manifest,
read plan, asks), post (sends and receives posted), read (the load; ``wait_peer_s`` of
it waiting for ranges), drain, agree, finish (the other steps set aside, the values applied).
"""
from __future__ import annotations

import datetime
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from flexckpt.catalog import committed_steps, read_manifest
from flexckpt.format.manifest import Manifest
from flexckpt.format.manifest_parse import parse_manifest
from flexckpt.format.names import keyed_name, step_dir, table_name, values_name
from flexckpt.format.write_plan import PlanRules
from flexckpt.load.committed import manifest_bytes
from flexckpt.load.pending import PendingLoad
from flexckpt.save.commit import SavedPlan, build_manifest, write_keyed
from flexckpt.save.stage_union import union_structure
from flexckpt.state.dtypes import dtype_from_name
from flexckpt.state.structure import TensorSpec, Walk, excluder, walk
from flexckpt.storage import Storage, makedirs
from flexckpt.tier.inventory import (
    Decision, Held, choose, compat_fingerprint, compat_union, done_name, scan, set_aside,
)
from flexckpt.tier.keep import Holdings
from flexckpt.tier.peer_ranges import Ask, Transfer, assign, ranges_needed, saved_rank
from flexckpt.tier.seam import TierHost
from flexckpt.tier.transport import Incoming, announce, mapped, send_range
from flexckpt.tier.view import Received, StepView
from flexshard import layout_from_json
from flexshard.world import ranks as n_ranks

log = logging.getLogger("flexckpt")


@dataclass
class Recovery:
    """What ``load()`` did with the fast tier: the decision, and where each saved rank's
    files came from (``"own node NAME"``, ``"node NAME via rank K"``)."""

    source: str
    step: int | None
    reason: str
    parts: dict[int, str] = field(default_factory=dict)
    fetched_bytes: int = 0  # received from peers (asked byte ranges, chunk tables, per-rank values)
    sent_bytes: int = 0  # sent to recovering peers
    fetched: dict[str, int] = field(default_factory=dict)  # bytes received by file (relative to the step)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # phases (seconds): see the module's docstring
    other_structure: bool = False  # the tier held a complete step saved with another structure (kept)


class Tier(Protocol):
    """What a recovery reads of its tier (``FastTier``): who this rank is on which node,
    the node's folder, the tier's group, and what this process holds in the folder."""

    rank: int
    world: int
    node: str  # this node's name
    node_names: list[str]  # by rank
    folder_id: str  # the node folder's identity (two machines under one name differ)
    dir: str  # the tier folder as configured
    root: str  # this lineage's folder inside it
    storage: Storage  # over ``root``
    lineage: str
    other_lineages: list[str]  # other runs' tiers found in ``dir`` at start
    group: Any  # the tier's gloo group (None: a single rank)
    global_ranks: list[int]
    timeout: float
    holdings: Holdings

    def all_gather(self, obj: Any) -> list: ...

    def sweep(self, paths: list[str]) -> None: ...


@dataclass
class _Chosen:
    """The inventory step's outcome on this rank."""

    decision: Decision
    gathered: list  # per rank: (node, held, persistent steps, fingerprint, error, folder id)
    errors: list[str]
    leader: bool  # the lowest rank of this rank's tier folder
    full: Walk | None = None  # the target state, walked
    w: Walk | None = None  # ... without the excluded leaves
    gone: Any = None


class StepRecovery:
    """One recovery of ``tier``'s newest restorable step into a state; :meth:`run` returns
    ``(step, load stats)`` when it restored on every rank, else None, with the report."""

    def __init__(self, tier: Tier, host: TierHost) -> None:
        self.tier, self.host = tier, host
        self.t0 = time.perf_counter()
        self.view = StepView(tier.storage, {})
        self.into: dict[tuple[str, int], np.ndarray] = {}  # asked ranges received straight into a target

    def run(self, state: dict, strict: bool, exclude: tuple[str, ...]) -> tuple[tuple[int, Any] | None, Recovery]:
        c = self.choose(state, exclude)
        d = c.decision
        if d.source != "tier":
            return None, self.decline(c)
        report = Recovery("tier", d.step, d.reason)
        t1 = time.perf_counter()
        report.timings["inventory_s"] = t1 - self.t0
        pending, transfers, error = self.plan(c, strict, report)
        t2 = time.perf_counter()
        report.timings["plan_s"] = t2 - t1
        sends, incoming, fail = self.exchange(d.step, transfers)
        error = error or fail
        t3 = time.perf_counter()
        report.timings["post_s"] = t3 - t2
        if error is None:
            try:
                assert pending is not None
                pending.read(self.host.read_threads)  # this node's files are read while the peers' ranges arrive
            except Exception as exc:  # noqa: BLE001 - every rank must reach the collectives below
                error = exc
        t4 = time.perf_counter()
        report.timings["read_s"] = t4 - t3
        report.timings["wait_peer_s"] = sum(box.waited for box in incoming)
        error = error or self.drain(sends, incoming)
        report.timings["drain_s"] = time.perf_counter() - t4
        self.count(transfers, report)
        t5 = time.perf_counter()
        failed = self.tier.all_gather(error is not None)
        report.timings["agree_s"] = time.perf_counter() - t5
        if c.leader:  # every rank has read: the step's bytes values file (written for the load) goes
            self.tier.storage.remove(f"{step_dir(d.step)}/{keyed_name(d.attempt)}")
        if any(failed):
            return None, self.failed(c, failed, error)
        assert pending is not None and d.step is not None
        t6 = time.perf_counter()
        self.finish(c, pending)
        report.timings["finish_s"] = time.perf_counter() - t6
        report.seconds = time.perf_counter() - self.t0
        log.info("flexckpt fast tier: restored step %d (%s); parts: %s", d.step, d.reason, report.parts)
        return (d.step, pending.stats), report

    # -- the steps, in order -------------------------------------------------------------------
    def choose(self, state: dict, exclude: tuple[str, ...]) -> _Chosen:
        """The inventory: every rank's holdings, errors and structure, gathered; the step to
        restore, chosen alike on every rank (``inventory.choose``)."""
        tier = self.tier
        full = w = gone = None
        try:
            full = walk(state, tier.rank, tier.world)
            gone = excluder(exclude)  # load() checked the patterns
            w = full.without(gone)
            fp = compat_fingerprint(w.structure_json())
            held = scan(tier.storage)
            persistent = committed_steps(self.host.storage) if tier.rank == 0 else []
            mine = (tier.node, [(h.step, h.attempt, h.rank, h.world, h.doc) for h in held], persistent, fp, "",
                    tier.folder_id)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
            mine = (tier.node, [], [], "", f"rank {tier.rank}: {type(exc).__name__}: {exc}", tier.folder_id)
        gathered = tier.all_gather(mine)
        inventories = [[Held(*x) for x in g[1]] for g in gathered]
        errors = [g[4] for g in gathered if g[4]]
        clash = node_clash([(g[0], g[5]) for g in gathered])
        if errors:
            decision = Decision("persistent", None, reason=f"the fast tier could not be read ({errors[0]})")
        elif clash:
            decision = Decision("persistent", None, reason=clash)
        else:
            assert w is not None
            target = self.target_compat([g[3] for g in gathered], w)
            decision = choose(inventories, tier.lineage, target, gathered[0][2], exclude)
        # the lowest rank of each folder (of each machine, also where two report one node name)
        leader = tier.rank == min(r for r, g in enumerate(gathered) if (g[0], g[5]) == (tier.node, tier.folder_id))
        return _Chosen(decision, gathered, errors, leader, full, w, gone)

    def decline(self, c: _Chosen) -> Recovery:
        """Nothing is loadable: older than the persistent step, or incomplete. Its steps are
        set aside, but a step saved with another structure stays (a load with a changed
        config must not cost the run its newest step)."""
        tier, d = self.tier, c.decision
        if c.leader and not c.errors and not d.other_structure:
            tier.sweep(set_aside(tier.root, -1))
        reason = d.reason
        if tier.other_lineages and not c.gathered[tier.rank][1]:
            reason += (f"; this node's tier folder {tier.dir} held the tier of run id {tier.other_lineages[0]!r}, not "
                       f"this launch's {tier.lineage!r}: FLEXCKPT_RUN_ID must be the same on every launch for a "
                       f"relaunch to find its tier")
        log.warning("flexckpt fast tier: %s", reason)
        return Recovery(d.source, d.step, reason, seconds=time.perf_counter() - self.t0,
                        other_structure=d.other_structure)

    def plan(self, c: _Chosen, strict: bool, report: Recovery) -> tuple[PendingLoad | None, list[Transfer], Any]:
        """The step's manifest (the store's, when ranks are missing, else rebuilt from the
        markers), the load over the view, where each part comes from, and the transfers
        every rank serves and receives (one all-gather of the asks)."""
        tier, d = self.tier, c.decision
        error: BaseException | None = None
        pending = None
        asks: dict[int, list[Ask]] = {}
        try:
            data, from_peer = None, False
            if d.missing:  # the store's manifest, read once (rank 0 reads it): a collective, so first
                data, from_peer = manifest_bytes(self.host.storage, d.step, tier.rank, tier.world, tier.group,
                                                 once=True)
            assert c.w is not None and c.full is not None
            manifest = self.store_manifest(d, data) if d.missing else tier_manifest(tier.storage, d)
            manifest.files.bind(self.view, step_dir(d.step))
            pending = PendingLoad(self.view, manifest, c.full, tier.rank, tier.world, strict, c.gone)
            if data is not None:
                pending.stats.manifest_bytes, pending.stats.manifest_from_peer = len(data), from_peer
            asks, report.parts = self.plan_sources(d, manifest, pending, c.gathered)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the collectives below
            error, asks = exc, {}
        transfers = assign(tier.all_gather(asks), d.holders)
        for t in transfers:
            if t.receiver == tier.rank:
                report.parts[t.saved] = f"node {c.gathered[t.server][0]} via rank {t.server}"
        return pending, transfers, error

    def drain(self, sends: list, incoming: list[Incoming]) -> BaseException | None:
        """Even after a failure: every posted receive and send completes, so the pairs stay in
        step; then the sends (and their mapped ranges) and the targets asked for are let go."""
        try:
            for box in incoming:
                box.wait_all()
            for work in sends:
                (work[0] if isinstance(work, tuple) else work).wait(datetime.timedelta(seconds=self.tier.timeout))
        except Exception as exc:  # noqa: BLE001
            return exc
        finally:
            sends.clear()
            self.into = {}
        return None

    def count(self, transfers: list[Transfer], report: Recovery) -> None:
        rank = self.tier.rank
        report.fetched_bytes = sum(t.nbytes for t in transfers if t.receiver == rank)
        report.sent_bytes = sum(t.nbytes for t in transfers if t.server == rank)
        for t in transfers:
            for a in t.asks if t.receiver == rank else ():
                report.fetched[a.rel] = report.fetched.get(a.rel, 0) + a.length

    def failed(self, c: _Chosen, failed: list[bool], error: BaseException | None) -> Recovery:
        """Some rank could not load the step: the run goes on from an older step, so this
        one is set aside (it may never outrank the run's new steps)."""
        step = c.decision.step
        why = f"the fast-tier load of step {step} failed on rank(s) {[r for r, f in enumerate(failed) if f]}"
        if error is not None:
            why += f" (here: {type(error).__name__}: {error})"
        log.error("flexckpt fast tier: %s; loading from the persistent store", why)
        if c.leader:
            self.tier.sweep(set_aside(self.tier.root, -1))
        return Recovery("persistent", None, why, seconds=time.perf_counter() - self.t0)

    def finish(self, c: _Chosen, pending: PendingLoad) -> None:
        """Every rank has read: keep only the restored step, owned by the node's leader from
        now on; then the values are applied."""
        tier, d = self.tier, c.decision
        if c.leader:
            assert d.step is not None
            tier.sweep(set_aside(tier.root, d.step))
            tier.holdings.inherit([(h.step, done_name(h.attempt, h.rank, h.world), list(h.doc["files"])) for h in scan(tier.storage)])
        pending.apply()

    # -- the pieces the steps use -----------------------------------------------------------------
    def target_compat(self, fps: list[str], w: Walk) -> str:
        """The union of the target ranks' structures (:func:`compat_union`): their common
        fingerprint, or, when they differ (pipeline stages), from one structure per
        fingerprint, sent by its lowest rank (one more all-gather, only then)."""
        rank = self.tier.rank
        if len(set(fps)) == 1:
            return fps[0]
        mine = w.structure_json() if fps.index(fps[rank]) == rank else None
        return compat_union([st for st in self.tier.all_gather(mine) if st is not None])

    def store_manifest(self, d: Decision, data: bytes | None = None) -> Manifest:
        """The persistent store's manifest of step ``d.step``, when it is the very save the
        tier holds part of: the same attempt, world size and plan, uncompressed, and each
        saved rank the tier holds with the same table, data and values (lengths and xxh3):
        its files then stand in for the ranks no node holds. ``data``: its bytes, already read
        (by rank 0, for every rank)."""
        m = read_manifest(self.host.storage, d.step, data)
        first = next(iter(d.docs.values()))
        why = ""
        if m.version < 2 or m.attempt != d.attempt:
            why = f"it is save attempt {m.attempt}, the tier's is {d.attempt}"
        elif m.world_size != d.world or m.fingerprint != first["saved_fingerprint"]:
            why = f"it was saved by {n_ranks(m.world_size)} with another plan"
        elif m.codec != "none":
            why = f"it is compressed ({m.codec}); the tier's files are not"
        else:
            differ = [r for r, doc in sorted(d.docs.items()) if tuple(doc["line"][1:]) != tuple(m.ranks[r])]
            if differ:
                why = f"the files of saved rank(s) {differ[:10]} differ"
        if why:
            raise ValueError(f"the persistent store's step {d.step} is not the save the fast tier holds part of ({why})")
        return m

    def plan_sources(self, d: Decision, manifest: Manifest, pending: PendingLoad,
                     gathered: list) -> tuple[dict[int, list[Ask]], dict[int, str]]:
        """Where this rank reads each saved rank's files from: its node's folder, the store
        (the ranks no node holds), or a peer, which sends only the byte ranges of the data
        file the load reads, with the chunk table (and this rank's per-rank values). Routes
        the view accordingly; returns the asks by saved rank, and where each part comes from."""
        tier, view, store = self.tier, self.view, self.host.storage
        node_of = [g[0] for g in gathered]
        here = {s for s, hs in d.holders.items() if any(node_of[h] == tier.node for h in hs)}
        folder = step_dir(d.step)
        m, attempt = manifest, manifest.attempt
        targets = [(m.tensors[pending.walk.specs[i].name], rng) for i, rng in pending.targets]
        ranges = ranges_needed(m, targets, set(m.files))
        into = [_bytes_of(pending.walk.tensors[i]) for i, _rng in pending.targets]
        reading = {saved_rank(f): f for f in ranges}
        if pending.per_rank:  # at the saved world size: this rank's own per-rank values
            reading.setdefault(tier.rank, "")
        asks: dict[int, list[Ask]] = {}
        parts: dict[int, str] = {}
        if d.missing and m.keyed:  # the store's manifest names its own bytes values file
            view.routes[f"{folder}/{keyed_name(attempt)}"] = store
        for s, data in sorted(reading.items()):
            e = m.ranks[s]
            files = [(table_name(attempt, s), e.table_nbytes)] if data else []
            if s == tier.rank and pending.per_rank and e.values_nbytes:
                files.append((values_name(attempt, s), e.values_nbytes))
            if s in here:
                parts[s] = f"own node {tier.node}"
            elif s in d.missing:
                parts[s] = f"persistent store step {d.step}"
                for rel, _n in files + ([(data, 0)] if data else []):
                    view.routes[f"{folder}/{rel}"] = store
            else:  # parts[s] is named once peer_ranges.assign has picked the peer
                asks[s] = [Ask(rel, 0, n) for rel, n in files if n]
                if data:
                    asks[s] += [Ask(data, r.offset, r.length) for r in ranges[data]]
                    files.append((data, e.stored_nbytes))
                    for r in ranges[data]:
                        if r.target >= 0 and into[r.target] is not None:
                            self.into[(f"{folder}/{data}", r.offset)] = into[r.target][r.target_pos : r.target_pos + r.length]
                for rel, n in files:
                    view.routes[f"{folder}/{rel}"] = Received(f"{folder}/{rel}", n, "a peer")
        return asks, parts

    def readable(self, t: Transfer, folder: str) -> bool:
        """Whether this node's files hold every range ``t`` asks for (else the receiver is told)."""
        try:
            for a in t.asks:
                size = os.path.getsize(self.tier.storage.path(f"{folder}/{a.rel}"))
                if size < a.offset + a.length:
                    raise ValueError(f"{folder}/{a.rel} is {size} bytes, asked for [{a.offset}, {a.offset + a.length})")
            return True
        except Exception as exc:  # noqa: BLE001
            log.error("flexckpt fast tier rank %d: cannot read saved rank %d's files for rank %d: %s",
                      self.tier.rank, t.saved, t.receiver, exc)
            return False

    def exchange(self, step: int, transfers: list[Transfer]) -> tuple[list, list[Incoming], Any]:
        """Post the sends this rank serves (straight from its node's files, mapped), then
        set up the receives it awaits, each range landing in the view's ``Received`` file.
        Runs on every rank, whatever failed before, so that every pair stays in step;
        returns the sends, the receives and the first error."""
        tier = self.tier
        peer = tier.global_ranks
        folder = step_dir(step)
        error: BaseException | None = None
        sends: list = []
        mine = [t for t in transfers if t.server == tier.rank]
        ok = {t: self.readable(t, folder) for t in mine}
        first: dict[int, Transfer] = {}
        for t in mine:
            first.setdefault(t.receiver, t)
        for t in first.values():  # each receiver's first header at once: it sets up while ranges are mapped
            sends.append(announce(tier.group, peer[t.receiver], step, t.saved, [a.length for a in t.asks] if ok[t] else None))
        for t in mine:  # per receiver, a transfer's header and ranges in order: messages pair by order
            if first[t.receiver] is not t:
                sends.append(announce(tier.group, peer[t.receiver], step, t.saved,
                                      [a.length for a in t.asks] if ok[t] else None))
            try:
                for a in t.asks if ok[t] else ():
                    payload = mapped(tier.storage.path(f"{folder}/{a.rel}"), a.offset, a.length)
                    sends.append((send_range(tier.group, peer[t.receiver], payload), payload))
            except Exception as exc:  # noqa: BLE001 - checked above; the receiver times out on what is missing
                error = error or exc
        incoming: list[Incoming] = []
        for t in transfers:
            if t.receiver != tier.rank:
                continue
            try:
                box = Incoming(tier.group, peer[t.server], step, t.saved, [a.length for a in t.asks],
                               tier.timeout, [self.into.get((f"{folder}/{a.rel}", a.offset)) for a in t.asks])
            except Exception as exc:  # noqa: BLE001
                error = error or exc
                continue
            incoming.append(box)
            for i, a in enumerate(t.asks):
                file = self.view.routes[f"{folder}/{a.rel}"]
                file.where = f"rank {t.server} on node {tier.node_names[t.server]}"
                file.add(a.offset, box.buffers[i], functools.partial(box.ready, i))
        return sends, incoming, error


def tier_manifest(storage: Storage, d: Decision) -> Manifest:
    """The saved step's manifest, rebuilt from the ranks' markers through the committer's
    builder (:func:`flexckpt.save.commit.build_manifest`) and read back as a committed one is:
    tensors with their saved layouts from saved rank 0's marker (or, when the saved ranks'
    structures differ, the union of the stages' structures the markers carry, built and
    checked as the persistent commit builds it), the plan rules from rank 0's, a line and
    lanes from each, and the bytes values, written to the step's ``keyed.values`` in
    ``storage`` (the node's folder)."""
    docs = d.docs
    first = docs[0]
    lanes: dict[str, dict] = {}
    for r in range(d.world):
        for path, mapping in docs[r]["lanes"].items():
            lanes.setdefault(path, {}).update(mapping)
    entries = {r: docs[r]["line"] for r in range(d.world)}
    if len({line[0] for line in entries.values()}) > 1:
        carried = {doc["line"][0]: doc["structure"] for doc in docs.values() if isinstance(doc.get("structure"), dict)}
        union = union_structure(entries, d.step, first["line"][0], first["structure"], carried, d.world)
        assert union is not None  # the lines differ
        specs, _structure, fp = union
    else:
        fp = first["saved_fingerprint"]
        specs = [TensorSpec(name, dtype_from_name(t["dtype"]), tuple(t["shape"]), layout_from_json(t["layout"]))
                 for name, t in first["tensors"].items()]
    keyed = _merged_keyed(d)
    index = None
    if keyed:
        makedirs(storage, f"{step_dir(d.step)}/{d.attempt}")
        index = write_keyed(storage, d.step, d.attempt, keyed, False)
    built = build_manifest(
        step=d.step, run_id=first["run_id"], attempt=d.attempt, plan=SavedPlan(tuple(specs), d.world, PlanRules(**first["rules"])),
        fingerprint=fp, codec="none", entries=entries, plain=first["plain"], lanes=lanes,
        per_rank_keys=first["per_rank_keys"], keyed=index,
    )
    return parse_manifest(built.to_bytes(), where=f"fast tier step {d.step}")


def node_clash(folders: list[tuple[str, str]]) -> str:
    """``""``, or what is wrong when ranks reporting one node name scan different tier
    folders (``folders[rank] = (node name, folder id)``): two machines under one name, whose
    steps the recovery cannot place (it takes a node's ranks to share its folder)."""
    by_name: dict[str, dict[str, list[int]]] = {}
    for rank, (name, fid) in enumerate(folders):
        by_name.setdefault(name, {}).setdefault(fid, []).append(rank)
    for name, groups in by_name.items():
        if len(groups) > 1:
            ranks = " and ".join(str(rs) for rs in sorted(groups.values()))
            return (f"ranks {ranks} report one node name {name!r} but scan different tier folders: two machines "
                    f"under one name (FLEXCKPT_NODE, or the host name); give each machine a name of its own. The "
                    f"tier's steps are set aside on every machine and the load reads the persistent store")
    return ""


def _bytes_of(t: Any) -> np.ndarray | None:
    """A target tensor's bytes, where a load reads straight into it (CPU, contiguous)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _merged_keyed(d: Decision) -> dict[str, list]:
    """The step's bytes values by key, ``[lowest saved rank holding it, base64]``, from the
    markers; ValueError naming the key when two saved ranks hold it with different bytes
    (a persistent save of the same state would have failed)."""
    merged: dict[str, list] = {}
    for r in range(d.world):
        for key, v in d.docs[r].get("keyed", {}).items():
            have = merged.get(key)
            if have is not None and have[1] != v[1]:
                raise ValueError(f"fast tier step {d.step}: bytes value {key!r} differs between saved ranks {have[0]} "
                                 f"and {v[0]}; a key saved by several ranks must hold the same bytes on each")
            if have is None or v[0] < have[0]:
                merged[key] = v
    return merged
