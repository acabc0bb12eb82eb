"""Effective training time under failures: persistent checkpoints only, against the fast
tier plus persistent checkpoints, at Llama 3's failure rate scaled to 16K and 100K GPUs.

Model (per GPU; every GPU waits for the slowest): failures arrive as a Poisson process
with mean time between failures M = (54 days / 419 interruptions) x 16,384 / GPUs. A save
every tau seconds costs the trainer c (its wait) and takes d to finish; with asynchronous
saves only the last *finished* save can be restored, so the save at k tau is restorable
from k tau + d on (tau >= d: one save in flight). A failure costs the restart R, the
recovery and the work since the last finished save: tau/2 + d on average to first order.
Failures during the restart and the recovery start them over (`--no-fail-in-restart`:
they do not). The fast tier restores a fraction q of failures (one node lost, or several
outside one replica group) and the others go to the persistent step; a failure restores the
newer finished step of the tiers that hold it (`load()` does). Persistent saves are taken at
every n-th fast save's step (tau_p = n tau_f).

The store: an aggregate bandwidth B, `fixed` (Llama 3's 2 TB/s, i.e. `--store-gbps` x
16,384, whatever the job's size) or `grows` (`--store-gbps` x GPUs); both are reported. Each
GPU holds S bytes, a replica group of `--replicas` R GPUs holds the same bytes, so a
persistent save writes S / R a GPU (each stored byte written once) and takes
GPUs x S / (R B). A recovery from the store reads with every GPU at once, sharing B:
- per-rank reads (today): each GPU reads its own S: GPUs x S / B;
- read once per job (issue 29): GPUs x S / (R B) from the store, fanned out to the
  replicas over the network (S (R - 1) / R received a GPU), overlapped with the reads;
and never faster than one GPU's own path (the measured recovery of the bytes it reads from
the store, or the host-to-device copy of S).

Expected effective fraction (renewal reward over failure cycles, exact for this model):
    eff = r * E[kept] / E[cycle],  r = 1 - c_p / tau_p - c_f / tau_f,
    E[kept | a tier (tau, d)] = tau e^{-d/M} / (e^{tau/M} - 1), plus, for a failure the fast
      tier could restore, what a newer persistent step adds (`newer_persistent`),
    E[cycle] = M + E[time to get through restart + recovery D] = M + M (e^{D/M} - 1).
The first-order closed form 1 - c/tau - (R + rec + tau/2 + d)/M agrees with it only while
the cost of a failure is small against M. Rule: intervals are chosen on the exact formula;
the closed form is printed where it agrees with the exact one within `CLOSED_FORM_AGREES`
(0.1 point) at the chosen intervals, and "breaks" elsewhere. A seeded Monte Carlo of the
same cycles (bounded by `--mc-cycles`) checks the exact value, with its standard error.

Inputs (`--inputs cpu`, the default) are measured on this 2-core machine (quiet), scaled linearly
with the bytes:
- trainer wait per save: `bench save_latency --libs flexckpt flexckpt-tier` (W=2, 50 MiB a
  rank, 0.6 s steps): the mean wait per persistent save, and what a fast save adds;
- a fast save's duration (stage + write to tmpfs + copy to the partner): the same run;
- recovery: `bench fast_tier --repeat 3` at 256 MiB a rank, from the fast tier (a lost
  node's files fetched from its partner) and the persistent store model (0.2 GB/s a rank);
  the fast recovery's rate also stands for a fan-out's receive.
With `--inputs gpu`, a GPU node's: a save stages device to host at `--d2h-gbps` (the
trainer waits for it: an upper bound), a fast save then copies S to its partner over the
GPU's network share `--net-gbps`; a fast recovery receives S over the network and copies
it to the device; a fan-out receives its share over the network.

    python3 dev.py bench fast_tier_sim [--inputs cpu|gpu] [--plot bench/fast_tier_sim.png]
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, replace

DAY = 86400.0
GIB = float(1 << 30)
MIB = float(1 << 20)
LLAMA3_GPUS = 16384
MTBF_16K = 54 * DAY / 419  # Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs
CLOSED_FORM_AGREES = 0.001  # the closed form is kept where it is within 0.1 point of the exact value
MC_MAX_DOWN = 8.0  # no Monte Carlo where a restart + recovery exceeds 8 M (e^8 retries a cycle)
# measured on the quiet 2-core machine (bench/RESULTS.md, "Issues 17 and 18: re-measured on a
# quiet machine (fourth session)"): save_latency --libs flexckpt flexckpt-tier --runs 3 at 50 MiB
# a rank (W=2, 0.6 s steps, 100 saves: mean trainer wait 1.0 ms flexckpt, 1.1 ms with a fast
# save every step; a fast save's stage + write + copy p50 31.5 + 78.8 + 79.8 ms) and fast_tier
# --repeat 3 at 256 MiB a rank (medians: recovery 0.158 s fast, 1.453 s persistent store model)
WAIT_PERSISTENT = 0.0010
WAIT_FAST = 0.0001
FAST_DURATION = 0.19
REC_FAST = 0.158
REC_PERSISTENT = 1.453


@dataclass(frozen=True)
class Tier:
    """One checkpoint tier's costs, seconds: the trainer's wait per save, a save's start to
    its being restorable, and the recovery after a restart."""
    wait: float
    duration: float
    recovery: float


@dataclass(frozen=True)
class Job:
    mtbf: float
    restart: float
    persistent: Tier
    fast: Tier | None = None
    q: float = 0.9  # fraction of failures the fast tier restores
    fail_in_restart: bool = True


def aggregate_bandwidth(gbps_per_gpu: float, gpus: int, store: str) -> float:
    """The store's aggregate bandwidth, bytes/s: sized for Llama 3's 16,384 GPUs and `fixed`,
    or `grows` with the job."""
    if store not in ("fixed", "grows"):
        raise ValueError(f"store {store!r}: use 'fixed' (aggregate of {LLAMA3_GPUS:,} GPUs) or 'grows'")
    return gbps_per_gpu * 1e9 * (LLAMA3_GPUS if store == "fixed" else gpus)


def store_seconds(bytes_per_gpu: float, gpus: int, aggregate: float) -> float:
    """Every GPU moving its bytes through the store at once, sharing its aggregate bandwidth."""
    return gpus * bytes_per_gpu / aggregate


def lost_work(tau: float, duration: float) -> float:
    """First-order work lost at a failure: half an interval since the last save started,
    plus that save's duration (only a finished save can be restored)."""
    return tau / 2 + duration


def expected_kept(tau: float, duration: float, mtbf: float) -> float:
    """E[time to the last save finished before an Exp(mtbf) failure], saves at k tau, k >= 1,
    each restorable from k tau + duration: sum_k P(L >= k tau + d)."""
    return tau * math.exp(-duration / mtbf) / math.expm1(tau / mtbf)


def _rate(job: Job, tau_p: float, tau_f: float | None) -> float:
    return 1 - job.persistent.wait / tau_p - (job.fast.wait / tau_f if job.fast else 0.0)


def newer_persistent(tau_p: float, d_p: float, tau_f: float, d_f: float, mtbf: float) -> tuple[float, float]:
    """A failure the fast tier could restore restores the newer finished step of the two
    tiers (as `load()` does). With a persistent save at every n-th fast save's step
    (tau_p = n tau_f), the persistent step is newer only while the fast save of the same step
    is still running (d_f > d_p): for u = L - j tau_p in [d_p, min(d_f, tau_p + d_p)), j >= 1,
    it is m tau_f newer, m = ceil((d_f - u) / tau_f). Returns (E[the work it keeps beyond the
    fast tier's], P(the persistent step is the newer))."""
    hi, extra, prob, m = min(d_f, tau_p + d_p), 0.0, 0.0, 1
    while True:
        lo, up = max(d_p, d_f - m * tau_f), min(hi, d_f - (m - 1) * tau_f)
        if up > lo:
            p = math.exp(-lo / mtbf) - math.exp(-up / mtbf)
            extra, prob = extra + m * tau_f * p, prob + p
        if d_f - m * tau_f <= d_p:
            break
        m += 1
    periods = 1 / math.expm1(tau_p / mtbf)  # sum over j >= 1 of e^(-j tau_p / M)
    return extra * periods, prob * periods


def _whole_fast_intervals(tau_p: float, tau_f: float) -> None:
    if abs(tau_p / tau_f - round(tau_p / tau_f)) > 1e-6 or tau_p < tau_f:
        raise ValueError(f"persistent interval {tau_p:g} s is not a whole number of fast intervals ({tau_f:g} s): "
                         f"save persistently every n-th fast step")


def _downtimes(job: Job, newer: float = 0.0) -> list[tuple[float, float]]:
    """(probability, restart + recovery) per tier restoring a failure; `newer`: the chance a
    failure the fast tier could restore finds a newer persistent step."""
    down_p = job.restart + job.persistent.recovery
    if job.fast is None:
        return [(1.0, down_p)]
    return [(job.q * (1 - newer), job.restart + job.fast.recovery), (1 - job.q * (1 - newer), down_p)]


def closed_form(job: Job, tau_p: float, tau_f: float | None = None) -> float:
    """First order in 1/M: 1 - save costs - (restart + recovery + lost work) / M."""
    lost = sum(p * down for p, down in _downtimes(job))
    if job.fast:
        lost += job.q * lost_work(tau_f, job.fast.duration) + (1 - job.q) * lost_work(tau_p, job.persistent.duration)
    else:
        lost += lost_work(tau_p, job.persistent.duration)
    return _rate(job, tau_p, tau_f) - lost / job.mtbf


def renewal(job: Job, tau_p: float, tau_f: float | None = None) -> float:
    """Exact expected fraction of wall time kept as useful steps (renewal reward); with the
    fast tier, tau_p is a whole number of fast intervals."""
    m, (d_p, fast) = job.mtbf, (job.persistent.duration, job.fast)
    kept, newer = expected_kept(tau_p, d_p, m), 0.0
    if fast:
        _whole_fast_intervals(tau_p, tau_f)
        extra, newer = newer_persistent(tau_p, d_p, tau_f, fast.duration, m)
        kept = job.q * (expected_kept(tau_f, fast.duration, m) + extra) + (1 - job.q) * kept
    down = sum(p * (m * math.expm1(d / m) if job.fail_in_restart else d) for p, d in _downtimes(job, newer))
    return _rate(job, tau_p, tau_f) * kept / (m + down)


def _last_finished(life: float, tau: float, duration: float) -> float:
    return max(0, math.floor((life - duration) / tau)) * tau


def monte_carlo(job: Job, tau_p: float, tau_f: float | None = None, cycles: int = 20000,
                seed: int = 0) -> tuple[float, float]:
    """Simulated failure cycles (seeded, `cycles` of them): the kept fraction and its
    standard error (ratio estimator). A failure restores the newest finished step of the
    tiers that hold it."""
    rng = random.Random(seed)
    rate = _rate(job, tau_p, tau_f)
    kept_all, time_all = [], []
    for _ in range(cycles):
        life = rng.expovariate(1 / job.mtbf)
        kept, tier = _last_finished(life, tau_p, job.persistent.duration), job.persistent
        if job.fast and rng.random() < job.q:
            fast_kept = _last_finished(life, tau_f, job.fast.duration)
            if fast_kept >= kept:
                kept, tier = fast_kept, job.fast
        t = life
        down = job.restart + tier.recovery
        while job.fail_in_restart and (x := rng.expovariate(1 / job.mtbf)) < down:
            t += x  # failed again while restarting: start over
        kept_all.append(rate * kept)
        time_all.append(t + down)
    eff = sum(kept_all) / sum(time_all)
    err = math.sqrt(sum((k - eff * t) ** 2 for k, t in zip(kept_all, time_all))) / sum(time_all)
    return eff, err


def _grid(start: float, stop: float, ratio: float) -> list[float]:
    return [start * ratio**k for k in range(int(math.log(stop / start) / math.log(ratio)) + 1)]


def best(job: Job) -> tuple[float, float, float | None]:
    """The intervals maximising the exact effective fraction, (eff, tau_p, tau_f): a grid 10%
    apart from each save's duration (one save in flight) to 30 M, then 0.5% apart around its
    best; with the fast tier, the persistent interval is n fast intervals (n from 1)."""
    stop, lo_p = 30 * job.mtbf, max(job.persistent.duration, 1.0)
    if job.fast is None:
        _, tp, _ = max((renewal(job, tp), tp, None) for tp in _grid(lo_p, stop, 1.1))
        return max((renewal(job, x), x, None) for x in _grid(max(lo_p, tp / 1.1), tp * 1.1, 1.005))
    lo_f = max(job.fast.duration, 1.0)

    def search(grid_f, ns):
        return max(((renewal(job, n * tf, tf), n * tf, tf) for tf in grid_f for n in ns if lo_p <= n * tf <= stop),
                   default=(-math.inf, math.nan, math.nan))

    ns = sorted({round(1.1**k) for k in range(int(math.log(stop / lo_f) / math.log(1.1)) + 1)})
    _, tp, tf = search(_grid(lo_f, stop, 1.1), ns)
    n = round(tp / tf)
    return search(_grid(max(lo_f, tf / 1.1), tf * 1.1, 1.005), range(max(1, int(n / 1.2)), int(n * 1.2) + 2))


def tiers(gib: float, gpus: int, store: str, args) -> dict[str, Tier]:
    """The persistent tier with per-rank reads and read once, and the fast tier, at S = gib."""
    s = gib * GIB
    agg = aggregate_bandwidth(args.store_gbps, gpus, store)
    written = s / args.replicas  # each stored byte written once, spread over the replicas
    fanout_bytes = s * (args.replicas - 1) / args.replicas
    if args.inputs == "gpu":
        stage, net = s / (args.d2h_gbps * 1e9), s / (args.net_gbps * 1e9)
        wait_p, wait_f = written / (args.d2h_gbps * 1e9), stage
        dur_f, rec_f, floor_p, floor_once = stage + net, net + stage, stage, stage
        fanout = fanout_bytes / (args.net_gbps * 1e9)
    else:
        wait_p = args.wait_persistent * written / (args.costs_mib * MIB) * args.persistent_cost
        wait_f = args.wait_fast * s / (args.costs_mib * MIB)
        dur_f = args.fast_duration * s / (args.costs_mib * MIB)
        rec_f = args.rec_fast * s / (args.recovery_mib * MIB)
        # the measured persistent recovery is bound by the store model's 0.2 GB/s a rank: it
        # scales with the bytes a GPU reads from the store (S, or S / R when read once)
        floor_p = args.rec_persistent * s / (args.recovery_mib * MIB)
        floor_once = args.rec_persistent * written / (args.recovery_mib * MIB)
        fanout = args.rec_fast * fanout_bytes / (args.recovery_mib * MIB)
    dur_p = store_seconds(written, gpus, agg)
    return {"per_rank": Tier(wait_p, dur_p, max(floor_p, store_seconds(s, gpus, agg))),
            "read_once": Tier(wait_p, dur_p, max(floor_once, store_seconds(written, gpus, agg), fanout)),
            "fast": Tier(wait_f, dur_f, rec_f)}


def evaluate(job: Job, cycles: int) -> dict:
    eff, tp, tf = best(job)
    cf = closed_form(job, tp, tf)
    slowest = max(down for _, down in _downtimes(job))
    # a restart far longer than M is retried about e^(D/M) times a cycle: no Monte Carlo there
    mc, err = monte_carlo(job, tp, tf, cycles=cycles) if slowest < MC_MAX_DOWN * job.mtbf else (math.nan, math.nan)
    return {"eff": eff, "tau_p": tp, "tau_f": tf, "closed": cf if abs(cf - eff) <= CLOSED_FORM_AGREES else None,
            "closed_raw": cf, "mc": mc, "mc_err": err, "rec_p": job.persistent.recovery}


def _cell(r: dict) -> str:
    closed = f"{r['closed']:.2%}" if r["closed"] is not None else f"breaks ({max(r['closed_raw'], 0):.1%})"
    return f"{r['eff']:.2%} / {closed} / {r['mc']:.2%}±{r['mc_err']:.2%}"


def _intervals(r: dict) -> str:
    return f"{r['tau_p']:.0f} s" + (f" / {r['tau_f']:.0f} s" if r["tau_f"] else "")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[0.33, 4.0, 40.0], help="state per GPU, GiB (0.33 4 40)")
    p.add_argument("--gpus", type=int, nargs="+", default=[16384, 100000], help="job sizes (16384 100000)")
    p.add_argument("--store", nargs="+", default=["fixed", "grows"], choices=["fixed", "grows"],
                   help="the store's aggregate bandwidth: fixed at 16,384 x --store-gbps, or grows with the job (both)")
    p.add_argument("--store-gbps", type=float, default=0.12, help="store GB/s per GPU at 16,384 GPUs (Llama 3: 2 TB/s / 16K)")
    p.add_argument("--replicas", type=int, default=8, help="GPUs holding the same bytes (HSDP's replicate dim; 8)")
    p.add_argument("--restart", type=float, default=180.0, help="seconds to restart the job after a failure (180)")
    p.add_argument("--q", type=float, default=0.9, help="fraction of failures the fast tier restores (0.9)")
    p.add_argument("--no-fail-in-restart", action="store_true", help="failures during a restart do not start it over")
    p.add_argument("--persistent-cost", type=float, default=1.0,
                   help="multiplies the measured trainer wait of a persistent save (1: this library's async saves)")
    p.add_argument("--mc-cycles", type=int, default=20000, help="failure cycles per Monte Carlo check (20000; seed 0)")
    p.add_argument("--inputs", choices=["cpu", "gpu"], default="cpu",
                   help="cpu: the costs measured here; gpu: a GPU node's (--d2h-gbps, --net-gbps)")
    p.add_argument("--d2h-gbps", type=float, default=25.0, help="gpu inputs: device-to-host copy GB/s a GPU (25)")
    p.add_argument("--net-gbps", type=float, default=12.5, help="gpu inputs: network share GB/s a GPU (12.5)")
    # measured (quiet 2-core machine; bench/RESULTS.md, issues 17 and 18, fourth session)
    p.add_argument("--costs-mib", type=float, default=50.0, help="state per rank the waits and the fast save were measured at (50)")
    p.add_argument("--wait-persistent", type=float, default=WAIT_PERSISTENT,
                   help=f"trainer wait per persistent save, s (save_latency flexckpt mean; {WAIT_PERSISTENT})")
    p.add_argument("--wait-fast", type=float, default=WAIT_FAST,
                   help=f"trainer wait a fast save adds, s (save_latency flexckpt-tier minus flexckpt mean; {WAIT_FAST})")
    p.add_argument("--fast-duration", type=float, default=FAST_DURATION,
                   help=f"a fast save's stage + write + copy, s (save_latency flexckpt-tier p50; {FAST_DURATION})")
    p.add_argument("--recovery-mib", type=float, default=256.0, help="state per rank the recoveries were measured at (256)")
    p.add_argument("--rec-fast", type=float, default=REC_FAST, help=f"recovery from the fast tier, s (bench fast_tier; {REC_FAST})")
    p.add_argument("--rec-persistent", type=float, default=REC_PERSISTENT,
                   help=f"recovery from the persistent store model at 0.2 GB/s a rank, s (bench fast_tier; {REC_PERSISTENT})")
    p.add_argument("--plot", default="", help="write a PNG of effective time against the persistent interval")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas {args.replicas}: must be at least 1 (1: no replicas)")
    if not 0 <= args.q <= 1:
        p.error(f"--q {args.q}: a fraction of failures, from 0 to 1")
    for name in ("store_gbps", "d2h_gbps", "net_gbps", "mc_cycles", "restart"):
        if getattr(args, name) <= 0 and not (name == "restart" and args.restart == 0):
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive")
    if min(args.gib) <= 0 or min(args.gpus) <= 0:
        p.error(f"--gib {args.gib} / --gpus {args.gpus}: must be positive")
    print(f"# effective training time, Llama 3 failure rate scaled (MTBF 16K = {MTBF_16K / 3600:.2f} h), restart "
          f"{args.restart:g} s ({'a failure in it starts it over' if not args.no_fail_in_restart else 'no failure in it'}), "
          f"fast tier restores {args.q:.0%} of failures, store {args.store_gbps} GB/s a GPU at 16K GPUs, "
          f"{args.replicas} replicas, persistent save cost x{args.persistent_cost:g}, inputs {args.inputs}"
          + (f" (d2h {args.d2h_gbps} GB/s, network {args.net_gbps} GB/s a GPU)" if args.inputs == "gpu" else ""))
    print("# each cell: exact / closed form / Monte Carlo (seed 0, ± 1 standard error); intervals persistent / fast")
    print("| state/GPU | GPUs | store | MTBF | persistent only (recovery) | its interval | + read once (recovery) | "
          "fast + persistent | its intervals | fast + read once | fast tier's gain: per-rank / read once |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    curves = []
    for gib in args.gib:
        for gpus in args.gpus:
            for store in args.store:
                t = tiers(gib, gpus, store, args)
                base = Job(MTBF_16K * LLAMA3_GPUS / gpus, args.restart, t["per_rank"], q=args.q,
                           fail_in_restart=not args.no_fail_in_restart)
                once = replace(base, persistent=t["read_once"])
                r = {name: evaluate(job, args.mc_cycles) for name, job in
                     (("p", base), ("p1", once), ("f", replace(base, fast=t["fast"])), ("f1", replace(once, fast=t["fast"])))}
                print(f"| {gib:g} GiB | {gpus:,} | {store} | {base.mtbf / 3600:.2f} h | {_cell(r['p'])} ({r['p']['rec_p']:.0f} s) | "
                      f"{_intervals(r['p'])} | {_cell(r['p1'])} ({r['p1']['rec_p']:.0f} s) | {_cell(r['f'])} | "
                      f"{_intervals(r['f'])} | {_cell(r['f1'])} | {100 * (r['f']['eff'] - r['p']['eff']):+.1f} / "
                      f"{100 * (r['f1']['eff'] - r['p1']['eff']):+.1f} pt |")
                if store == args.store[0] and gpus == args.gpus[-1]:
                    curves.append((gib, gpus, store, base, once, t["fast"], r["f"]["tau_f"]))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for gib, gpus, store, base, once, fast, tf in curves:
            xs = _grid(max(base.persistent.duration, 1.0), 30 * base.mtbf, 1.05)
            label = f"{gib:g} GiB, {gpus:,} GPUs, store {store}"
            line, = ax.plot(xs, [renewal(base, x) for x in xs], label=f"{label}: persistent only")
            ax.plot(xs, [renewal(once, x) for x in xs], ":", color=line.get_color(), label=f"{label}: + read once")
            ns = sorted({round(1.1**k) for k in range(int(math.log(30 * base.mtbf / tf) / math.log(1.1)) + 1)})
            ax.plot([n * tf for n in ns], [renewal(replace(base, fast=fast), n * tf, tf) for n in ns], "--",
                    color=line.get_color(),
                    label=f"{label}: + fast tier every {tf:.0f} s")
        ax.set_xscale("log")
        ax.set_xlabel("persistent checkpoint interval (s)")
        ax.set_ylabel("effective training time (exact)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
