"""The demo: a real training run that stops and resumes at other world sizes.

    python3 dev.py demo [--dir runs/demo] [--steps 40] [--preset tiny]

1. trains `tiny` (GPT-2 vocabulary, d=128, 2 layers; here T=128 and a global batch of 8
   rows so that it runs in minutes on 2 cores; or another preset: `--preset blocks`, a
   model that is mostly matrices) at D=2 to the end: the reference;
2. starts the same run again and stops it with SIGTERM part-way: it checkpoints at the
   end of the agreed step and exits;
3. asks ``flextrain plan`` how the run resumes on 1 and on 4 ranks;
4. resumes it on 1 rank and on 4 ranks (copies of the run folder) to the end;
5. prints, per step after the stop, whether the global batch digests equal the
   reference's and |loss difference|, and writes a plot of the loss curves.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flextrain.config import PRESETS
from flextrain.launch import env, metrics, train, train_until_signal

SIZES = ["data.max_length=128", "data.global_batch=8", "data.micro_batch=2", "optim.warmup_steps=5"]
WRITES = {"reference", "run", "resume-d1", "resume-d4", "loss.png"}  # all --dir may hold: it is emptied first


def plot(curves: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        steps = sorted(rows)
        ax.plot(steps, [rows[s]["loss"] for s in steps], label=label, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 dev.py demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="runs/demo",
                    help="the run folders and the plot (emptied first: a new folder or an earlier demo's; "
                         "default runs/demo)")
    ap.add_argument("--steps", type=int, default=40, help="steps of each run, >= 4 (default 40; stopped at half)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="the model and data preset (default tiny)")
    args = ap.parse_args(argv)
    if args.steps < 4:  # a checkpoint every steps // 4
        ap.error(f"--steps {args.steps}: must be >= 4")
    root = Path(args.dir).resolve()
    others = sorted(p.name for p in root.iterdir() if p.name not in WRITES) if root.is_dir() else []
    if others or (root.exists() and not root.is_dir()):
        print(f"demo: --dir {root} holds {others[:3] or 'a file'}, not only an earlier demo's folders, and the "
              f"demo empties it first; pass a new folder", file=sys.stderr)
        return 2
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sets = SIZES + [f"steps={args.steps}", f"ckpt_every={args.steps // 4}", f"eval_every={args.steps // 2}"]
    t0 = time.monotonic()

    print(f"[1/5] reference: {args.preset} at D=2, {args.steps} steps ({', '.join(SIZES)})", flush=True)
    train(2, root / "reference", sets, preset=args.preset)
    print(f"[2/5] the same run, stopped with SIGTERM after step {args.steps // 2}", flush=True)
    rc = train_until_signal(2, root / "run", sets, after_steps=args.steps // 2, preset=args.preset)
    stopped = max(metrics(root / "run"))
    print(f"      torchrun exited {rc} (its own answer to SIGTERM; the workers exited 0); "
          f"final checkpoint at step {stopped}", flush=True)
    for world in (1, 4):
        shutil.copytree(root / "run", root / f"resume-d{world}")
    print("[3/5] flextrain plan for D=1 and D=4", flush=True)
    for world in (1, 4):
        out = subprocess.run([sys.executable, "-m", "flextrain", "plan", str(root / "run"), "--world", str(world),
                              "--batches", "2"], env=env(), capture_output=True, text=True, timeout=300)
        print("      " + out.stdout.replace("\n", "\n      "), flush=True)
    print("[4/5] resume on 1 rank and on 4 ranks", flush=True)
    for world in (1, 4):
        train(world, root / f"resume-d{world}", sets, preset=args.preset)

    ref = metrics(root / "reference")
    runs = {w: metrics(root / f"resume-d{w}") for w in (1, 4)}
    print(f"[5/5] steps after the stop (reference: D=2 uninterrupted)")
    print(f"  {'step':>5}  {'ref loss':>9}  {'D=1 batch':>9}  {'|diff|':>9}  {'D=4 batch':>9}  {'|diff|':>9}")
    worst = 0.0
    all_equal = True
    for s in range(stopped + 1, args.steps + 1):
        cells = []
        for w in (1, 4):
            same = runs[w][s]["global_batch_sha256"] == ref[s]["global_batch_sha256"]
            diff = abs(runs[w][s]["loss"] - ref[s]["loss"])
            all_equal &= same
            worst = max(worst, diff)
            cells += [("equal" if same else "DIFFERS"), f"{diff:.2e}"]
        print(f"  {s:>5}  {ref[s]['loss']:>9.4f}  {cells[0]:>9}  {cells[1]:>9}  {cells[2]:>9}  {cells[3]:>9}")
    png = root / "loss.png"
    plot({"D=2 uninterrupted": ref, "D=2 then D=1": runs[1], "D=2 then D=4": runs[4]}, png,
         f"{args.preset}: stopped at step {stopped}, resumed at D=1 and D=4")
    print(f"batches equal at every step: {'yes' if all_equal else 'NO'}; largest |loss diff| {worst:.2e}")
    print(f"run folders: {root}; plot: {png}; took {time.monotonic() - t0:.0f} s")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
