"""The commit side of a save. ``Committer`` runs on the commit thread of a group leader:
rank 0 gathers the records by reading storage, writes the manifest and applies retention
(the pure steps are in :mod:`flexckpt.save.commit`: gather, build, commit; retention and
reclaim are in :mod:`flexckpt.save.cleanup`); another group leader (every GROUP-th rank)
gathers its group's records into one. It also makes this
rank's record (``record``; a rank that leads no group writes it, ``hand_in``), reports any
rank's failure to the attempt's other ranks (``report_failure``), lets the other ranks wait
for the commit through storage (``wait_for_commit``), and removes the files of saves cut
short before this launch (``reclaim``). It holds nothing of the ``Checkpointer``.
"""
from __future__ import annotations

import logging
import threading
import time

from flexckpt.catalog import committed_attempt
from flexckpt.errors import SaveError, expected_failure
from flexckpt.format.names import GROUP, attempt_run_id, committed_name, group_name, record_name, step_dir, table_name
from flexckpt.format.write_plan import WritePlan
from flexckpt.save.cleanup import apply_retention, reclaim_at_start, reclaim_failed
from flexckpt.save.commit import (
    AnnouncedFailure,
    build_manifest,
    check_fingerprints,
    commit,
    failure_message,
    gather,
    keyed_entries,
    lead_group,
    mark_failed,
    other_live_job,
    record_doc,
    write_keyed,
)
from flexckpt.save.handle import InFlight
from flexckpt.save.job import PlanEntry, SaveJob, SaveSettings
from flexckpt.save.stage_union import has_partial, union_structure

log = logging.getLogger("flexckpt")


class Committer:
    """The commit protocol of one rank's persistent saves. ``keep_last`` and ``pinned`` are
    read at each commit (the caller may replace ``pinned`` at any time); ``since`` is the
    instant after which another job's files under the URL mean a live job there."""

    def __init__(self, settings: SaveSettings, in_flight: InFlight, *, keep_last: int | None, since: float) -> None:
        self.settings = settings
        self.storage = settings.storage
        self.rank = settings.rank
        self.in_flight = in_flight
        self.keep_last = keep_last
        self.pinned: frozenset[int] = frozenset()
        self.since = since
        # held by retention and reclaim, and by a writer while it makes a save's folders: a save
        # either made them before retention began (and is in flight, which retention leaves
        # alone) or makes them after it ended (never into an empty step folder being removed)
        self.folders_lock = threading.Lock()
        # rank 0: every structure the records carried (fingerprint -> structure), and the last
        # union of differing ones (pipeline stages) with its plan
        self.structures: dict[str, dict] = {}
        self._union: tuple | None = None
        self._listed_steps: set[str] = set()  # step folders the live-job check listed

    def commit(self, job: SaveJob) -> None:
        """The commit thread's work on one save: rank 0 commits it, another leader gathers its group."""
        s = self.settings
        if not s.is_coordinator:
            return self._lead(job)
        t0 = time.perf_counter()
        try:
            e = job.entry
            structures = self.structures
            keyed: dict[str, list] = {}
            entries, lanes = gather(
                self.storage, step=job.step, run_id=s.run_id, attempt=job.attempt, world_size=s.world_size,
                own=self.record(job), timeout=s.commit_timeout, max_delay=s.poll_interval,
                structures=structures, keyed=keyed,
            )
            job.handle.timings["gather_s"] = time.perf_counter() - t0
            plan, fp = self._union_plan(e, entries, job.step)
            other = other_live_job(self.storage, job.attempt, self.since, job.step, self._listed_steps)
            if other is not None:
                raise SaveError(
                    f"step {job.step}: another job is saving into {self.storage.url}: run "
                    f"{attempt_run_id(other.rsplit('/', 1)[1])!r} wrote {other} after this job started; nothing of it "
                    f"was deleted and this step is not committed; give each job its own URL"
                )
            manifest = build_manifest(
                step=job.step, run_id=s.run_id, attempt=job.attempt, plan=plan, fingerprint=fp,
                codec=s.compression.codec, entries=entries, plain=job.plain, lanes=lanes,
                per_rank_keys=e.per_rank_keys, keyed=write_keyed(self.storage, job.step, job.attempt, keyed, s.fsync),
                tree=job.tree,
            )
            commit(self.storage, manifest, s.fsync)
            now = committed_attempt(self.storage, job.step)
            if now != job.attempt:
                raise SaveError(f"step {job.step}: another job committed over this save (the manifest names {now})")
        except BaseException as exc:  # noqa: BLE001
            self.report_failure(job, exc, "committing")
            return
        job.handle.timings["commit_s"] = time.perf_counter() - t0
        job.handle._succeed()  # committed: retention below is housekeeping, not part of the save
        try:
            with self.folders_lock:
                apply_retention(self.storage, self.keep_last, job.step, job.attempt, self.since,
                                s.commit_timeout, in_flight=self.in_flight.attempts(), pinned=self.pinned)
        except Exception:  # noqa: BLE001 - the checkpoint is committed; retention retries next time
            log.exception("retention after step %d failed", job.step)

    def _union_plan(self, e: PlanEntry, entries: dict[int, list], step: int) -> tuple[WritePlan, str]:
        """The plan and fingerprint the manifest holds: rank 0's own, or, when ranks saved
        different structures (pipeline stages), their union's (see :mod:`flexckpt.save.stage_union`),
        kept while the set of fingerprints stays the same."""
        fps = frozenset(line[0] for line in entries.values())
        if fps == {e.fingerprint}:
            return e.plan, e.fingerprint
        if self._union is not None and self._union[0] == (fps, e.fingerprint):
            return self._union[1], self._union[2]
        structures = {fp: self.structures[fp] for fp in fps if fp in self.structures}
        world_size = self.settings.world_size
        if not e.partial and not any(has_partial(st, world_size) for st in structures.values()):
            check_fingerprints(entries, step, e.fingerprint, e.structure, structures)  # no stages: names what differs
        try:
            union = union_structure(entries, step, e.fingerprint, e.structure, structures, world_size)
        except (KeyError, TypeError, ValueError) as exc:
            raise SaveError(f"step {step}: a record carries a malformed structure: {exc}") from None
        assert union is not None
        specs, _structure, fp = union
        plan = WritePlan(specs, world_size, e.plan.rules)
        if plan.rank_pieces(self.rank)[1] != e.rank_plan.nbytes:  # the rules make them equal: a bug if not
            raise SaveError(f"step {step}: the union of the ranks' structures plans rank {self.rank}'s stream at "
                            f"{plan.rank_pieces(self.rank)[1]} bytes, its own plan at {e.rank_plan.nbytes}")
        self._union = ((fps, e.fingerprint), plan, fp)
        return plan, fp

    def _lead(self, job: SaveJob) -> None:
        """A group leader (not rank 0): gather the group's records into one for rank 0."""
        s = self.settings
        try:
            group = lead_group(
                self.storage, step=job.step, run_id=s.run_id, attempt=job.attempt, world_size=s.world_size,
                rank=self.rank, own=self.record(job), timeout=s.commit_timeout, max_delay=s.poll_interval,
            )
            rel = f"{step_dir(job.step)}/{group_name(job.attempt, self.rank // GROUP)}"
            self.storage.makedirs(rel.rsplit("/", 1)[0])
            self.storage.put_atomic(rel, group, fsync=False)
        except BaseException as exc:  # noqa: BLE001
            self.report_failure(job, exc, "gathering its group's records")
            return
        job.handle._succeed()

    def record(self, job: SaveJob) -> bytes:
        """This rank's record of ``job`` for its group leader (rank 0's own, for its gather)."""
        e = job.entry
        s = self.settings
        # the first save with a structure: at most a group, or a pipeline stage's (rank 0
        # builds the union of the stages' structures from these, one per fingerprint)
        # (sent again until a save that carried it is seen committed: rank 0 may never have
        # read it, its commit having failed)
        send = not e.published
        if e.published_in is not None and not s.is_coordinator:
            step, attempt = e.published_in
            if self.storage.exists(f"{step_dir(step)}/{committed_name(attempt)}"):
                e.published_in = None
            else:
                send = True
        structure = None
        if send and (s.world_size <= GROUP or e.partial):
            structure, e.published_in = e.structure_bytes, (job.step, job.attempt)
        e.published = True
        return record_doc(run_id=s.run_id, attempt=job.attempt, step=job.step, world_size=s.world_size,
                          entries={self.rank: job.line}, lanes=job.lanes, structure=structure,
                          keyed=keyed_entries(self.rank, job.keyed))

    def hand_in(self, job: SaveJob) -> None:
        """A rank that leads no group: write its record for its leader; its part is then done."""
        try:
            # no fsync: a record only tells the leader that this rank's (fsynced) files are
            # complete; after the commit the manifest holds everything it said
            self.storage.makedirs(f"{step_dir(job.step)}/{record_name(job.attempt, self.rank).rsplit('/', 1)[0]}")
            self.storage.put_atomic(f"{step_dir(job.step)}/{record_name(job.attempt, self.rank)}",
                                    self.record(job), fsync=False)
        except BaseException as exc:  # noqa: BLE001
            self.report_failure(job, exc, "writing its record")
            return
        job.handle._succeed()

    def report_failure(self, job: SaveJob, exc: BaseException, what: str) -> None:
        """Every rank announces its own failure to the attempt's other ranks (rank 0's
        included): nobody waits out commit_timeout for a save that cannot commit. Its files
        go first: on a full disk that makes room for the marker. A rank that failed after
        another announced the save's failure reports that rank's cause (its own error is
        likely a consequence: the failed save's files removed under its writer)."""
        if not isinstance(exc, AnnouncedFailure):
            try:
                earlier = failure_message(self.storage, job.step, job.attempt)
            except Exception:  # noqa: BLE001 - a storage that fails here: report this rank's own error
                earlier = None
            if earlier is not None:
                exc = AnnouncedFailure(f"{earlier} (then this rank, while {what}: {type(exc).__name__}: {exc})")
        log.error("flexckpt rank %d: save of step %d failed while %s: %s", self.rank, job.step, what, exc,
                  exc_info=None if expected_failure(exc) else exc)  # the handle holds the traceback
        try:  # at once: a full disk must not stop every later save
            reclaim_failed(self.storage, job.step, job.attempt, None if what == "committing" else self.rank)
        except Exception as e:  # noqa: BLE001 - best effort; start-up and the next commit reclaim too
            log.error("flexckpt rank %d: could not remove the files of failed step %d: %s", self.rank, job.step, e,
                      exc_info=not expected_failure(e))
        if not isinstance(exc, AnnouncedFailure):
            mark_failed(self.storage, job.step, job.attempt, f"rank {self.rank} failed while {what}: {type(exc).__name__}: {exc}")
        job.handle._fail(exc)

    def wait_for_commit(self, step: int, timeout: float | None, attempt: str) -> None:
        """Other ranks learn of the commit from storage: the attempt's ``committed`` marker,
        or its failure marker (a few existence checks per poll, never a listing of the step)."""
        limit = self.settings.commit_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = 0.002
        folder = step_dir(step)
        while True:
            if self.storage.exists(f"{folder}/{committed_name(attempt)}"):
                return
            failed = failure_message(self.storage, step, attempt)
            if failed is not None:
                raise SaveError(failed)
            if not self.storage.exists(f"{folder}/{table_name(attempt, self.rank)}"):
                raise SaveError(f"the folder of step {step} was removed before this rank saw its commit "
                                f"(retention with a small keep_last, or another job on the same URL)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} was not committed within {limit:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, self.settings.poll_interval)

    def reclaim(self) -> None:
        """Files of saves that failed or were cut short before this launch (see
        :func:`flexckpt.save.cleanup.reclaim_at_start`): a restarted job on a full disk saves again.
        The coordinator runs it on a thread of its own, started at construction (a load, a
        fast tier's recovery included, never waits for it; the first save makes its folders
        once it is done, ``close()`` waits for it)."""
        s = self.settings
        try:
            with self.folders_lock:
                removed = reclaim_at_start(self.storage, s.run_id, s.commit_timeout, self.since,
                                           f"{s.run_id}.{s.session}")
        except Exception:  # noqa: BLE001 - housekeeping; saves report their own failures
            log.exception("flexckpt: reclaiming unfinished saves under %s failed", self.storage.url)
            return
        if removed:
            log.info("flexckpt: removed %d unfinished save attempt(s): %s", len(removed), removed[:10])
