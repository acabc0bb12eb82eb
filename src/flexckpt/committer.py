"""The commit side of a save, on the commit thread of a group leader: rank 0 gathers the
records by reading storage, writes the manifest (:mod:`flexckpt.commit` holds the pure
steps: gather, build, commit, retention) and applies retention; another group leader
(every GROUP-th rank) gathers its group's records into one. Every rank reports its own
failure here, and the other ranks learn of the commit from storage (``_wait_for_commit``).
"""
from __future__ import annotations

import logging
import time

from flexckpt.commit import (
    AnnouncedFailure,
    apply_retention,
    build_manifest,
    check_fingerprints,
    commit,
    committed_attempt,
    failure_message,
    gather,
    lead_group,
    mark_failed,
    other_live_job,
    reclaim_failed,
    write_keyed,
)
from flexckpt.errors import SaveError, expected_failure
from flexckpt.names import GROUP, attempt_run_id, committed_name, group_name, step_dir, table_name
from flexckpt.plan import WritePlan
from flexckpt.save_pipeline import PlanEntry, SaveJob
from flexckpt.stages import has_partial, union_structure

log = logging.getLogger("flexckpt")


class Committer:
    """The commit side of ``Checkpointer`` (a mixin, like :class:`flexckpt.save_pipeline.SavePipeline`)."""

    def _commit_one(self, job: SaveJob) -> None:
        if not self.is_coordinator:
            return self._lead(job)
        t0 = time.perf_counter()
        try:
            e = job.entry
            structures = self._structures
            keyed: dict[str, list] = {}
            entries, lanes = gather(
                self.storage, step=job.step, run_id=self.run_id, attempt=job.attempt, world_size=self.world_size,
                own=self._record(job), timeout=self.commit_timeout, max_delay=self.poll_interval,
                structures=structures, keyed=keyed,
            )
            job.handle.timings["gather_s"] = time.perf_counter() - t0
            plan, fp = self._union_plan(e, entries, job.step)
            other = other_live_job(self.storage, job.attempt, self._since, job.step, self._listed_steps)
            if other is not None:
                raise SaveError(
                    f"step {job.step}: another job is saving into {self.storage.url}: run "
                    f"{attempt_run_id(other.rsplit('/', 1)[1])!r} wrote {other} after this job started; nothing of it "
                    f"was deleted and this step is not committed; give each job its own URL"
                )
            manifest = build_manifest(
                step=job.step, run_id=self.run_id, attempt=job.attempt, plan=plan, fingerprint=fp,
                codec=self.compression.codec, entries=entries, plain=job.plain, lanes=lanes,
                per_rank_keys=e.per_rank_keys, keyed=write_keyed(self.storage, job.step, job.attempt, keyed, self.fsync),
                tree=job.tree,
            )
            commit(self.storage, manifest, self.fsync)
            now = committed_attempt(self.storage, job.step)
            if now != job.attempt:
                raise SaveError(f"step {job.step}: another job committed over this save (the manifest names {now})")
        except BaseException as exc:  # noqa: BLE001
            self._report_failure(job, exc, "committing")
            return
        job.handle.timings["commit_s"] = time.perf_counter() - t0
        job.handle._done.set()  # committed: retention below is housekeeping, not part of the save
        try:
            with self._folders_lock:
                apply_retention(self.storage, self.keep_last, job.step, job.attempt, self._since,
                                self.commit_timeout, in_flight=self._in_flight(), pinned=self.pinned)
        except Exception:  # noqa: BLE001 - the checkpoint is committed; retention retries next time
            log.exception("retention after step %d failed", job.step)

    def _in_flight(self) -> set[tuple[int, str]]:
        """(step, attempt) of this rank's saves not yet reported done: retention leaves
        their steps alone (a save registers in save(), before its writer makes a folder)."""
        with self._lock:
            return {(h.step, h.attempt) for h in self._handles if not h.done()}

    def _union_plan(self, e: PlanEntry, entries: dict[int, list], step: int) -> tuple[WritePlan, str]:
        """The plan and fingerprint the manifest holds: rank 0's own, or, when ranks saved
        different structures (pipeline stages), their union's (see :mod:`flexckpt.stages`),
        kept while the set of fingerprints stays the same."""
        fps = frozenset(line[0] for line in entries.values())
        if fps == {e.fingerprint}:
            return e.plan, e.fingerprint
        if self._union is not None and self._union[0] == (fps, e.fingerprint):
            return self._union[1], self._union[2]
        structures = {fp: self._structures[fp] for fp in fps if fp in self._structures}
        if not e.partial and not any(has_partial(st, self.world_size) for st in structures.values()):
            check_fingerprints(entries, step, e.fingerprint, e.structure, structures)  # no stages: names what differs
        try:
            union = union_structure(entries, step, e.fingerprint, e.structure, structures, self.world_size)
        except (KeyError, TypeError, ValueError) as exc:
            raise SaveError(f"step {step}: a record carries a malformed structure: {exc}") from None
        assert union is not None
        specs, _structure, fp = union
        plan = WritePlan(specs, self.world_size, e.plan.rules)
        if plan.rank_pieces(self.rank)[1] != e.rank_plan.nbytes:  # the rules make them equal: a bug if not
            raise SaveError(f"step {step}: the union of the ranks' structures plans rank {self.rank}'s stream at "
                            f"{plan.rank_pieces(self.rank)[1]} bytes, its own plan at {e.rank_plan.nbytes}")
        self._union = ((fps, e.fingerprint), plan, fp)
        return plan, fp

    def _lead(self, job: SaveJob) -> None:
        """A group leader (not rank 0): gather the group's records into one for rank 0."""
        try:
            group = lead_group(
                self.storage, step=job.step, run_id=self.run_id, attempt=job.attempt, world_size=self.world_size,
                rank=self.rank, own=self._record(job), timeout=self.commit_timeout, max_delay=self.poll_interval,
            )
            rel = f"{step_dir(job.step)}/{group_name(job.attempt, self.rank // GROUP)}"
            self.storage.makedirs(rel.rsplit("/", 1)[0])
            self.storage.put_atomic(rel, group, fsync=False)
        except BaseException as exc:  # noqa: BLE001
            self._report_failure(job, exc, "gathering its group's records")
            return
        job.handle._done.set()

    def _report_failure(self, job: SaveJob, exc: BaseException, what: str) -> None:
        """Every rank announces its own failure to the attempt's other ranks (rank 0's
        included): nobody waits out commit_timeout for a save that cannot commit. Its files
        go first: on a full disk that makes room for the marker."""
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

    def _wait_for_commit(self, step: int, timeout: float | None, attempt: str) -> None:
        """Other ranks learn of the commit from storage: the attempt's ``committed`` marker,
        or its failure marker (a few existence checks per poll, never a listing of the step)."""
        limit = self.commit_timeout if timeout is None else timeout
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
            delay = min(delay * 2, self.poll_interval)
