"""flextrain: the minimal trainer of flexckpt, flexshard and zephon_state. Train, and plan a
resume at another world size.

    flextrain train [--preset tiny] [--config FILE.toml|json] [--set key=value ...] [--resume|--fresh]
    torchrun --nproc-per-node 2 -m flextrain train ...
    flextrain plan RUN_DIR --world N [--step S] [--batches K] [--json]

SIGTERM or SIGINT: a final checkpoint at the end of a step all ranks agree on, then exit 0
(during start-up: stop before the first step, nothing to save); a second signal exits at once.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from flextrain.config import ConfigError, WorldRefused, load_config


def cmd_train(args: argparse.Namespace) -> int:
    from flextrain.preempt import Preemption, StartupStopped

    preempt = Preemption()  # first: a signal during the seconds of start-up stops the run cleanly
    try:
        from flextrain.trainer import FinalSaveFailed, ResumeRefused, TrainingDiverged, run
        from zephon_state import FingerprintMismatch, ZephonError

        try:
            run_dir = [f"run_dir={args.run_dir}"] if args.run_dir else []  # last: it wins over --set run_dir
            cfg = load_config(args.preset, args.config, [*args.set, *run_dir])
            resume = True if args.resume else (False if args.fresh else None)
            run(cfg, resume=resume, preempt=preempt)
        except (WorldRefused, TrainingDiverged) as e:  # every rank finds the same (the world; gathered values): said once
            if os.environ.get("RANK", "0") == "0":
                print(f"flextrain: {e}", file=sys.stderr)
            return 2
        except StartupStopped as e:
            print(f"flextrain: {e}", file=sys.stderr)
            return 0  # as a stop in training: the run did what it was asked
        except (ConfigError, ResumeRefused, FingerprintMismatch, FinalSaveFailed) as e:  # may be one rank's own
            # (its view of the run folder, its data files, its part of the final save): each rank says its own
            print(f"flextrain: {e}", file=sys.stderr)
            return 2
        except ZephonError as e:  # the data a run reads, found wrong while building its pipelines
            print(f"flextrain: data: {e}", file=sys.stderr)
            return 2
    finally:
        preempt.restore()
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from flextrain.restore import describe, plan_restore

    try:
        plan = plan_restore(args.run_dir, args.world, step=args.step, batches=args.batches)
    except ConfigError as e:
        print(f"flextrain: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print(describe(plan))
    return 0 if plan["ok"] else 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flextrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="train (one process, or under torchrun)",
                       description="Train; resumes automatically when the run folder holds a committed checkpoint.")
    p.add_argument("--preset", default="tiny", help="tiny (13.3M parameters: tests, demo), small (29.1M) or blocks (31.5M, 87%% of them in the "
                   "transformer blocks: a 4,096-token BPE)")
    p.add_argument("--config", help="a TOML or JSON file with the sections model, data, optim and top-level keys")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set data.global_batch=32 --set steps=200 (repeatable; a table as "
                   "JSON: --set 'data.sources={\"web\": \"web.jsonl.zst\"}'; an unknown key lists the known ones)")
    p.add_argument("--run-dir", help="run folder (checkpoints in RUN_DIR/ckpt, metrics.jsonl; default "
                   "runs/flextrain); same as --set run_dir=...")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="require a checkpoint to resume from")
    g.add_argument("--fresh", action="store_true", help="start a new run: refused when the run folder holds checkpoints "
                   "or the fast tier a step (a restart would resume from them); drop both flags to resume when there are")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("plan", help="whether and how a run resumes on N ranks",
                       description="Per part of the state, what a resume on N ranks does, the bytes each rank reads "
                                   "and the memory it needs; exit 2 if N does not divide the lanes/global batch.")
    p.add_argument("run_dir", help="the run folder given to flextrain train (its checkpoints are in RUN_DIR/ckpt)")
    p.add_argument("--world", type=int, required=True, help="the number of ranks to resume on")
    p.add_argument("--step", type=int, help="a committed step (default: the newest)")
    p.add_argument("--batches", type=int, default=0, metavar="K", help="SHA-256 digests of the next K global batches")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=cmd_plan)
    args = parser.parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # here, so that a reader gone is seen here
    except BrokenPipeError:  # stdout's reader stopped early (| head): exit as flexckpt's CLI does
        from flexckpt.closed_pipe import reader_gone  # here: the commands have imported flexckpt (and torch)

        return reader_gone()
    return rc


if __name__ == "__main__":
    sys.exit(main())
