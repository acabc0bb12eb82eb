"""The torchtitan matrix (``python3 dev.py test-torchtitan``): torchtitan 0.3.0's own trainer
on CPU/gloo (tests/helpers/torchtitan_cpu.py), 8 steps, checkpoints every 4, resumed from step 4.

1. FSDP2 at 2 ranks resumed at 2 ranks: losses of steps 5-8 equal bit for bit to the
   uninterrupted run, with DCP (torchtitan's manager and loader), with flexckpt and
   torchtitan's loader, with flexckpt and the zephon loader, and with DCP and the zephon loader.
2. The zephon loader resumed at 1 and 4 ranks: global_batch_sha256 equal at every resumed
   step to the 2-rank run; the loss moves no more than the noise floor measured here (the
   same 2-rank run with micro batches of 1 row instead of 2). torchtitan's loader cannot
   resume at 1 rank: DCP's refusal and flexckpt's are shown.
3. 2-D: (fsdp 2, tp 2) at 4 ranks, 4 steps (CPU TP is slow), checkpoint at step 2, resumed at
   (fsdp 2) on 2 ranks (the dp degree is unchanged, so torchtitan's loader state resumes too).
   DCP with torchtitan's loader is the reference: flexckpt with torchtitan's loader resumes with losses 3-4 equal to
   DCP's resume bit for bit (the same run, the same restored state), its loader bytes stored
   once per dp rank though both TP peers saved them; flexckpt with the zephon loader (TP peers
   host the same lanes and save equal cursors) gives global_batch_sha256 equal at steps 3-4
   to its uninterrupted 2-D run (and to the 2-rank run's steps 3-4), and a loss that moves no more than DCP's resume moves
   against DCP's uninterrupted 2-D run (the change of layout at step 4) or the noise floor.
4. A bad lane count or global batch fails at start, before any step.

Prints one table per part; exits 1 when a check fails.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torchtitan_cpu as tt  # noqa: E402

from flexshard.spawn import run_workers  # noqa: E402
from zephon_state import global_batch_digest  # noqa: E402

TIMEOUT = 600.0
SHORT = ("--training.steps", "4", "--checkpoint.interval", "2")  # the 2-D runs
FAILURES: list[str] = []


def check(ok: bool, what: str) -> str:
    if not ok:
        FAILURES.append(what)
    return "yes" if ok else "NO"


def runs(rank: int, world: int, plan: list[tuple[list[str], int | None]]) -> list[dict]:
    return [tt.try_run(rank, world, args, stop_after) for args, stop_after in plan]


def spawn(world: int, plan: list[tuple[list[str], int | None]]) -> list[list[dict]]:
    """Run ``plan`` in one group of ``world`` ranks; returns, per run, the ranks' results."""
    per_rank = run_workers(runs, world, plan, timeout=TIMEOUT)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(plan))]


def digests(per_rank: list[dict]) -> list[str]:
    out = []
    for i in range(len(per_rank[0]["digests"])):
        lanes = {int(k): bytes.fromhex(v) for r in per_rank for k, v in r["digests"][i].items()}
        out.append(global_batch_digest(lanes))
    return out


def table(title: str, header: list[str], rows: list[list[object]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def losses(run: list[dict], steps: range = range(3, 5)) -> str:
    got = run[0]["losses"]
    return " ".join(f"{got[s]:.6f}" if s in got else "-" for s in steps)


def two_d_rows(root: Path, full: list[list[dict]], resumed: list[list[dict]], ref_digests: list[str],
               allowed: float) -> list[list[object]]:
    """The 2-D table (part 3 of the module docstring)."""
    from flexckpt import Checkpointer

    (dcp_full, flex_full, z_full), (dcp_res, flex_res, z_res) = full, resumed
    for name, run in [("dcp 2-D", dcp_full), ("flex 2-D", flex_full), ("zephon 2-D", z_full),
                      ("dcp 2-D resume", dcp_res), ("flex 2-D resume", flex_res), ("zephon 2-D resume", z_res)]:
        if "error" in run[0]:
            check(False, f"the {name} run failed: {run[0]['error']}")
            return [[name, "error: " + run[0]["error"][:300], "", "", "", "NO", ""]]
    steps = range(3, 5)
    ok = lambda run: sorted(run[0]["losses"]) == list(steps)  # noqa: E731
    dcp, flex, z = dcp_res[0]["losses"], flex_res[0]["losses"], z_res[0]["losses"]
    layout_move = max(abs(dcp[s] - dcp_full[0]["losses"][s]) for s in steps)  # 2-D -> fsdp 2 at step 2, DCP
    rows = [["DCP + torchtitan loader (the reference)", losses(dcp_full), losses(dcp_res),
             "its uninterrupted 2-D run", f"{layout_move:.2e}", check(ok(dcp_res), "DCP 2-D resume ran 3-4"),
             "restored (dp 2 = dp 2)"]]

    with Checkpointer(str(root / "flex-2d" / "checkpoint")) as ckpt:
        contents = ckpt.contents(2).by_name()
    keyed, world = contents.keyed, contents.world_size
    once = keyed == ["dataloader/dp_rank_0", "dataloader/dp_rank_1"] and world == 4
    same = ok(flex_res) and all(flex[s] == dcp[s] for s in steps)
    rows.append(["flexckpt + torchtitan loader", losses(flex_full, range(1, 3)) + " (1-2)", losses(flex_res),
                 "DCP's resume", f"{max(abs(flex[s] - dcp[s]) for s in steps):.2e}",
                 check(same, "flexckpt + torchtitan loader 2-D resume bit-equal to DCP's"),
                 f"{len(keyed)} bytes values from {world} ranks: {', '.join(keyed)} "
                 f"({check(once, 'torchtitan loader bytes stored once per dp rank')})"])

    z_same = ok(z_res) and digests(z_res) == digests(z_full)[2:] == ref_digests[2:4]
    diff = max(abs(z[s] - z_full[0]["losses"][s]) for s in steps) if ok(z_res) else float("inf")
    bound = max(layout_move, allowed)
    rows.append(["flexckpt + zephon loader", losses(z_full), losses(z_res), "its uninterrupted 2-D run",
                 f"{diff:.2e}", check(diff <= bound, f"zephon 2-D resume loss within {bound:.2e}") +
                 f" (<= {bound:.2e})", "global_batch_sha256 3-4 equal to the 2-D and the 2-rank runs: " +
                 check(z_same, "zephon 2-D resume digests")])
    return rows


def main() -> int:
    t_start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="tt-matrix-"))
    assets = tt.make_assets(root / "assets")
    os.environ.update(TT_ASSETS=str(assets), HF_DATASETS_CACHE=str(root / "hf-cache"), HF_HUB_OFFLINE="1")

    def args(config: str, dump: str, *extra: str) -> list[str]:
        return ["--config", config, "--dump_folder", str(root / dump), "--checkpoint.enable", *extra]

    resume = ("--checkpoint.load_step", "4")
    two = spawn(2, [
        (args("dcp_default_loader", "dcp"), None),
        (args("dcp_default_loader", "dcp", *resume), None),
        (args("flex_default_loader", "flex"), None),
        (args("flex_default_loader", "flex", *resume), None),
        (args("flex_zephon", "zephon"), None),
        (args("flex_zephon", "zephon", *resume), None),
        (args("dcp_zephon", "dcp-zephon"), None),
        (args("dcp_zephon", "dcp-zephon", *resume), None),
        (args("flex_zephon", "zephon-micro1", "--training.local_batch_size", "1"), None),
        (args("flex_zephon", "bad-lanes", "--dataloader.lanes", "3"), None),
        (args("flex_zephon", "bad-batch", "--training.global_batch_size", "12", "--dataloader.global_batch_size", "12",
                                  "--dataloader.lanes", "8"), None),
    ])
    t_two = time.perf_counter()
    one = spawn(1, [
        (args("flex_zephon", "zephon", *resume), None),
        (args("dcp_default_loader", "dcp", *resume), None),
        (args("flex_default_loader", "flex", *resume), None),
    ])
    t_one = time.perf_counter()
    tp2 = ("--parallelism.tensor_parallel_degree", "2", *SHORT)
    four = spawn(4, [
        (args("flex_zephon", "zephon", *resume), None),
        (args("dcp_default_loader", "dcp-2d", *tp2), None),
        (args("flex_default_loader", "flex-2d", *tp2), 2),  # its checkpoint at step 2 is what counts
        (args("flex_zephon", "zephon-2d", *tp2), None),
    ])
    t_four = time.perf_counter()
    resume_2d = (*SHORT, "--checkpoint.load_step", "2")
    two_d = spawn(2, [
        (args("dcp_default_loader", "dcp-2d", *resume_2d), None),
        (args("flex_default_loader", "flex-2d", *resume_2d), None),
        (args("flex_zephon", "zephon-2d", *resume_2d), None),
    ])
    t_two_d = time.perf_counter()

    dcp_full, dcp_res, flex_full, flex_res, z_full, z_res, dz_full, dz_res, z_micro, bad_lanes, bad_batch = two
    for name, run in [("dcp", dcp_full), ("flex", flex_full), ("zephon", z_full), ("dcp zephon", dz_full),
                      ("zephon micro 1", z_micro)]:
        if "error" in run[0]:
            print(f"the uninterrupted {name} run failed: {run[0]['error']}")
            return 1

    rows = []
    for name, full, res in [("DCP + torchtitan loader", dcp_full, dcp_res),
                            ("flexckpt + torchtitan loader", flex_full, flex_res),
                            ("flexckpt + zephon loader", z_full, z_res),
                            ("DCP + zephon loader", dz_full, dz_res)]:
        if "error" in res[0]:
            rows.append([name, "error: " + res[0]["error"][:120], "", check(False, name)])
            continue
        a, b = full[0]["losses"], res[0]["losses"]
        same = sorted(b) == [5, 6, 7, 8] and all(a[s] == b[s] for s in b)
        rows.append([name, " ".join(f"{a[s]:.6f}" for s in range(5, 9)), " ".join(f"{b[s]:.6f}" for s in sorted(b)),
                     check(same, f"{name}: bit-exact resume at 2 ranks")])
    table("FSDP2, 2 ranks, checkpoint at step 4, resumed at 2 ranks", ["run", "losses 5-8, uninterrupted",
                                                                        "losses 5-8, resumed", "bit for bit"], rows)

    ref_losses, ref_digests = z_full[0]["losses"], digests(z_full)
    floor = max(abs(z_micro[0]["losses"][s] - ref_losses[s]) for s in range(1, 9))
    # the micro-batch floor can be 0 (CPU GEMMs sum the tokens in the same order either way);
    # the allowance is then 2 float32 ulps of the loss, as a reduction over 4 ranks reorders sums
    allowed = max(floor, 2 * float(numpy.spacing(numpy.float32(max(ref_losses.values())))))
    micro_same = digests(z_micro) == ref_digests
    rows = [["2 (micro batch 1, the noise floor)", "1-8", check(micro_same, "micro-1 digests"), f"{floor:.2e}", ""]]
    for world, run in [(1, one[0]), (4, four[0])]:
        if "error" in run[0]:
            rows.append([world, "", "error: " + run[0]["error"][:120], "", check(False, f"zephon at {world}")])
            continue
        same = digests(run) == ref_digests[4:]
        diff = max(abs(run[0]["losses"][s] - ref_losses[s]) for s in range(5, 9))
        rows.append([world, "5-8", check(same, f"zephon digests at {world} ranks"), f"{diff:.2e}",
                     check(diff <= allowed, f"zephon loss at {world} ranks within {allowed:.2e}")])
    table("zephon loader: the 2-rank run's step-4 checkpoint resumed at other degrees",
          ["ranks", "steps", "global_batch_sha256 equal", "max loss diff",
           f"within the floor (allowed {allowed:.2e})"], rows)

    rows = two_d_rows(root, four[1:], two_d, ref_digests, allowed)
    table("2-D: (fsdp 2, tp 2) at 4 ranks, 4 steps, checkpoint at step 2, resumed at (fsdp 2) on 2 ranks",
          ["run", "losses 3-4, uninterrupted 2-D", "losses 3-4, resumed at fsdp 2", "compared with", "max diff",
           "equal / within", "loader state"], rows)

    rows = []
    for name, run, want in [("DCP + torchtitan loader", one[1], "dataloader resharding is not supported"),
                            ("flexckpt + torchtitan loader", one[2], "cannot be resharded")]:
        error = run[0].get("error", "")
        rows.append([name, error[:160], check(want in error and not run[0]["losses"], f"{name} refusal at 1 rank")])
    table("torchtitan's loader resumed at 1 rank (saved at 2): refused", ["run", "error", "refused before step 1"], rows)

    rows = []
    for name, run, want in [("--dataloader.lanes 3 at dp 2", bad_lanes, "Use a lane count that is a multiple of 2"),
                            ("--training.global_batch_size 12, lanes 8", bad_batch,
                             "Use a global batch that is a multiple of 8")]:
        error = run[0].get("error", "")
        rows.append([name, error[:200], check(want in error and not run[0]["losses"], f"{name} fails at start")])
    table("start-up checks (2 ranks)", ["config", "error", "fails before step 1"], rows)

    table("wall time (s)", ["group", "seconds"], [["2 ranks, 11 runs", f"{t_two - t_start:.0f}"],
                                                   ["1 rank, 3 runs", f"{t_one - t_two:.0f}"],
                                                   ["4 ranks, 4 runs (3 of them 2-D)", f"{t_four - t_one:.0f}"],
                                                   ["2 ranks, 3 2-D resumes", f"{t_two_d - t_four:.0f}"],
                                                   ["all", f"{t_two_d - t_start:.0f}"]])
    if FAILURES:
        print("\nFAILED: " + "; ".join(FAILURES))
        return 1
    print("\nall torchtitan matrix checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
