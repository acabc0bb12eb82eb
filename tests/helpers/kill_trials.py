"""SIGKILL trials for flexckpt: a parent process, started once (torch imported once), forks a
child per rank per trial; the children save checkpoints and are killed, either by a hook at
the storage layer ("the n-th call of ``Storage.<method>``" on one rank, before, during or
after it; the parent then kills the other ranks, as torchrun does) or by the parent at a
random time. The parent then checks the folder the children left:

- no committed step was lost: the newest step whose ``result()`` returned in the child is
  still listed (unless ``keep_last`` newer steps are);
- every listed step loads bit-exact, as one of the states that step was saved with (no mixed,
  stale or damaged commit);
- a restarted job can load the newest step and commit the next one.

Hooks wrap ``Storage`` methods only (their names outlive protocol changes). Run as
``python helpers/kill_trials.py TRIALS.json`` or ``python helpers/kill_trials.py [--chosen] [--random N]``
(``python3 dev.py test-kill``): it prints one JSON summary line per trial and a total.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the storage calls a hook can kill at; "during" cuts a streamed write after its first part
KILLABLE = ("makedirs", "write_stream", "write_direct", "put_atomic", "remove", "remove_tree")
N_ELEMENTS = 12_000  # small: no OpenMP parallel region ever runs in a forked child
KEEP_LAST = 2
WORLD = {"steady": 1, "direct": 1, "resave": 1, "two_ranks": 2, "interleaved": 1}  # ranks per scenario


@dataclass(frozen=True)
class Trial:
    """``scenario``: "steady" (steps 1-6), "direct" (the same with O_DIRECT and no
    compression), "resave" (steps 1-4, roll back to 3, save 4 and 5 again with new values)
    or "two_ranks" (steps 1-6 at world 2, tensors sharded; checked and resumed at world 1)
    or "interleaved" (steps 2, 1, 4, 3, 6, 5, two saves in flight at a time, the larger first).
    Kill rank ``rank`` at the ``n``-th call of ``method`` (``when`` "before", "during" or
    "after"), or, with ``method`` None, every rank ``delay`` seconds after the start
    (``method`` "": never)."""

    scenario: str
    method: str | None = None
    n: int = 1
    when: str = "before"
    delay: float = 0.0
    rank: int = 0

    def label(self) -> str:
        if self.method is None:
            return f"{self.scenario}: random time {self.delay * 1000:.1f} ms"
        return f"{self.scenario}: rank {self.rank} {self.when} {self.method} #{self.n}"


def state_for(step: int, version: int, rank: int = 0, world: int = 1, sharded: bool = False) -> dict[str, Any]:
    """The state saved as ``step`` (``version`` tells re-saves apart): whole tensors, or this
    rank's pieces of them."""
    import torch
    from flexshard import Shard, ShardedTensor

    g = torch.Generator().manual_seed(step * 1000 + version)
    w = torch.randn(N_ELEMENTS, generator=g)
    ids = torch.randint(0, 1 << 30, (N_ELEMENTS // 4,), generator=g, dtype=torch.int64)
    if sharded:
        w, ids = (ShardedTensor.from_global(t, Shard(0), rank, world) for t in (w, ids))
    return {"w": w, "ids": ids, "step": step, "version": version}


def _empty(sharded: bool) -> dict[str, Any]:
    import torch
    from flexshard import Shard, ShardedTensor

    if sharded:  # world 1: the whole tensors
        return {"w": ShardedTensor.empty((N_ELEMENTS,), Shard(0), rank=0, world_size=1),
                "ids": ShardedTensor.empty((N_ELEMENTS // 4,), Shard(0), torch.int64, rank=0, world_size=1),
                "step": -1, "version": -1}
    return {"w": torch.zeros(N_ELEMENTS), "ids": torch.zeros(N_ELEMENTS // 4, dtype=torch.int64), "step": -1, "version": -1}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    def whole(t: Any) -> Any:
        return getattr(t, "local", t)

    return (torch.equal(whole(a["w"]), whole(b["w"])) and torch.equal(whole(a["ids"]), whole(b["ids"]))
            and a["step"] == b["step"] and a["version"] == b["version"])


def _checkpointer(root: str, scenario: str, rank: int = 0, world: int = 1):
    from flexckpt import Checkpointer

    direct = scenario == "direct"
    return Checkpointer(root, run_id="killjob", keep_last=KEEP_LAST, chunk_bytes=4096, rank=rank, world_size=world,
                        compression=None if direct else "zstd", direct_io=direct, stall_timeout=60,
                        commit_timeout=60)


def _saves(scenario: str) -> list[tuple[int, int, int | None]]:
    """(step, version, roll back to this step first or None) in order."""
    if scenario == "resave":
        return [(1, 0, None), (2, 0, None), (3, 0, None), (4, 0, None), (4, 1, 3), (5, 1, None)]
    if scenario == "interleaved":
        return [(s, 0, None) for pair in ((2, 1), (4, 3), (6, 5)) for s in pair]
    return [(s, 0, None) for s in range(1, 7)]


def install_kill_hook(method: str, n: int, when: str) -> None:
    """Make the ``n``-th call of ``Storage.<method>`` in this process SIGKILL it."""
    from flexckpt.storage import Storage

    real = getattr(Storage, method)
    calls = [0]

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] != n:
            return real(self, *args, **kwargs)
        if when == "before":
            die()
        if when == "during" and method == "write_stream":
            def first_part_then_die(parts: Any) -> Any:
                for i, part in enumerate(parts):
                    if i == 1:
                        die()
                    yield part
                die()

            args = (args[0], first_part_then_die(args[1]), *args[2:])
        out = real(self, *args, **kwargs)
        die()
        return out

    setattr(Storage, method, hooked)


def _child(root: str, trial: Trial, log_path: str, rank: int) -> None:
    world = WORLD[trial.scenario]
    if trial.method and rank == trial.rank:
        install_kill_hook(trial.method, trial.n, trial.when)
    with open(log_path, "a") as log:
        ck = _checkpointer(root, trial.scenario, rank, world)
        in_flight = 2 if trial.scenario == "interleaved" else 1  # saves started before waiting
        saves = _saves(trial.scenario)
        for i in range(0, len(saves), in_flight):
            handles = []
            for step, version, rollback in saves[i : i + in_flight]:
                if rollback is not None:
                    ck.load(_empty(False), step=rollback)
                handles.append((step, version, ck.save(step, state_for(step, version, rank, world, sharded=world > 1))))
            for step, version, h in handles:
                h.result(timeout=60)
                if rank == 0:
                    log.write(f"{step} {version}\n")  # this step is committed: rank 0 was told so
                    log.flush()
        ck.close()


def _fork_rank(root: str, trial: Trial, log_path: str, rank: int) -> int:
    pid = os.fork()
    if pid == 0:  # the child: never return into the parent's code
        code = 0
        try:
            _child(root, trial, log_path, rank)
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    return pid


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_all(pids: list[int], stop_on_kill: bool, deadline_s: float | None = None) -> tuple[dict[int, int], bool]:
    """Exit statuses by rank; one rank killed: the others are killed too (``stop_on_kill``).
    Past ``deadline_s``: all killed, and hung (True)."""
    status: dict[int, int] = {}
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    while len(status) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in status:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[rank] = st
                    if stop_on_kill and os.WIFSIGNALED(st):
                        _kill([p for r, p in enumerate(pids) if r not in status])
        if deadline is not None and time.monotonic() > deadline:
            _kill([p for r, p in enumerate(pids) if r not in status])
            for rank, pid in enumerate(pids):
                if rank not in status:
                    status[rank] = os.waitpid(pid, 0)[1]
            return status, True
        time.sleep(0.002)
    return status, False


def run_trial(root: str, trial: Trial) -> dict[str, Any]:
    log_path = root + ".log"
    Path(log_path).write_text("")
    t0 = time.monotonic()
    pids = [_fork_rank(root, trial, log_path, rank) for rank in range(WORLD[trial.scenario])]
    if trial.method is None:
        time.sleep(trial.delay)
        _kill(pids)
    status, _ = wait_all(pids, stop_on_kill=True)  # one rank died: the launcher stops the others
    child_s = time.monotonic() - t0
    killed = os.WIFSIGNALED(status[trial.rank]) and os.WTERMSIG(status[trial.rank]) == signal.SIGKILL
    if any(os.WIFEXITED(st) and os.WEXITSTATUS(st) == 3 for st in status.values()) and not any(
        os.WIFSIGNALED(st) for st in status.values()
    ):
        return {"trial": trial.label(), "ok": False, "why": "a child failed, and none was killed"}
    confirmed = [tuple(map(int, line.split())) for line in Path(log_path).read_text().splitlines()]
    return {"trial": trial.label(), "killed": killed, "confirmed": len(confirmed), "child_s": round(child_s, 4),
            **verify(root, trial, confirmed)}


def verify(root: str, trial: Trial, confirmed: list[tuple[int, int]]) -> dict[str, Any]:
    """The checks of the module docstring; returns ``ok`` and, if not, why."""
    versions: dict[int, set[int]] = {}
    for step, version, _ in _saves(trial.scenario):
        versions.setdefault(step, set()).add(version)
    sharded = WORLD[trial.scenario] > 1
    ck = _checkpointer(root, trial.scenario)  # world 1, whatever the world that saved
    try:
        listed = ck.steps()
        if confirmed:
            newest = confirmed[-1][0]
            if newest not in listed and sum(s > newest for s in listed) < KEEP_LAST:
                return {"ok": False, "why": f"committed step {newest} was lost (listed: {listed})"}
        for step in listed:
            got = _empty(sharded)
            try:
                ck.load(got, step=step)
            except Exception as e:  # noqa: BLE001
                return {"ok": False, "why": f"listed step {step} does not load: {type(e).__name__}: {e}"}
            if not any(_same(got, state_for(step, v)) for v in versions.get(step, ())):
                return {"ok": False, "why": f"step {step} loads, but not as any state saved as step {step}"}
        # a restarted job resumes from the newest step and commits the next one
        nxt = (listed[-1] if listed else 0) + 1
        ck.save(nxt, state_for(nxt, 7, sharded=sharded)).result(timeout=60)
        got = _empty(sharded)
        ck.load(got)
        if not _same(got, state_for(nxt, 7)):
            return {"ok": False, "why": f"after the restart, step {nxt} does not load bit-exact"}
        return {"ok": True, "listed": listed}
    finally:
        ck.close()


def chosen_trials(scenario: str) -> list[Trial]:
    """Kill points along a run of ``scenario``: data writes (before, mid-stream, after), the
    manifest writes, the retention deletes, a new step's folder."""
    write = "write_direct" if scenario == "direct" else "write_stream"
    out = []
    for n in (1, 3, 5):
        out += [Trial(scenario, write, n, "before"), Trial(scenario, write, n, "after")]
        if write == "write_stream":
            out.append(Trial(scenario, write, n, "during"))
        out += [Trial(scenario, "put_atomic", n, "before"), Trial(scenario, "put_atomic", n, "after")]
    for n in (1, 2):
        out += [Trial(scenario, "remove", n, "before"), Trial(scenario, "remove", n, "after"),
                Trial(scenario, "remove_tree", n, "after")]
    out.append(Trial(scenario, "makedirs", 4, "after"))
    return out


def two_rank_trials() -> list[Trial]:
    """Rank 1 dies around its data write or its record; rank 0 around the manifest and the
    retention deletes."""
    out = []
    for n in (1, 4):
        out += [Trial("two_ranks", "write_stream", n, when, rank=1) for when in ("before", "during", "after")]
        out += [Trial("two_ranks", "put_atomic", n, when, rank=1) for when in ("before", "after")]
        out += [Trial("two_ranks", "put_atomic", n, when, rank=0) for when in ("before", "after")]
    out += [Trial("two_ranks", "remove_tree", 1, "after", rank=0), Trial("two_ranks", "remove", 2, "before", rank=0)]
    return out


def interleaved_trials() -> list[Trial]:
    """Two saves in flight, the larger step first (issue 14 defect 6): the smaller step's data
    write and table while the larger commits, the manifests, and the retention deletes."""
    return [Trial("interleaved", "write_stream", 2, "during"), Trial("interleaved", "put_atomic", 4, "before"),
            Trial("interleaved", "put_atomic", 8, "after"), Trial("interleaved", "remove", 1, "before"),
            Trial("interleaved", "remove_tree", 1, "after"), Trial("interleaved", "remove_tree", 2, "after")]


def random_trials(scenario: str, count: int, seed: int) -> list[Trial]:
    """Kills at random times; ``delay`` is a fraction of an unkilled run, which ``main`` times."""
    rng = random.Random(seed)
    return [Trial(scenario, delay=rng.uniform(0.0, 1.0)) for _ in range(count)]


def resave_trials() -> list[Trial]:
    """The re-save's chosen points: its data writes and its records."""
    return [t for t in chosen_trials("resave") if t.method in ("write_stream", "put_atomic")]


def every_chosen_trial() -> list[Trial]:
    return chosen_trials("steady") + chosen_trials("direct") + two_rank_trials() + interleaved_trials() + resave_trials()


def spread_random_trials(count: int, seed: int) -> list[Trial]:
    """``count`` random-time trials spread over the scenarios."""
    names = sorted(WORLD)
    return [t for i, name in enumerate(names)
            for t in random_trials(name, count // len(names) + (i < count % len(names)), seed + i)]


def run(base: Path, trials: list[Trial]) -> list[dict[str, Any]]:
    """Run ``trials`` in order under ``base``, printing one JSON line a trial and a total."""
    import torch

    torch.set_num_threads(1)
    for scenario in sorted({t.scenario for t in trials if t.method is None}):
        # random kill times spread over one unkilled run of the scenario, timed here
        # (twice: the first child also pays for first-use imports and caches)
        span = min(run_trial(str(base / f"timing-{scenario}-{i}"), Trial(scenario, method=""))["child_s"] for i in (0, 1))
        print(json.dumps({"scenario": scenario, "unkilled_run_s": span}), file=sys.stderr)
        trials = [Trial(t.scenario, delay=t.delay * span) if t.method is None and t.scenario == scenario else t
                  for t in trials]
    results = []
    for i, trial in enumerate(trials):
        result = run_trial(str(base / f"trial-{i:03d}"), trial)
        for retry in range(2):
            # a random time past the end of a run that ran faster than the timed one (a busy
            # machine's timing run is slow): the same trial again, earlier, so it still kills
            if trial.method is not None or result.get("killed") or not result["ok"]:
                break
            trial = Trial(trial.scenario, delay=trial.delay / 2)
            result = run_trial(str(base / f"trial-{i:03d}-again{retry}"), trial)
        results.append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps({"trials": len(results), "ok": sum(r["ok"] for r in results),
                      "killed": sum(bool(r.get("killed")) for r in results)}), flush=True)
    return results


def main(argv: list[str]) -> int:
    import argparse
    import shutil
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="a JSON file: {folder, trials: [Trial fields]}")
    p.add_argument("--random", type=int, default=0, help="random-time trials, spread over the scenarios")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chosen", action="store_true", help="also every chosen kill point")
    args = p.parse_args(argv)
    if args.config:
        config = json.loads(Path(args.config).read_text())
        results = run(Path(config["folder"]), [Trial(**t) for t in config["trials"]])
    else:
        folder = tempfile.mkdtemp(prefix="kill-trials-")
        try:
            t0 = time.monotonic()
            results = run(Path(folder), (every_chosen_trial() if args.chosen else [])
                          + spread_random_trials(args.random, args.seed))
            print(f"{len(results)} trials in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        print(f"FAILED {r['trial']}: {r.get('why')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
