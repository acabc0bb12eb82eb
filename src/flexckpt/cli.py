"""flexckpt: look at, check and rewrite checkpoints without a training job.

    flexckpt steps   URL                          committed steps
    flexckpt inspect URL [--step N] [--tensors]   what a checkpoint holds
    flexckpt verify  URL [--step N | --all]       read every chunk and check its checksum
    flexckpt plan    URL --world N [--mesh M] [--layout P=K]
                                                  what each rank of another world would read
    flexckpt reshard SRC DST --world N [--mesh M] [--layout P=K]
                                                  rewrite a checkpoint for another world size
    flexckpt import-dcp DCP_DIR URL [--step N] [--world N [--mesh M] [--layout P=K]]
                                                  a torch.distributed.checkpoint folder as a checkpoint
    flexckpt export-dcp URL DCP_DIR [--step N]    a checkpoint as a torch.distributed.checkpoint folder
    flexckpt export-safetensors URL OUT_DIR [--select GLOB] [--strip-prefix P] [--dtype bf16|fp16|fp32]
        [--max-shard-size 5GB]                    consolidated weights, Hugging Face layout

S3 and other object stores: s3://bucket/prefix, with the standard AWS_* variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...), or fsspec options as JSON
in --storage-options (every command) or FLEXCKPT_STORAGE_OPTIONS.

Layout kinds for --layout (glob PATTERN=KIND, repeatable): replicate, shard, owned,
block[:SIZE], hybrid:GROUP[:BLOCK]; by default each tensor keeps its saved kind (Owned tensors get owners
balanced for the new world).

Tensor parallelism and 2-D/3-D meshes: --mesh NAME=SIZE,... (or SIZE,...) gives the target
mesh, row-major over ranks 0..N-1 (the sizes multiply to --world), and a KIND of one placement
per mesh dim, comma-separated, lays a tensor out on it: R (replicate), S<d> (shard dim d),
SS<d>:<sf> (_StridedShard(d, sf): what FSDP2 puts before a TP Shard(d)). For example
    flexckpt plan URL --world 4 --mesh fsdp=2,tp=2 --layout 'model/*wo*=S0,S1' --layout 'model/*wq*=SS0:2,S0'
A tensor saved on a mesh keeps its placements on --mesh (or on its saved mesh at its saved world size).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections import Counter
from typing import Any, Callable, Iterator, NoReturn

from flexckpt.catalog import committed_steps, read_manifest
from flexckpt.closed_pipe import reader_gone
from flexckpt.convert.cli import add_parsers as add_convert_parsers
from flexckpt.convert.reshard import checked_layouts, cmd_reshard, no_checkpoint, parse_mesh, pick_step, read_step
from flexckpt.errors import CheckpointError
from flexckpt.format.checksum import checksum
from flexckpt.format.codec import Compression, decompress_into, parse_compression
from flexckpt.format.manifest import MAX_WORLD, Manifest
from flexckpt.format.names import step_dir
from flexckpt.load.pending import read_bytes_values
from flexckpt.restore_plan import restore_plan
from flexckpt.state.dtypes import dtype_name
from flexckpt.state.structure import decode_plain
from flexckpt.state.tree import name_path, walk_tree
from flexckpt.storage import Storage, parse_storage_options, using_storage_options
from flexshard.world import ranks


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def cmd_steps(args: argparse.Namespace) -> int:
    storage = Storage(args.url)
    steps = committed_steps(storage)
    if not steps:
        raise no_checkpoint(storage)
    bad = 0
    for s in steps:
        try:
            m = read_manifest(storage, s)
        except (OSError, CheckpointError) as e:  # one damaged step does not hide the others
            print(f"{s:>12}  DAMAGED: {e}")
            bad += 1
            continue
        print(f"{s:>12}  world {m.world_size:<4} {_mib(m.total_bytes):>14}  {len(m.tensors):>6} tensors  "
              f"{_when(m.time)}  run {m.run_id}")
    return 1 if bad else 0


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = Storage(args.url)
    m = read_step(storage, pick_step(storage, args.step), args.step is None)
    kinds = Counter(type(t.layout).__name__ for t in m.tensors.values())
    print(f"step {m.step} of run {m.run_id}, saved by {ranks(m.world_size)} at "
          f"{_when(m.time)} (format version {m.version})")
    if m.version == 1:
        codecs = Counter(c.codec for f in m.files.values() for c in f.chunks)
        print(f"  {len(m.tensors)} tensors, {_mib(m.total_bytes)} raw, {_mib(m.stored_bytes)} stored "
              f"in {_count(len(m.files), 'file')}, {sum(len(f.chunks) for f in m.files.values())} chunks {dict(codecs)}")
    else:  # chunk counts would need every rank's table: not read here
        print(f"  {len(m.tensors)} tensors, {_mib(m.total_bytes)} raw, {_mib(m.stored_bytes)} stored "
              f"in {_count(len(m.files), 'file')} ({m.codec}), save attempt {m.attempt}")
    print(f"  layouts: {dict(kinds)}")
    if m.version == 1:
        for name, f in sorted(m.files.items()):
            print(f"  file {name}: {_mib(f.nbytes)} in {len(f.chunks)} chunks")
    else:
        for r, e in enumerate(m.ranks[:64]):
            if e.stored_nbytes:
                print(f"  file {m.attempt}/r{r:05d}.data: {_mib(e.stored_nbytes)} stored")
    key = _key_paths(m)
    if m.plain:
        print("  plain values:")
        for k, v in sorted(m.plain.items()):
            try:
                shown = json.dumps(decode_plain(v), default=str)[:100]
            except (ValueError, RecursionError) as e:
                shown = f"MALFORMED ({str(e)[:80]})"
            print(f"    {key(k)} = {shown}")
    for k, lanes in sorted(m.lanes.items()):
        print(f"  per-lane {key(k)}: {len(lanes)} lanes ({', '.join(sorted(lanes, key=_lane_key)[:8])}{' ...' if len(lanes) > 8 else ''})")
    for k in sorted(m.per_rank):
        print(f"  per-rank {key(k)}: {m.world_size} values (restored only at world size {m.world_size})")
    for k, (_offset, length, _check) in sorted(m.keyed.items()):
        print(f"  bytes {key(k)}: {length} bytes (addressed by key)")
    if args.tensors:
        print(f"  {'tensor':40s} {'dtype':9s} {'shape':18s} {'layout':28s} pieces")
        for name, t in sorted(m.tensors.items()):
            print(f"  {key(name):40s} {dtype_name(t.dtype):9s} {str(list(t.shape)):18s} {str(t.layout):28s} {len(t.all_pieces())}")
    return 0


def _key_paths(m: Manifest) -> Callable[[str], str]:
    """How inspect shows a value's name: its key path, as ``Checkpointer.contents()`` gives
    it (``('opt', 'state', 0)``, a ``/`` or ``%`` in a key as it is; from the container tree
    of format version 4, else the stored name split at ``/``, all keys str)."""
    paths = dict(walk_tree(m.tree)) if m.tree is not None else {}
    return lambda name: repr(paths.get(name) or name_path(name))


def _lane_key(lane: str) -> tuple:
    return (0, int(lane)) if lane.isascii() and lane.isdigit() else (1, lane)


def cmd_verify(args: argparse.Namespace) -> int:
    storage = Storage(args.url)
    steps = committed_steps(storage) if args.all else [pick_step(storage, args.step)]
    if not steps:  # --all of nothing is not "all verified"
        raise no_checkpoint(storage)
    bad = 0
    for s in steps:
        try:
            m = read_manifest(storage, s)
        except (OSError, CheckpointError) as e:
            print(f"step {s}: DAMAGED manifest: {e}")
            bad += 1
            continue
        total, errors = 0, []
        if m.version >= 2:  # every rank's chunk table (data file or not) and per-rank values
            for r in range(m.world_size):
                try:
                    m.files.table(r)  # type: ignore[attr-defined]
                except (OSError, CheckpointError) as e:
                    errors.append(f"chunk table of rank {r}: {e}")
                try:
                    m.rank_values(r)
                except (OSError, CheckpointError) as e:
                    errors.append(f"per-rank values of rank {r}: {e}")
            try:
                read_bytes_values(storage, m, sorted(m.keyed))
            except (OSError, CheckpointError) as e:
                errors.append(f"bytes values: {e}")
        for name in sorted(m.files):
            try:
                f = m.files[name]
            except (OSError, CheckpointError) as e:
                if m.version == 1:
                    errors.append(str(e))
                continue
            try:
                reader = storage.open_reader(f"{step_dir(s)}/{name}")
            except (OSError, CheckpointError) as e:
                errors.append(str(e))
                continue
            with reader:
                for c in f.chunks:
                    buf = memoryview(bytearray(c.length))
                    where = f"{step_dir(s)}/{name} bytes [{c.offset}, {c.offset + c.length})"
                    try:
                        reader.read_into(c.offset, buf)
                        if checksum(buf) != c.checksum:
                            raise CheckpointError(f"{where}: checksum mismatch")
                        decompress_into(c.codec, buf, c.raw_length, where)
                    except (OSError, CheckpointError) as e:
                        errors.append(str(e))
                    total += c.length
        status = "ok" if not errors else f"DAMAGED ({len(errors)} problem{'s' if len(errors) > 1 else ''})"
        sealed = "manifest checksum ok" if m.sealed else "manifest has no checksum (written before flexckpt sealed them)"
        print(f"step {s}: {_count(len(m.files), 'file')}, {_mib(total)} read, {sealed}, {status}")
        for e in errors[:20]:
            print(f"  {e}")
        bad += bool(errors)
    return 1 if bad else 0


def _compression(value: str) -> Compression:
    try:
        return parse_compression(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_plan(args: argparse.Namespace) -> int:
    storage = Storage(args.url)
    m = read_step(storage, pick_step(storage, args.step), args.step is None)
    layouts = checked_layouts(m, args.world, args.layout, getattr(args, "mesh", None))
    plan = restore_plan(m, layouts, args.world)
    print(f"restore of step {m.step} (saved by {ranks(m.world_size)}) on {ranks(args.world)}:")
    print(f"  {'rank':>4}  {'holds':>14}  {'reads':>14}  {'ratio':>6}  {'requests':>8}  files")
    for r in plan.ranks:
        ratio = f"{r.read_ratio:.2f}" if r.holds else "-"
        print(f"  {r.rank:>4}  {_mib(r.holds):>14}  {_mib(r.reads):>14}  {ratio:>6}  {r.requests:>8}  {r.files}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line with exit status 2, like the commands' own errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _check_arguments(args: argparse.Namespace) -> None:
    """Values argparse's types let through, refused before anything is read or written."""
    if getattr(args, "world", None) is not None and not 1 <= args.world <= MAX_WORLD:
        raise CheckpointError(f"--world must be in [1, {MAX_WORLD}] (what a checkpoint can record), got {args.world}")
    if getattr(args, "step", None) is not None:
        try:
            step_dir(args.step)
        except ValueError as e:
            raise CheckpointError(f"--step {args.step}: {e}") from None
    if (getattr(args, "budget_mib", None) or 0) < 0:
        raise CheckpointError(f"--budget-mib must be >= 0 (0: one tensor at a time), got {args.budget_mib}")
    for name in ("url", "src", "dst"):  # checkpoint locations
        if name in vars(args):
            _check_location(getattr(args, name))
    for name in ("dcp_dir", "out_dir"):  # the converters' other side is a local folder
        path = getattr(args, name, None)
        if path is not None and "://" in path:
            raise CheckpointError(f"{name.upper()} {path!r} is a URL: DCP and safetensors folders are read and "
                                  "written on local disk only; pass a path")


STORAGE_OPTIONS_HELP = ("fsspec options for s3:// (and other object-store) URLs, as JSON, e.g. "
                        "'{\"client_kwargs\": {\"endpoint_url\": \"http://host:9000\"}}' (default: the JSON of "
                        "FLEXCKPT_STORAGE_OPTIONS; the standard AWS_* variables, AWS_ENDPOINT_URL included, work "
                        "without either)")


def _storage_options(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        return parse_storage_options(text, "--storage-options")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _check_location(url: str) -> None:
    """A folder (there or not) or a URL of a filesystem fsspec knows; not a file."""
    where = "pass a folder or a URL (file://, s3://bucket/prefix); for a flextrain run, RUN_DIR/ckpt"
    if not url:
        raise CheckpointError(f"the checkpoint location is empty; {where}")
    try:
        storage = Storage(url)
    except (ValueError, ImportError) as e:  # fsspec: "Protocol not known: foo", or its package is missing
        raise CheckpointError(f"cannot use {url!r} as a checkpoint location: {e}; {where}") from None
    if storage.local and os.path.isfile(storage.root):
        raise CheckpointError(f"{url} is a file, not a checkpoint folder; {where}")


class _HeldErrors(logging.Handler):
    """The library logs each failure with its traceback (a training job carries on after a
    failed save); a command reports its own failure in one line instead. So while a command
    runs, the library's warnings print in one line each and its errors are held: shown, one
    line each, only if the command succeeds all the same (or fails in a way of its own)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.held: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        msg = msg if msg.startswith("flexckpt") else f"flexckpt: {msg}"
        if record.levelno >= logging.ERROR:
            self.held.append(msg)
        else:
            print(msg, file=sys.stderr)

    def show(self) -> None:
        for msg in self.held:
            print(msg, file=sys.stderr)


@contextlib.contextmanager
def _one_line_log() -> Iterator[_HeldErrors]:
    logger = logging.getLogger("flexckpt")
    handler, propagate = _HeldErrors(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="flexckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    url_help = "checkpoint folder or URL (file://, s3://bucket/prefix); for a flextrain run, RUN_DIR/ckpt"
    p = sub.add_parser("steps", help="list committed steps",
                       description="One line per committed step: world size, bytes, tensors, time, run id. "
                                   "Exit 2 when there is none.")
    p.add_argument("url", help=url_help)
    p.set_defaults(fn=cmd_steps)
    p = sub.add_parser("inspect", help="summarise a checkpoint",
                       description="What one committed step holds: tensors, layouts, files, plain, per-lane "
                                   "and per-rank values. Reads the manifest only.")
    p.add_argument("url", help=url_help)
    p.add_argument("--step", type=int, help="a committed step (default: the newest)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("verify", help="read every chunk and check its checksum",
                       description="Read every chunk of a step and check its xxh3-64 checksum; exit 1 if any "
                                   "step is damaged, naming the file and byte range.")
    p.add_argument("url", help=url_help)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="a committed step (default: the newest)")
    g.add_argument("--all", action="store_true", help="every committed step")
    p.set_defaults(fn=cmd_verify)
    layout_help = ("glob PATTERN=KIND (repeatable): replicate, shard, owned, block[:SIZE], hybrid:GROUP[:BLOCK], "
                   "or one placement per --mesh dim (R, S<d>, SS<d>:<sf>; e.g. S0,S1); default: each tensor keeps "
                   "its saved kind")
    mesh_help = "target device mesh NAME=SIZE,... (e.g. fsdp=2,tp=2), row-major over ranks; sizes multiply to --world"
    p = sub.add_parser("plan", help="what each rank of another world size would read",
                       description="Per rank of a world of N: bytes held, bytes read, ranged requests and "
                                   "files, when loading a committed step. Reads the manifest only.")
    p.add_argument("url", help=url_help)
    p.add_argument("--world", type=int, required=True, help="the world size to plan for")
    p.add_argument("--step", type=int, help="a committed step (default: the newest)")
    p.add_argument("--layout", action="append", default=[], metavar="PATTERN=KIND", help=layout_help)
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="NAME=SIZE,...", help=mesh_help)
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("reshard", help="rewrite a checkpoint for another world size",
                       description="Write one committed step of SRC to DST as if saved by N ranks (one "
                                   "process plays every rank), so a job of N ranks loads it without resharding (any "
                                   "world size can load the original too). Per-rank values are dropped when N changes.")
    p.add_argument("src", help=url_help)
    p.add_argument("dst", help="where to write the new checkpoint: a folder or URL (file://, s3://bucket/prefix)")
    p.add_argument("--world", type=int, required=True, help="the world size to write for")
    p.add_argument("--step", type=int, help="a committed step (default: the newest)")
    p.add_argument("--layout", action="append", default=[], metavar="PATTERN=KIND", help=layout_help)
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="NAME=SIZE,...", help=mesh_help)
    p.add_argument("--compression", default=None, type=_compression, help="none, zstd or zstd:LEVEL")
    p.set_defaults(fn=cmd_reshard)
    add_convert_parsers(sub)  # import-dcp, export-dcp, export-safetensors
    for p in sub.choices.values():
        p.add_argument("--storage-options", metavar="JSON", help=STORAGE_OPTIONS_HELP)
    args = parser.parse_args(argv)
    with _one_line_log() as log:
        try:
            _check_arguments(args)
            with using_storage_options(_storage_options(args.storage_options)):
                rc = args.fn(args)
            sys.stdout.flush()  # here, so that a reader gone is seen here
        except BrokenPipeError:  # stdout's reader stopped early (| head)
            return reader_gone()
        except CheckpointError as e:
            print(f"flexckpt: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # a folder that cannot be read or written: like bad input
            print(f"flexckpt: {args.cmd}: {e}", file=sys.stderr)
            return 2
        except BaseException:  # not the library's own error: what it logged may explain it
            log.show()
            raise
    log.show()
    return rc


if __name__ == "__main__":
    sys.exit(main())
