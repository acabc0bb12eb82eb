"""The seed's two data experiments with flextrain, zephon against the usual loader.

    python3 dev.py shell python experiments/resume_and_spread.py [--steps 80] [--out experiments/results]

Sizes: `tiny` (GPT-2 vocabulary 50,257, d=128, 2 layers, 4 heads, SwiGLU 384), T=64,
global batch 8 rows (512 tokens), micro batch 2, 8 lanes, shuffle buffer 64, KJV + CPython
stdlib mixed 0.7/0.3 by tokens, Muon 0.02 / AdamW 3e-3, warmup 10, cosine; one torch
thread per rank.

1. Resume at another size: D=2 for STEPS steps with a checkpoint at STEPS/2, resumed from
   it at D=1 and D=4; compared per step with the uninterrupted D=2 run. Noise floor: the
   uninterrupted run with micro batch 1 (same data, another accumulation order).
2. Spread across sizes: from scratch at D = 1, 2, 4, 8, same seed and steps; final
   held-out eval loss (8 held-out batches of 8 rows); spread = max - min.
Both with zephon and with the usual per-rank streaming loader (flextrain.usual_loader).
Writes resume.csv, spread.csv, resume.png, spread.png and prints the tables.
"""
from __future__ import annotations

import argparse
import csv
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flextrain.launch import copy_run_at as cut_at, metrics, train  # noqa: E402

SIZES = ["data.max_length=64", "data.global_batch=8", "data.micro_batch=2", "data.eval_batches=8",
         "optim.warmup_steps=10", "eval_every=1000"]
LOADERS = ("zephon", "usual")


def sets(loader: str, steps: int, *extra: str) -> list[str]:
    return SIZES + [f"data.loader={loader}", f"steps={steps}", f"ckpt_every={steps // 2}", *extra]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--work", default=str(ROOT / "runs" / "experiments"))
    args = ap.parse_args()
    out, work, steps, half = Path(args.out), Path(args.work), args.steps, args.steps // 2
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.monotonic()

    def run(world: int, name: str, loader: str, *extra: str) -> dict:
        t = time.monotonic()
        train(world, work / name, sets(loader, steps, *extra), timeout=3600)
        print(f"  {name}: D={world} {time.monotonic() - t:.0f} s", flush=True)
        return metrics(work / name)

    resume_rows, spread_rows, curves = [], [], {}
    for loader in LOADERS:
        print(f"{loader}: experiment 1", flush=True)
        ref = run(2, f"{loader}-d2", loader)
        floor = run(2, f"{loader}-d2-micro1", loader, "data.micro_batch=1")
        resumed = {}
        for world in (1, 4):
            cut_at(work / f"{loader}-d2", work / f"{loader}-resume-d{world}", half)
            resumed[world] = run(world, f"{loader}-resume-d{world}", loader)
        curves[loader] = (ref, resumed)
        for s in range(half + 1, steps + 1):
            noise = abs(floor[s]["loss"] - ref[s]["loss"])
            for world in (1, 4):
                resume_rows.append({
                    "loader": loader, "world": world, "step": s,
                    "digest_equal": resumed[world][s]["global_batch_sha256"] == ref[s]["global_batch_sha256"],
                    "loss_ref": ref[s]["loss"], "loss": resumed[world][s]["loss"],
                    "abs_loss_diff": abs(resumed[world][s]["loss"] - ref[s]["loss"]), "noise_floor": noise,
                })
        print(f"{loader}: experiment 2", flush=True)
        for world in (1, 2, 4, 8):
            rows = ref if world == 2 else run(world, f"{loader}-scratch-d{world}", loader)
            spread_rows.append({"loader": loader, "world": world, "eval_loss": rows[steps]["eval_loss"],
                                "final_train_loss": rows[steps]["loss"]})
            curves.setdefault(f"{loader}-scratch", {})[world] = rows

    with open(out / "resume.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(resume_rows[0]))
        w.writeheader()
        w.writerows(resume_rows)
    with open(out / "spread.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(spread_rows[0]))
        w.writeheader()
        w.writerows(spread_rows)
    plots(curves, out, steps, half)

    print(f"\nExperiment 1: resume at step {half} of a D=2 run, steps {half + 1}-{steps}")
    print("| loader | resumed at | digests equal | max abs loss diff | noise floor (max over steps) | bound max(1e-3, 2x floor) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for loader in LOADERS:
        for world in (1, 4):
            rs = [r for r in resume_rows if r["loader"] == loader and r["world"] == world]
            eq = sum(r["digest_equal"] for r in rs)
            mx = max(r["abs_loss_diff"] for r in rs)
            fl = max(r["noise_floor"] for r in rs)
            print(f"| {loader} | D={world} | {eq}/{len(rs)} | {mx:.2e} | {fl:.2e} | {max(1e-3, 2 * fl):.2e} |")
    print(f"\nExperiment 2: from scratch, {steps} steps, final held-out eval loss")
    print("| loader | D=1 | D=2 | D=4 | D=8 | spread |")
    print("| --- | --- | --- | --- | --- | --- |")
    spreads = {}
    for loader in LOADERS:
        ev = [r["eval_loss"] for r in spread_rows if r["loader"] == loader]
        spreads[loader] = max(ev) - min(ev)
        print(f"| {loader} | " + " | ".join(f"{e:.4f}" for e in ev) + f" | {spreads[loader]:.4f} |")
    ratio = spreads["usual"] / spreads["zephon"] if spreads["zephon"] else float("inf")
    print(f"\nspread ratio usual/zephon: {ratio:.1f}x; took {time.monotonic() - t0:.0f} s")
    return 0


def two_panels(path: Path, draw) -> None:
    """One figure, a panel per loader, ``draw(ax, loader)`` filling each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, loader in zip(axes, LOADERS):
        draw(ax, loader)
        ax.set_xlabel("step")
        ax.legend()
    axes[0].set_ylabel("training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(curves: dict, out: Path, steps: int, half: int) -> None:
    def resume(ax, loader: str) -> None:
        ref, resumed = curves[loader]
        xs, tail = list(range(1, steps + 1)), list(range(half + 1, steps + 1))
        ax.plot(xs, [ref[s]["loss"] for s in xs], label="D=2 uninterrupted", lw=1.5, color="black")
        for world, color in ((1, "tab:orange"), (4, "tab:blue")):
            ax.plot(tail, [resumed[world][s]["loss"] for s in tail], label=f"resumed at D={world}", lw=1, color=color)
        ax.axvline(half, color="grey", ls=":")
        ax.set_title(f"{loader} loader: stop at {half}, resume at D=1 / D=4")

    def spread(ax, loader: str) -> None:
        for world, rows in sorted(curves[f"{loader}-scratch"].items()):
            xs = sorted(rows)
            ax.plot(xs, [rows[s]["loss"] for s in xs], label=f"D={world} (eval {rows[steps]['eval_loss']:.3f})", lw=1)
        ax.set_title(f"{loader} loader: from scratch at D=1,2,4,8")

    two_panels(out / "resume.png", resume)
    two_panels(out / "spread.png", spread)


if __name__ == "__main__":
    sys.exit(main())
