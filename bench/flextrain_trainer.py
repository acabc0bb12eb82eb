"""flextrain in the loop: checkpoint wait and goodput, data wait, restart breakdown,
Owned-Muon vs FSDP optimizer time, and zephon's restore cost against lanes per rank.

    python3 dev.py bench flextrain_trainer [--steps 60] [--parts ckpt,restart,optim,lanes]
    python3 dev.py bench flextrain_trainer --parts optim --preset small --worlds 4 --reps 3 --steps 40
    python3 dev.py bench flextrain_trainer --parts optim --preset blocks --reps 2 --steps 16   # issue 30
    python3 dev.py bench flextrain_trainer --parts stepcost --runs 3 --steps 62

Sizes: `tiny` (GPT-2 vocabulary, d=128, 2 layers), T=128, global batch 8, micro batch 2,
one torch thread per rank, checkpoints to a local folder. Each part prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flextrain.launch import metrics, train  # noqa: E402

OPTIM = {"preset": "tiny", "worlds": (2, 4), "reps": 1, "library_runs": 5}  # the optim part's settings (--preset, ...)
STEPCOST = {"runs": 3}  # the stepcost part's runs (--runs)
SIZES = ["data.max_length=128", "data.global_batch=8", "data.micro_batch=2", "eval_every=100000"]


def p(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def memcpy_seconds(nbytes: int, repeat: int = 20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rank_state_bytes(run: Path) -> int:
    from flexckpt import read_manifest
    from flexckpt import Storage
    from flexckpt.state.dtypes import itemsize

    storage = Storage(str(run / "ckpt"))
    from flexckpt import committed_steps
    m = read_manifest(storage, committed_steps(storage)[-1])
    per_rank = [0] * m.world_size
    for t in m.tensors.values():
        for r in range(m.world_size):
            per_rank[r] += len(t.layout.flat_range(t.shape, m.world_size, r)) * itemsize(t.dtype)
    return max(per_rank)


def part_ckpt(work: Path, steps: int) -> None:
    print(f"\n## Checkpoint wait and goodput (D=2, {steps} steps, checkpoint every 10 vs none)", flush=True)
    res = {}
    for label, every in (("on", 10), ("off", steps)):
        run = work / f"ckpt-{label}"
        train(2, run, SIZES + [f"steps={steps}", f"ckpt_every={every}"])
        rows = metrics(run)
        body = [rows[s] for s in sorted(rows) if 2 < s < steps]  # skip warm-up steps and the final save
        res[label] = {
            "step_med": statistics.median(r["step_s"] for r in body),
            "step_mean": statistics.mean(r["step_s"] for r in body),
            "waits": [r["ckpt_wait_s"] for r in body if r["ckpt_wait_s"] > 0],
            "data": [rows[s]["data_wait_s"] for s in sorted(rows) if s > 1],
            "goodput": json.loads((run / "summary-w2-r0.json").read_text())["goodput"],
        }
    nbytes = rank_state_bytes(work / "ckpt-on")
    copy = memcpy_seconds(nbytes)
    on, off = res["on"], res["off"]
    w = on["waits"]
    print("| checkpoints | step median | step mean | saves | wait p50 | wait p99 | one memcpy of the rank's state | goodput |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label in ("off", "on"):
        r = res[label]
        ws = r["waits"]
        print(f"| {label} | {r['step_med'] * 1e3:.0f} ms | {r['step_mean'] * 1e3:.0f} ms | {len(ws)} | "
              + (f"{p(ws, 50) * 1e3:.2f} ms | {p(ws, 99) * 1e3:.2f} ms" if ws else "- | -")
              + f" | {copy * 1e3:.2f} ms ({nbytes / 2**20:.0f} MiB) | {r['goodput']:.1%} |")
    print(f"step time with checkpoints / without (mean, two runs: the load's drift between them lands here; "
          f"--parts stepcost measures it inside one run): {on['step_mean'] / off['step_mean']:.3f}; "
          f"p99 wait / memcpy: {p(w, 99) / copy:.2f}")
    d = on["data"] + off["data"]
    print(f"data wait per step after step 1: p50 {p(d, 50) * 1e3:.3f} ms, p99 {p(d, 99) * 1e3:.3f} ms, "
          f"max {max(d) * 1e3:.3f} ms ({len(d)} steps)")


def step_classes(rows: dict[int, dict], every: int, last: int) -> dict[str, list[float]]:
    """Step times (``step_s``) of one run with a checkpoint every ``every`` steps, by kind:
    ``save`` (the step that calls save(): the weights check, the state dict, save()),
    ``after`` (the next one: the fence, and the background write running beside it) and
    ``other``; over whole periods only, from step ``every + 2`` to ``last`` (the warm-up
    with the first save, and the final step's save and evaluation, left out)."""
    out: dict[str, list[float]] = {"save": [], "after": [], "other": [], "work": [], "fence": []}
    for s in range(every + 2, last + 1):
        kind = "save" if s % every == 0 else "after" if s % every == 1 else "other"
        out[kind].append(rows[s]["step_s"])
        if kind == "save":
            out["work"].append(rows[s]["save_s"])
        elif kind == "after":
            out["fence"].append(rows[s]["ckpt_wait_s"])
    return out


def part_stepcost(work: Path, steps: int) -> None:
    every, runs = 10, STEPCOST["runs"]
    last = every * ((steps - 2) // every) + 1  # the window ends after a whole period, before the final step
    if last < 2 * every + 1:
        raise SystemExit(f"--parts stepcost needs --steps >= {2 * every + 2} (two whole periods), got {steps}")
    print(f"\n## Step cost of a checkpoint every {every} steps, inside one run (D=2, {runs} run(s) of {steps} steps; "
          f"steps {every + 2}-{last}: {(last - every - 1) // every} whole periods of one save step, the step after it and "
          f"{every - 2} others; rank 0's step_s)", flush=True)
    print("cost = (mean of all steps) / (mean of the other steps) - 1; the same by the median. 'save work' is the "
          "training thread's own part (save_s: weights check, state, save(); the fence: ckpt_wait_s of the step after), "
          "p50, and its share of all step time (the cost without the background write's contention)")
    print("| run | load (1 min) | save step mean | after mean | other mean | other p50 / p99 | all mean | all p50 / p99 "
          "| cost by mean | cost by p50 | save work / fence p50 | their share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    pooled: dict[str, list[float]] = {"save": [], "after": [], "other": [], "work": [], "fence": []}
    costs = []

    def line(label: str, load: str, c: dict[str, list[float]]) -> float:
        every_step = c["save"] + c["after"] + c["other"]
        cost = statistics.mean(every_step) / statistics.mean(c["other"]) - 1
        ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
        print(f"| {label} | {load} | {ms(statistics.mean(c['save']))} ms | {ms(statistics.mean(c['after']))} ms | "
              f"{ms(statistics.mean(c['other']))} ms | {ms(p(c['other'], 50))} / {ms(p(c['other'], 99))} ms | "
              f"{ms(statistics.mean(every_step))} ms | {ms(p(every_step, 50))} / {ms(p(every_step, 99))} ms | "
              f"{cost:+.1%} | {p(every_step, 50) / p(c['other'], 50) - 1:+.1%} | "
              f"{p(c['work'], 50) * 1e3:.1f} / {p(c['fence'], 50) * 1e3:.1f} ms | "
              f"{(sum(c['work']) + sum(c['fence'])) / sum(every_step):.2%} |", flush=True)
        return cost

    for i in range(runs):
        run = work / f"stepcost-{i}"
        before = os.getloadavg()[0]
        train(2, run, SIZES + [f"steps={steps}", f"ckpt_every={every}"])
        c = step_classes(metrics(run), every, last)
        for k in pooled:
            pooled[k] += c[k]
        costs.append(line(str(i + 1), f"{before:.1f} - {os.getloadavg()[0]:.1f}", c))
    if runs > 1:
        line("all runs", "", pooled)
        print(f"cost by mean, run by run: {', '.join(f'{c:+.1%}' for c in costs)}; median {statistics.median(costs):+.1%}")


def part_restart(work: Path, steps: int) -> None:
    print("\n## Restart at D=4 from a D=2 checkpoint (seconds, rank 0; 3 restarts, median)", flush=True)
    base = work / "restart-base"
    train(2, base, SIZES + [f"steps={steps // 2}", f"ckpt_every={steps // 2}"])
    parts = {"process_start_s": [], "model_build_s": [], "pipeline_build_s": [], "checkpoint_load_s": [],
             "first_batch_s": []}
    totals = []
    for i in range(3):
        run = work / f"restart-{i}"
        shutil.copytree(base, run)
        os.environ["FLEXTRAIN_LAUNCH_TIME"] = repr(time.time())
        train(4, run, SIZES + [f"steps={steps // 2 + 1}", f"ckpt_every={steps}"])
        os.environ.pop("FLEXTRAIN_LAUNCH_TIME")
        t = json.loads((run / "summary-w4-r0.json").read_text())["timings"]
        for k in parts:
            parts[k].append(t[k])
        totals.append(sum(t[k] for k in parts))
    med = {k: statistics.median(v) for k, v in parts.items()}
    total = sum(med.values())
    print("| part | seconds | share |")
    print("| --- | --- | --- |")
    for k, v in med.items():
        print(f"| {k.removesuffix('_s').replace('_', ' ')} | {v:.2f} | {v / total:.1%} |")
    print(f"| total (to the first batch) | {total:.2f} | 100% |")
    pipe = med["pipeline_build_s"] + med["first_batch_s"]
    print(f"the pipeline's part (build + restore to the first batch): {pipe:.2f} s, {pipe / total:.1%} of the restart")


def part_optim(work: Path, steps: int) -> None:
    from flexshard_optimizer import PHASES, preset_phase  # this folder's library benchmark

    preset, worlds, reps, lib_runs = OPTIM["preset"], OPTIM["worlds"], OPTIM["reps"], OPTIM["library_runs"]
    print(f"\n## Optimizer time in the trainer (reduce + step + gather per step), Owned Muon vs --placement fsdp, "
          f"preset {preset}, {reps} run(s) of {steps // 2} steps per placement, interleaved; steps 1-2 of each run "
          f"left out; rank 0. Beside it, at the same D right after: the library (flexshard_optimizer "
          f"--flextrain-preset {preset}: the same parameters, the same Muon/AdamW split, random gradients), "
          f"{lib_runs} runs (+1 warm-up) per placement, interleaved", flush=True)
    print("| D | measured in | placement | steps/runs | optim p50 | optim p99 | optim mean | reduce p50 | update p50 | "
          "gather p50 | sync p50 | step p50 | owned saves (p50) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    cuts = []
    for world in worlds:
        rows: dict[str, list[dict]] = {"owned": [], "fsdp": []}
        loads = []
        for rep in range(reps):
            for placement in (("owned", "fsdp") if rep % 2 == 0 else ("fsdp", "owned")):
                run = work / f"optim-{preset}-{placement}-d{world}-{rep}"
                loads.append(os.getloadavg()[0])
                train(world, run, SIZES + [f"steps={steps // 2}", f"ckpt_every={steps}", f"optim.placement={placement}"],
                      preset=preset)
                got = metrics(run)
                rows[placement] += [got[s] for s in sorted(got) if s > 2]
        loads.append(os.getloadavg()[0])
        p50 = {}
        for placement, body in rows.items():
            opt = [r["optim_s"] for r in body]
            p50[placement] = statistics.median(opt)
            ph = {k: statistics.median(r.get(f"optim_{k}_s", float("nan")) for r in body) for k in PHASES}
            ph["sync"] = statistics.median(r["sync_s"] for r in body)
            saves = f"{1 - p50['owned'] / p50['fsdp']:.1%}" if placement == "fsdp" else ""
            print(f"| {world} | trainer | {placement} | {len(opt)} | {p50[placement] * 1e3:.1f} ms | {p(opt, 99) * 1e3:.1f} ms | "
                  f"{statistics.mean(opt) * 1e3:.1f} ms | {ph['reduce'] * 1e3:.1f} ms | {ph['update'] * 1e3:.1f} ms | "
                  f"{ph['gather'] * 1e3:.1f} ms | {ph['sync'] * 1e3:.1f} ms | {statistics.median(r['step_s'] for r in body) * 1e3:.0f} ms | {saves} |",
                  flush=True)
        lib = preset_phase(world, preset, lib_runs)
        loads.append(os.getloadavg()[0])
        for placement, med in lib.items():
            saves = f"{1 - lib['owned']['optim'] / med['optim']:.1%}" if placement == "fsdp" else ""
            print(f"| {world} | library | {placement} | {lib_runs} | {med['optim'] * 1e3:.1f} ms | - | - | "
                  + " | ".join(f"{med[k] * 1e3:.1f} ms" for k in PHASES) + f" | - | - | {saves} |", flush=True)
        cuts.append((world, 1 - p50["owned"] / p50["fsdp"], 1 - lib["owned"]["optim"] / lib["fsdp"]["optim"]))
        print(f"load average (1 min) at the start of each trainer run, after them and after the library's, D={world}: "
              + ", ".join(f"{x:.1f}" for x in loads), flush=True)
    print("\n| D | cut in the trainer | cut in the library | trainer / library | goal (issue 30: D=4) |")
    print("| --- | --- | --- | --- | --- |")
    for world, trainer_cut, library_cut in cuts:
        goal = ">= 0.85" if world == 4 else "-"
        print(f"| {world} | {trainer_cut:.1%} | {library_cut:.1%} | {trainer_cut / library_cut:.2f} | {goal} |", flush=True)


def part_lanes(work: Path, steps: int) -> None:
    from flextrain.config import DataConfig
    from flextrain.data import build_pipeline

    print("\n## zephon restore cost against lanes per rank (one rank, one tokenizer thread, T=128, one row per lane "
          "per step, stopped half-way through a shuffle window)", flush=True)
    print("A restore re-tokenizes and re-packs each hosted lane's current window (buffer rows) and skips the rows "
          "consumed; 'steady' is the pipeline's own rate over four windows after its first batch (its readahead holds one).")
    print("'tokenized' counts the tokens the restore's tokenizer calls produced (exact, unlike the times on a shared machine); "
          "'CPU' is the same ratio over the process's CPU seconds (all its threads) instead of wall seconds, less "
          "sensitive to other load.")
    print("| L/D | buffer | restore to first batch | window tokens replayed | tokenized | replay tokens/s | steady tokens/s "
          "| replay/steady | replay/steady, CPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    from zephon_state.tokenize import LoadedTokenizer

    encode, tokenized = LoadedTokenizer.encode, [0]

    def counting(self, *args):
        flat, lengths = encode(self, *args)
        tokenized[0] += len(flat)
        return flat, lengths

    for buffer in (64, 256):
        for lanes in (1, 4, 16, 64):
            d = DataConfig(max_length=128, shuffle_buffer=buffer, lanes=lanes, global_batch=lanes, micro_batch=lanes)
            window_tokens = lanes * buffer * d.max_length
            with build_pipeline(d, 0, 0, 1) as pipe:
                next(pipe)
                t, cpu = time.perf_counter(), time.process_time()
                for _ in range(4 * buffer):  # four windows per lane: past what the readahead had ready
                    next(pipe)
                steady = 4 * window_tokens / (time.perf_counter() - t)
                steady_cpu = 4 * window_tokens / (time.process_time() - cpu)
                for _ in range(buffer // 2):
                    next(pipe)
                state = pipe.state_dict()
            with build_pipeline(d, 0, 0, 1) as fresh:
                fresh.calibration()  # sources loaded and calibrated, as at any start
                LoadedTokenizer.encode, tokenized[0] = counting, 0
                t, cpu = time.perf_counter(), time.process_time()
                fresh.load_state_dict(state)
                next(fresh)
                restore_s, replayed = time.perf_counter() - t, tokenized[0]
                replay_cpu = window_tokens / (time.process_time() - cpu)
                LoadedTokenizer.encode = encode
            rate = window_tokens / restore_s
            print(f"| {lanes} | {buffer} | {restore_s:.2f} s | {window_tokens:,} | {replayed:,} | {rate:,.0f} | "
                  f"{steady:,.0f} | {rate / steady:.2f} | {replay_cpu / steady_cpu:.2f} |", flush=True)


def part_mxfp8(work: Path, steps: int) -> None:
    print(f"\n## MXFP8 weight gather (compute on dequantized BlockShard/Owned weights) vs full precision, D=2, "
          f"{steps} steps", flush=True)
    out = {}
    for copy in ("full", "mxfp8"):
        run = work / "ckpt-off" if copy == "full" and (work / "ckpt-off").exists() else work / f"mx-{copy}"
        if not run.exists():
            train(2, run, SIZES + [f"steps={steps}", f"ckpt_every={steps}", f"optim.compute_copy={copy}"])
        rows = metrics(run)
        tail = [rows[s]["loss"] for s in sorted(rows)[-10:]]
        out[copy] = (rows[1]["loss"], statistics.mean(tail), rows[steps]["eval_loss"])
    print("| weights gathered as | loss at step 1 | mean loss, last 10 steps | held-out eval loss |")
    print("| --- | --- | --- | --- |")
    for copy, (first, last, ev) in out.items():
        print(f"| {copy} | {first:.4f} | {last:.4f} | {ev:.4f} |")
    print(f"eval loss difference mxfp8 - full: {out['mxfp8'][2] - out['full'][2]:+.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--parts", default="ckpt,mxfp8,restart,optim,lanes")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_trainer"))
    ap.add_argument("--preset", default="tiny", help="model preset of the optim part (tiny, small, blocks)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="D of the optim part")
    ap.add_argument("--reps", type=int, default=1, help="runs per placement in the optim part, interleaved")
    ap.add_argument("--runs", type=int, default=3, help="runs of the stepcost part")
    ap.add_argument("--library-runs", type=int, default=5, help="runs per placement of the library beside the optim part")
    args = ap.parse_args()
    OPTIM.update(preset=args.preset, worlds=tuple(args.worlds), reps=args.reps, library_runs=args.library_runs)
    STEPCOST.update(runs=args.runs)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)
    for part in args.parts.split(","):
        {"ckpt": part_ckpt, "stepcost": part_stepcost, "mxfp8": part_mxfp8, "restart": part_restart, "optim": part_optim,
         "lanes": part_lanes}[part](work, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
