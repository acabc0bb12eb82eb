"""SIGKILL trials for the fast tier (issue 17), on ``helpers/kill_trials.py``'s pattern: a parent
started once (torch imported once) forks a child per rank per trial; the children train
with a fast save every step and die by SIGKILL, while a fast-tier step is being written to
a node's folder or copied to its partner node; the job restarts and must load a whole step.

The job: 3 emulated nodes ``n0 n1 n2`` (a folder each, one rank each, ``FLEXCKPT_NODE``),
a sharded state (``kill_trials.state_for``: every step's values differ), fast save every
step with one copy on the next node, persistent saves at steps ``PERSISTENT``, and a
barrier each step (the trainer's collectives keep the ranks in step). A kill comes:

- from a hook on one rank (the parent then kills the others, as torchrun does): the
  ``n``-th call, before or after it, of the replication ``send``, a tier ``isend`` (a copy
  here is four: its header, its marker, its data file, its table), the receiving ``recv``, a write of a received copy
  (``put_atomic`` on the receiving thread) or of the node's own files (``write_stream`` /
  ``put_atomic`` on the tier's thread);
- or from the parent at a random time, every rank at once.

A slow link (``LINK_DELAY`` before each tier ``isend``) and a slow tmpfs (``DISK_DELAY``
before each own-file write) widen the windows a random kill can hit. Each rank logs when
it enters and leaves each window; a rank whose log ends inside one died there.

Then one node's folder may be deleted (``lose``), and the job restarts, renumbered, on the
surviving nodes. The parent works out, independently of the library, what the restart must
load: the newest step whose every saved rank's files are complete on some surviving node
(marker present, every file of the length and xxh3 the marker names), unless the newest
persistent step is newer. Checks: every rank loads that step from that source, bit-exact
(a mix of steps cannot be: every step's values differ), and it is no older than the newest
step every rank had finished saving (and, for a lost node, whose copy had landed).

    python helpers/tier_kill_trials.py TRIALS.json   # one JSON line per trial, then a summary
    python helpers/tier_kill_trials.py --random N [--seed S] [--chosen] [--folder DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kill_trials import N_ELEMENTS, _kill, state_for, wait_all  # noqa: E402

NODES = ("n0", "n1", "n2")
WORLD = len(NODES)
STEPS = 6
PERSISTENT = (2, 4)
LINK_DELAY = 0.03  # seconds before each tier isend: a slow link, so random kills land in a copy
DISK_DELAY = 0.02  # seconds before each of a rank's own tier file writes
DEADLINE = 60.0  # seconds a launch may take before it counts as hung


@dataclass(frozen=True)
class TierTrial:
    """``target`` a hook (see ``HOOKS``) on rank ``rank`` at its ``n``-th call, ``when``
    "before" or "after"; None: every rank killed ``delay`` seconds after the start (a
    fraction of an unkilled run before ``main`` scales it); "": never killed. ``lose``: the
    node whose folder is gone at the restart (None: all survive)."""

    target: str | None = None
    n: int = 1
    when: str = "before"
    rank: int = 0
    delay: float = 0.0
    lose: int | None = None

    def label(self) -> str:
        lost = "no node lost" if self.lose is None else f"{NODES[self.lose]} lost"
        if self.target is None:
            return f"random time {self.delay * 1000:.0f} ms, {lost}"
        return f"rank {self.rank} {self.when} {self.target} #{self.n}, {lost}"


def _save_thread() -> bool:
    name = threading.current_thread().name
    return name.startswith("flexckpt-tier-r") and not name.startswith("flexckpt-tier-recv")


def _recv_thread() -> bool:
    return threading.current_thread().name.startswith("flexckpt-tier-recv")


# hook name -> (module, attribute path, which thread's calls count)
HOOKS = {
    "send": ("flexckpt.tier.fast", "send", _save_thread),
    "isend": ("torch.distributed", "isend", _save_thread),
    "recv": ("flexckpt.tier.transport", "recv", _recv_thread),
    "copy_put": ("flexckpt.storage", "Storage.put_atomic", _recv_thread),
    "own_write": ("flexckpt.storage", "Storage.write_stream", _save_thread),
    "own_put": ("flexckpt.storage", "Storage.put_atomic", _save_thread),
}


def _owner_attr(module: str, path: str) -> tuple[Any, str]:
    import importlib

    owner: Any = importlib.import_module(module)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    if not hasattr(owner, attr):
        raise AttributeError(f"{module}.{path} is gone: update tier_kill_trials.HOOKS to the tier's new names")
    return owner, attr


def _wrap(module: str, path: str, make: Any) -> None:
    owner, attr = _owner_attr(module, path)
    setattr(owner, attr, make(getattr(owner, attr)))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_hook(target: str, n: int, when: str) -> None:
    module, path, counts = HOOKS[target]
    calls = [0]

    def make(real: Any) -> Any:
        def hooked(*a: Any, **k: Any) -> Any:
            if not counts():
                return real(*a, **k)
            calls[0] += 1
            if calls[0] == n and when == "before":
                _die()
            out = real(*a, **k)
            if calls[0] == n:
                _die()
            return out

        return hooked

    _wrap(module, path, make)


def install_phase_log(path: str) -> None:
    """Log entering and leaving each window (``kind+``/``kind-`` and the step) to ``path``;
    also the slow link and the slow tmpfs. One ``os.write`` a line: a kill never tears one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(kind: str, step: int, src: int = -1) -> None:
        os.write(fd, f"{kind} {step} {src}\n".encode())

    def job(real: Any) -> Any:  # FastTier._save_one(self, job): stage, write own files, send copies
        def wrapped(self: Any, j: Any) -> Any:
            note("job+", j.step)
            try:
                return real(self, j)
            finally:
                note("job-", j.step)
        return wrapped

    def send(real: Any) -> Any:  # one copy to one partner
        def wrapped(group: Any, store: Any, prefix: str, dst: int, header: Any, *a: Any, **k: Any) -> Any:
            note("send+", header.step)
            out = real(group, store, prefix, dst, header, *a, **k)
            note("send-", header.step)
            return out
        return wrapped

    def recv(real: Any) -> Any:  # the doorbell rang: receiving a copy
        def wrapped(group: Any, src: int, *a: Any, **k: Any) -> Any:
            note("recv+", -1, src)
            return real(group, src, *a, **k)
        return wrapped

    def deliver(real: Any) -> Any:  # a received copy written and marked complete
        def wrapped(self: Any, header: Any, *a: Any) -> Any:
            out = real(self, header, *a)
            note("copy-", header.step, header.source)
            return out
        return wrapped

    def slow(delay: float) -> Any:
        def make(real: Any) -> Any:
            def wrapped(*a: Any, **k: Any) -> Any:
                if _save_thread():
                    time.sleep(delay)
                return real(*a, **k)
            return wrapped
        return make

    _wrap("flexckpt.tier.fast", "FastTier._save_one", job)
    _wrap("flexckpt.tier.fast", "send", send)
    _wrap("flexckpt.tier.transport", "recv", recv)
    _wrap("flexckpt.tier.fast", "FastTier._deliver", deliver)
    _wrap("torch.distributed", "isend", slow(LINK_DELAY))
    _wrap("flexckpt.storage", "Storage.write_stream", slow(DISK_DELAY))


def _tier(folder: str, node: str) -> Any:
    from flexckpt.tier import LocalTier

    return LocalTier(dir=os.path.join(folder, "nodes", node), every=1, replicas=1, keep_last=2, timeout=20,
                     lineage="tierkill", stale_after=0)


def _init(folder: str, name: str, rank: int, world: int) -> None:
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(folder, name), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))


def _train(folder: str, trial: TierTrial, rank: int) -> None:
    import torch.distributed as dist
    from flexckpt import Checkpointer

    os.environ["FLEXCKPT_NODE"] = NODES[rank]
    install_phase_log(os.path.join(folder, f"phases-r{rank}"))
    if trial.target and rank == trial.rank:
        install_hook(trial.target, trial.n, trial.when)
    _init(folder, "pg-train", rank, WORLD)
    ck = Checkpointer(os.path.join(folder, "store"), run_id="tierkill", keep_last=2, fsync=False,
                      local=_tier(folder, NODES[rank]))
    confirm = os.open(os.path.join(folder, f"confirm-r{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for step in range(1, STEPS + 1):
        state = state_for(step, 0, rank, WORLD, sharded=True)
        if step in PERSISTENT:
            ck.save(step, state).result(60)
        h = ck.save_local(step, state)
        if h is None:
            raise RuntimeError(f"fast save of step {step} skipped: the previous one was waited for")
        h.result(60)  # this rank's files are on its node and its copy was sent
        os.write(confirm, f"{step}\n".encode())
        dist.barrier()  # the step's collectives: no rank runs ahead
    time.sleep(0.3)  # the last copies land; then the run ends as a kill would (no close)


def _restart(folder: str, survivors: list[str], rank: int, out: str) -> None:
    import torch
    from flexckpt import Checkpointer
    from flexshard import Shard, ShardedTensor

    world = len(survivors)
    os.environ["FLEXCKPT_NODE"] = survivors[rank]
    _init(folder, "pg-restart", rank, world)
    ck = Checkpointer(os.path.join(folder, "store"), run_id="tierkill", keep_last=2, fsync=False,
                      local=_tier(folder, survivors[rank]))
    state = {"w": ShardedTensor.empty((N_ELEMENTS,), Shard(0), rank=rank, world_size=world),
             "ids": ShardedTensor.empty((N_ELEMENTS // 4,), Shard(0), torch.int64, rank=rank, world_size=world),
             "step": -1, "version": -1}
    try:
        step = ck.load(state)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        Path(out).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return
    want = state_for(step, 0, rank, world, sharded=True)
    exact = (torch.equal(state["w"].local, want["w"].local) and torch.equal(state["ids"].local, want["ids"].local)
             and (state["step"], state["version"]) == (step, 0))
    rec = ck.tier.last_recovery
    Path(out).write_text(json.dumps({"step": step, "exact": exact, "source": rec.source, "reason": rec.reason}))


def _fork(fn: Any, *args: Any) -> int:
    pid = os.fork()
    if pid == 0:  # the child: never return into the parent's code
        code = 0
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    return pid


def _wait_all(pids: list[int], stop_on_kill: bool) -> tuple[dict[int, int], bool]:
    return wait_all(pids, stop_on_kill, DEADLINE)


# -- what the restart must load, worked out from the files --------------------------------------
def complete_steps(folder: str, nodes: list[str]) -> dict[tuple[int, str], set[int]]:
    """(step, attempt) -> saved ranks whose files some node of ``nodes`` holds whole: a
    marker, and every file it names with the marker's length, checked as a received copy is
    (the table and values against the marker's line, each data chunk against the table)."""
    from flexckpt.tier.inventory import check_copy, file_lengths

    held: dict[tuple[int, str], set[int]] = {}
    for node in nodes:
        for tier in Path(folder, "nodes", node).glob("flexckpt-tier-*"):
            for marker in tier.glob("step-*/*/r*-w*.done"):
                try:
                    doc = json.loads(marker.read_bytes())
                    files = [(rel, (tier / marker.parent.parent.name / rel).read_bytes()) for rel in file_lengths(doc)]
                    check_copy(doc, files)
                    ok = all(len(b) == n for (_rel, b), n in zip(files, file_lengths(doc).values()))
                except (OSError, ValueError, KeyError):
                    ok = False
                if ok and doc["world_size"] == WORLD:
                    held.setdefault((doc["step"], doc["attempt"]), set()).add(doc["rank"])
    return held


def expected(folder: str, survivors: list[str]) -> tuple[str, int | None]:
    from flexckpt import Checkpointer

    complete = [k for k, ranks in complete_steps(folder, survivors).items() if ranks == set(range(WORLD))]
    best = max(complete, key=lambda k: (k[0], int(k[1].rsplit(".", 1)[1])), default=None)
    ck = Checkpointer(os.path.join(folder, "store"), rank=0, world_size=1, run_id="tierkill")
    try:
        persistent = ck.steps()
    finally:
        ck.close()
    newest = max(persistent) if persistent else None
    if best is not None and (newest is None or best[0] >= newest):
        return "tier", best[0]
    return ("persistent", newest) if newest is not None else ("none", None)


def _lines(path: str) -> list[list[str]]:
    try:
        return [line.split() for line in Path(path).read_text().splitlines()]
    except FileNotFoundError:
        return []


def guaranteed(folder: str, lose: int | None) -> int:
    """The newest step that must survive: every rank had finished its save (its own files
    on its node, its copy sent) and, for the lost node's rank, the copy had landed."""
    confirmed = [{int(x[0]) for x in _lines(os.path.join(folder, f"confirm-r{r}"))} for r in range(WORLD)]
    steps = set.intersection(*confirmed)
    if lose is not None:
        partner = (lose + 1) % WORLD  # the next node holds the lost rank's copy
        landed = {int(x[1]) for x in _lines(os.path.join(folder, f"phases-r{partner}"))
                  if x[0] == "copy-" and int(x[2]) == lose}
        steps &= landed
    return max(steps, default=0)


def windows_at_death(folder: str) -> set[str]:
    """The windows some rank's log ends inside: "replication" (sending a copy, or receiving
    and writing one) or "local write" (staging and writing its own files)."""
    out = set()
    for r in range(WORLD):
        open_: dict[str, bool] = {"job": False, "send": False, "recv": False}
        for kind, *_ in _lines(os.path.join(folder, f"phases-r{r}")):
            name, sign = kind[:-1], kind[-1]
            if name == "copy":
                open_["recv"] = False
            else:
                open_[name] = sign == "+"
        if open_["send"] or open_["recv"]:
            out.add("replication")
        elif open_["job"]:
            out.add("local write")  # a job before its first send
    return out


def run_trial(folder: str, trial: TierTrial) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    t0 = time.monotonic()
    pids = [_fork(_train, folder, trial, rank) for rank in range(WORLD)]
    if trial.target is None:
        time.sleep(trial.delay)
        _kill(pids)
    status, hung = _wait_all(pids, stop_on_kill=True)
    child_s = time.monotonic() - t0
    killed = any(os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGKILL for st in status.values())
    failed = [r for r, st in status.items() if os.WIFEXITED(st) and os.WEXITSTATUS(st) != 0]
    base = {"trial": trial.label(), "killed": killed, "child_s": round(child_s, 3),
            "windows": sorted(windows_at_death(folder)) if killed else []}
    if hung or (failed and not killed):
        return {**base, "ok": False, "why": f"the training launch {'hung' if hung else 'failed on ranks ' + str(failed)}"}
    if trial.lose is not None:
        shutil.rmtree(os.path.join(folder, "nodes", NODES[trial.lose]), ignore_errors=True)
    survivors = [n for i, n in enumerate(NODES) if i != trial.lose][::-1]  # renumbered
    source, step = expected(folder, survivors)
    floor = guaranteed(folder, trial.lose)
    outs = [os.path.join(folder, f"restart-r{r}.json") for r in range(len(survivors))]
    pids = [_fork(_restart, folder, survivors, r, outs[r]) for r in range(len(survivors))]
    status, hung = _wait_all(pids, stop_on_kill=False)
    res = [json.loads(Path(o).read_text()) if os.path.exists(o) else {"error": "no result"} for o in outs]
    base.update(expected=[source, step], floor=floor, loaded=[r.get("step") for r in res],
                sources=sorted({r.get("source", "?") for r in res}))
    errors = [r["error"] for r in res if "error" in r]
    if source == "none" and not hung and len(errors) == len(res) and all("no committed checkpoint" in e for e in errors):
        return {**base, "ok": True, "sources": ["none"]}  # killed before any step was saved: a fresh start
    if hung or errors:
        return {**base, "ok": False, "why": f"the restart {'hung' if hung else 'failed'}: {errors[:2]}"}
    # the tier may hold part of the persistent step itself (the same save): it loads the parts
    # it holds and takes the missing ranks' parts from the store; bit-exact is what matters,
    # and every step's values differ, so a mix of steps fails ``exact``
    completed = f"the persistent store holds step {step}: those parts come from it"
    wrong = [r for r in res if (r["source"], r["step"], r["exact"]) != (source, step, True)
             and not (source == "persistent" and (r["source"], r["step"], r["exact"]) == ("tier", step, True)
                      and completed in r.get("reason", ""))]
    if wrong:
        return {**base, "ok": False, "why": f"expected {source} step {step} bit-exact, got {wrong[:2]}"}
    if step < floor:
        return {**base, "ok": False, "why": f"step {floor} was saved everywhere, yet step {step} was restored"}
    return {**base, "ok": True, "store_completed": any(completed in r.get("reason", "") for r in res)}


def chosen_trials() -> list[TierTrial]:
    """Kill points inside a copy (sender and receiver, every stage of a transfer) and inside
    a node's own writes, with the copy's target node or the sender's node lost."""
    out = []
    for n, lose in ((2, 0), (4, 1)):  # copies 2 and 4 of rank 0, to node n1; n0 (the source) or n1 lost
        out += [TierTrial("send", n, "before", 0, lose=lose), TierTrial("send", n, "after", 0, lose=lose)]
    out += [TierTrial("isend", 7, "before", 0, lose=0),  # copy 2's header and marker went, its data file not
            TierTrial("isend", 8, "after", 0, lose=0),  # its last file posted, the sender gone
            TierTrial("recv", 3, "before", 1, lose=0), TierTrial("recv", 3, "after", 1, lose=0),
            TierTrial("copy_put", 5, "before", 1, lose=0),  # step 2's copy of n0: data written, table and marker not
            TierTrial("copy_put", 6, "after", 1, lose=0),  # its marker written
            TierTrial("own_write", 3, "before", 2, lose=None), TierTrial("own_write", 3, "after", 2, lose=1),
            TierTrial("own_put", 6, "before", 2, lose=None), TierTrial("own_put", 6, "after", 2, lose=2)]
    return out


def quick_trials() -> list[TierTrial]:
    """The default suite's share: one kill at each stage of a copy and of a node's own writes."""
    pick = {("send", "after"), ("isend", "before"), ("recv", "after"), ("copy_put", "before"), ("own_write", "after"),
            ("own_put", "before")}
    return [t for t in chosen_trials() if (t.target, t.when) in pick and t.n != 4]


def random_trials(count: int, seed: int) -> list[TierTrial]:
    rng = random.Random(seed)
    return [TierTrial(None, delay=rng.uniform(0.05, 1.0), lose=rng.choice([None, 0, 1, 2])) for _ in range(count)]


def run(base: str, trials: list[TierTrial]) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    if any(t.target is None for t in trials):
        # random kill times spread over an unkilled run, timed here (twice: the first pays for first use)
        span = min(run_trial(os.path.join(base, f"timing-{i}"), TierTrial(""))["child_s"] for i in (0, 1))
        print(json.dumps({"unkilled_run_s": span}), file=sys.stderr, flush=True)
        trials = [TierTrial(t.target, t.n, t.when, t.rank, t.delay * span, t.lose) if t.target is None else t
                  for t in trials]
    results = []
    for i, trial in enumerate(trials):
        result = run_trial(os.path.join(base, f"trial-{i:03d}"), trial)
        results.append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps(summary(results)), flush=True)
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"trials": len(results), "ok": sum(r["ok"] for r in results), "killed": sum(r["killed"] for r in results),
            "in_replication": sum("replication" in r["windows"] for r in results),
            "in_local_write": sum("local write" in r["windows"] for r in results),
            "tier_restores": sum(r.get("sources") == ["tier"] for r in results),
            "persistent_restores": sum(r.get("sources") == ["persistent"] for r in results),
            "store_completed": sum(bool(r.get("store_completed")) for r in results)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="a JSON file: {folder, trials: [TierTrial fields]}")
    p.add_argument("--random", type=int, default=0, help="random-time trials")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chosen", action="store_true", help="also the chosen kill points")
    p.add_argument("--folder", default=None, help="where the trials' files go (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    if args.config:
        config = json.loads(Path(args.config).read_text())
        results = run(config["folder"], [TierTrial(**t) for t in config["trials"]])
    else:
        folder = args.folder or tempfile.mkdtemp(prefix="tier-kill-")
        try:
            t0 = time.monotonic()
            results = run(folder, (chosen_trials() if args.chosen else []) + random_trials(args.random, args.seed))
            print(f"{len(results)} trials in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        finally:
            if args.folder is None:
                shutil.rmtree(folder, ignore_errors=True)
    return 0 if all(r["ok"] for r in results) else 1


def trials_json(folder: str, trials: list[TierTrial]) -> str:
    return json.dumps({"folder": folder, "trials": [asdict(t) for t in trials]})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
