"""Before/after benchmark comparison (issue 28's acceptance): the headline figures of
``save_latency`` (``--libs flexckpt`` and ``--libs flexckpt-tier``), ``restore`` and
``fast_tier``, measured against two git revisions' sources, interleaved, median of
``--rounds`` runs each, and the after/before ratio against a 5% band.

    python3 dev.py bench compare_revisions [--before 9bdb316] [--after HEAD] [--rounds 3]
        [--benches save_latency save_latency_tier restore fast_tier] [--dir PATH]

Each revision's ``src/`` is exported (``git archive REV src``) into a temporary folder,
and every run is a fresh process of *this* tree's bench code with ``PYTHONPATH`` = that
revision's ``src`` (then ``bench/``): the same bench code against both sources, so a
figure moves only because the library did (the benches use the public API, plus a few
module constants found at their path before or after the move into folders, ``harness.flexckpt_module``). The runs
take turns: in each round every bench runs once per revision, the revisions' order
flipping from round to round (before, after; after, before; ...), so a drift in the
machine's load falls on both alike. Sizes are small (a few seconds a run) so that the
whole comparison takes about ten minutes on two quiet cores: a change within the 5% band
at these sizes says there is no regression beyond noise, not what the full benches say.

9bdb316 is the last main commit before issue 28's restructuring (the merges of planner28
and seams28, then the manifest split, on main's first-parent line).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import harness as H

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEFORE = "9bdb316"  # main before issue 28 (see the module doc)
BAND = 0.05  # issue 28: after within 5% of before

# name: (bench file, its arguments, how its report is kept); "{out}" is the report's path.
# save_latency: world 2, 20 measured saves of a 20 MiB-a-rank state, 0.3 s steps;
# restore: flexckpt only, 20 MiB a rank, 3 rounds of cold + warm loads at 2 -> 2, 1, 4;
# fast_tier: 64 MiB a rank, 3 restarts of each tier.
BENCHES: dict[str, tuple[str, list[str]]] = {
    "save_latency": ("save_latency.py", ["--world", "2", "--mb-per-rank", "20", "--tensors", "60", "--saves", "20",
                                         "--runs", "1", "--step-seconds", "0.3", "--libs", "flexckpt", "--out", "{out}.md"]),
    "save_latency_tier": ("save_latency.py", ["--world", "2", "--mb-per-rank", "20", "--tensors", "60", "--saves", "20",
                                              "--runs", "1", "--step-seconds", "0.3", "--libs", "flexckpt-tier",
                                              "--out", "{out}.md"]),
    "restore": ("restore.py", ["--libs", "flexckpt", "--mb-per-rank", "20", "--tensors", "60", "--runs", "1",
                               "--loads", "3", "--out", "{out}.md"]),
    "fast_tier": ("fast_tier.py", ["--mib", "64", "--tensors", "12", "--saves", "2", "--repeat", "3",
                                   "--json", "{out}.json"]),
}


def headline(bench: str, report: dict) -> dict[str, float]:
    """The figures compared, from a bench's JSON report (seconds)."""
    if bench.startswith("save_latency"):
        lib = "flexckpt-tier" if bench.endswith("tier") else "flexckpt"
        (world,) = report["results"].values()
        runs = world["runs"][lib]
        return {f"{lib} save stall p50 s": H.median(r["p50"] for r in runs),
                f"{lib} save stall p99 s": H.median(r["p99"] for r in runs)}
    if bench == "restore":
        return {k: v for k, v in report["headline"].items() if k.startswith("restore 2->")}
    if bench == "fast_tier":
        return {k: report["headline"][k] for k in ("fast recovery s", "persistent recovery s")}
    raise ValueError(f"unknown bench {bench!r}; expected one of {', '.join(BENCHES)}")


def comparison_rows(before: dict[str, dict[str, list[float]]], after: dict[str, dict[str, list[float]]],
                    band: float = BAND) -> list[list[str]]:
    """bench, metric, before median, after median, after/before, within the band? (a
    figure larger by more than ``band`` is a regression; smaller is fine)."""
    rows = []
    for bench, metrics in before.items():
        for metric, values in metrics.items():
            b, a = H.median(values), H.median(after[bench][metric])
            ratio = a / b if b else float("nan")
            rows.append([bench, metric, f"{b * 1e3:.1f} ms", f"{a * 1e3:.1f} ms", f"{ratio:.3f}",
                         "yes" if ratio <= 1 + band else "**no**"])
    return rows


def order(rounds: int, revisions: tuple[str, str]) -> list[tuple[int, str]]:
    """(round, revision) in run order: before, after; after, before; ... per bench."""
    return [(r, rev) for r in range(rounds) for rev in (revisions if r % 2 == 0 else revisions[::-1])]


def export(rev: str, root: str) -> str:
    """``git archive REV src`` into ``root/REV``: that revision's sources, whatever the
    working tree holds; its ``src`` folder."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", rev + "^{commit}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = os.path.join(root, sha[:12])
    if not os.path.isdir(os.path.join(dest, "src")):
        os.makedirs(dest, exist_ok=True)
        tar = subprocess.run(["git", "-C", REPO, "archive", sha, "src"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=tar, check=True)
    return os.path.join(dest, "src")


def run_bench(bench: str, src: str, out: str, timeout: float) -> dict[str, float]:
    """One run of ``bench`` (this tree's bench code) against the sources in ``src``."""
    script, args = BENCHES[bench]
    cmd = [sys.executable, os.path.join(HERE, script), *(a.replace("{out}", out) for a in args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, HERE]))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"{bench} against {src} failed (exit {done.returncode}):\n" + "\n".join(tail))
    with open(out + ".json") as f:
        return headline(bench, json.load(f))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=BEFORE, help=f"git revision before (default {BEFORE}: main before issue 28)")
    p.add_argument("--after", default="HEAD", help="git revision after (default HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each bench per revision, interleaved (default 3)")
    p.add_argument("--benches", nargs="+", choices=list(BENCHES), default=list(BENCHES), help="benches (default: all)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    p.add_argument("--dir", default=None, help="folder for the exports and reports (default: a temporary one, removed after)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be at least 1")
    root = args.dir or tempfile.mkdtemp(prefix="flexckpt-compare-")
    t_start = time.monotonic()
    got: dict[str, dict[str, dict[str, list[float]]]] = {"before": {}, "after": {}}
    try:
        srcs = {"before": export(args.before, root), "after": export(args.after, root)}
        for bench in args.benches:
            for rnd, which in order(args.rounds, ("before", "after")):
                t0 = time.monotonic()
                out = os.path.join(root, f"{bench}-{which}-{rnd}")
                figures = run_bench(bench, srcs[which], out, args.timeout)
                for metric, value in figures.items():
                    got[which].setdefault(bench, {}).setdefault(metric, []).append(value)
                print(f"{bench} {which} round {rnd + 1}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in figures.items())
                      + f" ({time.monotonic() - t0:.0f} s; {H.load_line()})", file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = comparison_rows(got["before"], got["after"])
    print(f"## Before ({args.before}) / after ({args.after}): medians of {args.rounds} interleaved runs each "
          f"({(time.monotonic() - t_start) / 60:.1f} min; {H.load_line()})\n")
    print(H.markdown_table(["bench", "metric", "before median", "after median", "after/before", f"within {BAND:.0%}?"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
