"""torchtitan 0.3.0's own trainer (CPU, gloo, 2 ranks, the 2-layer debug model of
tests/helpers/torchtitan_cpu.py) checkpointing every ``--interval`` steps with DCP ``async``, DCP
``async_with_pinned_mem`` and the flexckpt manager, in one run: median step time, the
training thread's time in the checkpointer (``save()`` + the fence before
``optimizers.step()``) per save, and the wall time of a resume at another degree (the
flexckpt run's last checkpoint, with the zephon loader, at 1 rank).

    python3 dev.py bench torchtitan_ckpt [--steps 12] [--interval 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torchtitan_cpu as tt  # noqa: E402

from flexshard.spawn import run_workers  # noqa: E402


def runs(rank: int, world: int, plan: list[list[str]]) -> list[dict]:
    return [tt.try_run(rank, world, args) for args in plan]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--interval", type=int, default=2)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tt-bench-"))
    assets = tt.make_assets(root / "assets")
    os.environ.update(TT_ASSETS=str(assets), HF_DATASETS_CACHE=str(root / "hf-cache"), HF_HUB_OFFLINE="1")
    common = ["--training.steps", str(a.steps), "--checkpoint.enable", "--checkpoint.interval", str(a.interval)]
    cases = [
        ("DCP async", ["--config", "dcp_default_loader", "--checkpoint.async_mode", "async"]),
        ("DCP async_with_pinned_mem", ["--config", "dcp_default_loader", "--checkpoint.async_mode",
                                       "async_with_pinned_mem"]),
        ("flexckpt", ["--config", "flex_default_loader"]),
        ("flexckpt + zephon loader", ["--config", "flex_zephon"]),
        ("no checkpoint", ["--config", "dcp_default_loader", "--checkpoint.interval", str(10**6),
                           "--checkpoint.load_only"]),
    ]
    plan = [[*args, "--dump_folder", str(root / f"run{i}"), *common] for i, (_, args) in enumerate(cases)]
    results = run_workers(runs, 2, plan, timeout=600)
    t = time.perf_counter()
    resumed = run_workers(runs, 1, [["--config", "flex_zephon", "--dump_folder", str(root / "run3"), *common,
                                     "--training.steps", str(a.steps + 1)]], timeout=300)
    resume_wall = time.perf_counter() - t
    print(f"\ntorchtitan 0.3.0 trainer, 2 ranks (gloo, CPU), {a.steps} steps, a checkpoint every {a.interval} "
          f"steps; per save: the training thread's time in save() plus the fence before the next "
          f"optimizers.step(), the slower rank, median over the saves before the last (torchtitan's DCP "
          f"manager writes the last one synchronously)\n")
    print("| manager | median step s | checkpointer ms per save, median | max | error |")
    print("| --- | --- | --- | --- | --- |")
    for (name, _), per_rank in zip(cases, [[r[i] for r in results] for i in range(len(cases))]):
        r = per_rank[0]
        if "error" in r:
            print(f"| {name} | | | | {r['error'][:160]} |")
            continue
        steps = sorted(s for s in r["per_save"] if s != a.steps)
        waits = [max(x["per_save"][s] for x in per_rank) * 1000 for s in steps]
        med = f"{statistics.median(waits):.1f}" if waits else "-"
        top = f"{max(waits):.1f}" if waits else "-"
        print(f"| {name} | {statistics.median(r['step_s']):.3f} | {med} | {top} | |")
    r = resumed[0][0]
    print(f"\nresume of the flexckpt + zephon run at 1 rank (saved at 2): {resume_wall:.1f} s wall for the process "
          f"group, {r.get('seconds', {}).get('build', float('nan')):.1f} s to build the trainer, "
          f"{r.get('error', 'ok')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
