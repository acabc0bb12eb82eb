"""Effective training time under failures: persistent checkpoints only, against the fast
tier plus persistent checkpoints, at Llama 3's failure rate scaled to 16K and 100K GPUs.

Model (per GPU; every GPU waits for the slowest): failures arrive as a Poisson process
with mean time between failures M = (54 days / 419 interruptions) x 16,384 / GPUs. Each
save costs the trainer c seconds (its wait) and a save takes d seconds to finish, so the
interval is at least d. A failure costs the restart R, the recovery time, and the work
since the last checkpoint it can restore from (half an interval on average). The fast
tier restores a fraction q of failures (one node lost, or several outside one replica
group); the others (two nodes of one replica group, a restart on new nodes) go to the
persistent step. Intervals are chosen to maximise the effective fraction (grid search);
a Monte Carlo run of 400 simulated days checks the closed form.

The costs are measured, and scaled linearly with the state per GPU:
- trainer wait per save (``c``): ``bench save_latency --libs flexckpt flexckpt-tier`` (W=2,
  50 MiB a rank, 0.6 s steps): the mean wait per persistent save (``flexckpt``), and what a
  fast save every step adds to it (``flexckpt-tier`` minus ``flexckpt``);
- a fast save's duration (``d_f``, stage + write to tmpfs + copy to the partner): the same run;
- recovery (``rec``): ``bench fast_tier`` at 256 MiB a rank, from the fast tier (a lost
  node's files fetched from its partner) and from the persistent store model;
- a persistent save's duration ``d_p``: the state over the store's bandwidth per GPU.

    python3 dev.py bench fast_tier_sim [--plot bench/fast_tier_sim.png]
"""
from __future__ import annotations

import argparse
import math
import random

DAY = 86400.0
# measured on the loaded 2-core machine (bench/RESULTS.md, issue 17): save_latency at 50 MiB
# a rank (W=2, 0.6 s steps, 100 saves, median of 3 runs: mean trainer wait 5.9 ms flexckpt,
# 11.0 ms with a fast save every step; a fast save's stage + write + copy p50 0.083 + 0.286 +
# 0.331 s) and fast_tier at 256 MiB a rank (recovery 1.515 s fast, 3.448 s persistent store model)
WAIT_PERSISTENT = 0.0059
WAIT_FAST = 0.0051
FAST_DURATION = 0.70
REC_FAST = 1.515
REC_PERSISTENT = 3.448
MTBF_16K = 54 * DAY / 419  # Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs


def effective(tau_p: float, tau_f: float | None, a: dict, mtbf: float) -> float:
    """Expected fraction of wall time spent on useful steps (first order in 1/M)."""
    lost = a["restart"]
    cost = a["c_p"] / tau_p
    if tau_f is None:
        lost += a["rec_p"] + tau_p / 2
    else:
        cost += a["c_f"] / tau_f
        lost += a["q"] * (a["rec_f"] + tau_f / 2) + (1 - a["q"]) * (a["rec_p"] + tau_p / 2)
    return max(0.0, 1 - cost - lost / mtbf)


def best(a: dict, mtbf: float, fast: bool) -> tuple[float, float, float | None]:
    grid_p = [a["d_p"] * 1.15**k for k in range(80)]
    grid_f = [a["d_f"] * 1.15**k for k in range(60)] if fast else [None]
    return max(((effective(tp, tf, a, mtbf), tp, tf) for tp in grid_p for tf in grid_f if tf is None or tf <= tp),
               key=lambda x: x[0])


def monte_carlo(tau_p: float, tau_f: float | None, a: dict, mtbf: float, days: float = 400, seed: int = 0) -> float:
    rng = random.Random(seed)
    t = useful = 0.0
    end = days * DAY
    while t < end:
        life = rng.expovariate(1 / mtbf)  # time to the next failure
        # progress at rate (1 - save costs) between failures, checkpoints at fixed intervals of progress
        rate = 1 - a["c_p"] / tau_p - (a["c_f"] / tau_f if tau_f else 0)
        done = life * rate
        fast_ok = tau_f is not None and rng.random() < a["q"]
        kept = (math.floor(done / tau_f) * tau_f) if fast_ok else (math.floor(done / tau_p) * tau_p)
        useful += kept
        t += life + a["restart"] + (a["rec_f"] if fast_ok else a["rec_p"])
    return useful / t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[0.25, 4.0], help="state per GPU, GiB (0.25 4)")
    p.add_argument("--restart", type=float, default=180.0, help="seconds to restart the job after a failure (180)")
    p.add_argument("--q", type=float, default=0.9, help="fraction of failures the fast tier restores (0.9)")
    p.add_argument("--store-gbps", type=float, default=0.12, help="persistent write GB/s per GPU (Llama 3: 2 TB/s / 16K)")
    p.add_argument("--persistent-cost", type=float, default=1.0,
                   help="multiplies the measured trainer wait of a persistent save (1: this library's async saves)")
    # measured (loaded 2-core machine; bench/RESULTS.md, issue 17)
    p.add_argument("--costs-mib", type=float, default=50.0, help="state per rank the waits and d_f were measured at (50)")
    p.add_argument("--wait-persistent", type=float, default=WAIT_PERSISTENT,
                   help=f"trainer wait per persistent save, s (save_latency flexckpt mean; {WAIT_PERSISTENT})")
    p.add_argument("--wait-fast", type=float, default=WAIT_FAST,
                   help=f"trainer wait a fast save adds, s (save_latency flexckpt-tier minus flexckpt mean; {WAIT_FAST})")
    p.add_argument("--fast-duration", type=float, default=FAST_DURATION,
                   help=f"a fast save's stage + write + copy, s (save_latency flexckpt-tier p50; {FAST_DURATION})")
    p.add_argument("--recovery-mib", type=float, default=256.0, help="state per rank the recoveries were measured at (256)")
    p.add_argument("--rec-fast", type=float, default=REC_FAST, help=f"recovery from the fast tier, s (bench fast_tier; {REC_FAST})")
    p.add_argument("--rec-persistent", type=float, default=REC_PERSISTENT,
                   help=f"recovery from the persistent store model, s (bench fast_tier; {REC_PERSISTENT})")
    p.add_argument("--plot", default="", help="write a PNG of effective time against the persistent interval")
    args = p.parse_args(argv)
    rows = []
    curves = []
    for gib in args.gib:
        kc, kr = gib * 1024 / args.costs_mib, gib * 1024 / args.recovery_mib
        a = {"c_f": args.wait_fast * kc, "d_f": args.fast_duration * kc, "rec_f": args.rec_fast * kr,
             "c_p": args.wait_persistent * kc * args.persistent_cost, "rec_p": args.rec_persistent * kr,
             "d_p": gib * (1 << 30) / (args.store_gbps * 1e9), "restart": args.restart, "q": args.q}
        for gpus in (16384, 100000):
            mtbf = MTBF_16K * 16384 / gpus
            e_p, tp_p, _ = best(a, mtbf, fast=False)
            e_f, tp_f, tf_f = best(a, mtbf, fast=True)
            mc_p = monte_carlo(tp_p, None, a, mtbf)
            mc_f = monte_carlo(tp_f, tf_f, a, mtbf)
            rows.append((gib, gpus, mtbf / 3600, e_p, tp_p, mc_p, e_f, tp_f, tf_f, mc_f))
            curves.append((gib, gpus, a, mtbf, tf_f))
    print(f"# effective training time, Llama 3 failure rate scaled (MTBF 16K = {MTBF_16K / 3600:.2f} h), restart "
          f"{args.restart:g} s, fast tier restores {args.q:.0%} of failures, store {args.store_gbps} GB/s per GPU, "
          f"persistent save cost x{args.persistent_cost:g}")
    print(f"# measured inputs: trainer wait {args.wait_persistent * 1000:.1f} ms a persistent save, +{args.wait_fast * 1000:.1f} ms "
          f"a fast save, a fast save takes {args.fast_duration:.2f} s (at {args.costs_mib:g} MiB a rank); recovery "
          f"{args.rec_fast:.2f} s fast / {args.rec_persistent:.2f} s persistent (at {args.recovery_mib:g} MiB a rank)")
    print("| state/GPU | GPUs | MTBF | persistent only: eff (MC) | its interval | fast + persistent: eff (MC) | "
          "persistent / fast interval |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gib, gpus, m, e_p, tp_p, mc_p, e_f, tp_f, tf_f, mc_f in rows:
        print(f"| {gib:g} GiB | {gpus:,} | {m:.2f} h | {e_p:.2%} ({mc_p:.2%}) | {tp_p:.0f} s | {e_f:.2%} ({mc_f:.2%}) | "
              f"{tp_f:.0f} s / {tf_f:.0f} s |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for gib, gpus, a, mtbf, tf in curves:
            xs = [a["d_p"] * 1.1**k for k in range(70)]
            ax.plot(xs, [effective(x, None, a, mtbf) for x in xs], label=f"{gib:g} GiB, {gpus:,} GPUs: persistent only")
            ax.plot(xs, [effective(x, min(tf, x), a, mtbf) for x in xs], "--",
                    label=f"{gib:g} GiB, {gpus:,} GPUs: + fast tier every {tf:.0f} s")
        ax.set_xscale("log")
        ax.set_xlabel("persistent checkpoint interval (s)")
        ax.set_ylabel("effective training time")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
