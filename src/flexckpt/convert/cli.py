"""The converters' ``flexckpt`` subcommands: import-dcp, export-dcp, export-safetensors."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from flexckpt.convert.tensor_stream import DEFAULT_BUDGET
from flexckpt.errors import CheckpointError

TRUST = ("DCP's .metadata is a Python pickle and its non-tensor values are torch.load-ed with "
         "weights_only=False: import only checkpoints you trust. (flexckpt's own load path never unpickles.)")
NO_CHECKSUMS = ("DCP stores no checksums: a damaged byte in a DCP data file imports without an error, and the "
                "imported checkpoint's checksums then vouch for the damaged bytes. Check the source (for example "
                "against file hashes taken when it was written) before importing.")


def _one_line_os_errors(fn: Any) -> Any:
    """A failing disk or folder is reported like bad input: one line, exit status 2."""
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except OSError as e:
            raise CheckpointError(f"{fn.__name__[4:].replace('_', '-')}: {e}") from e

    return run


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cmd_import_dcp(args: argparse.Namespace) -> int:
    from flexckpt.convert.dcp import import_dcp

    if args.world is None:
        if args.mesh is not None or args.layout:
            raise CheckpointError("import-dcp: --mesh and --layout lay tensors out for --world N ranks; give --world")
        r = import_dcp(args.dcp_dir, args.url, args.step, budget=_budget(args), progress=sys.stderr.isatty())
    else:
        r = _import_for_world(args, import_dcp)
    print(f"imported {r.tensors} tensors ({_mib(r.nbytes)}) from {args.dcp_dir} as step {r.step} "
          f"(step from {r.step_source}) under {args.url}")
    for what in r.left_out:
        print(f"  left out: {what}")
    return 0


def _budget(args: argparse.Namespace) -> int:
    """--budget-mib in bytes; the default when not given."""
    return DEFAULT_BUDGET if args.budget_mib is None else args.budget_mib << 20


def _import_for_world(args: argparse.Namespace, import_dcp: Any) -> Any:
    """Import into a temporary folder, then reshard it to --world (--mesh, --layout) at URL.
    A --budget-mib given bounds the reshard too: each target rank's share is read and
    written whole, one rank after another, and a share over the budget is refused before
    anything is written to URL."""
    import math
    import tempfile

    from flexckpt.convert.reshard import cmd_reshard, writable_folder
    from flexshard.world import ranks

    if args.mesh is not None and math.prod(args.mesh) != args.world:
        raise CheckpointError(f"--mesh {args.mesh} spans {ranks(math.prod(args.mesh))}, --world is {args.world}; "
                              "make them agree")
    writable_folder(args.url)
    with tempfile.TemporaryDirectory(prefix="flexckpt-import-", dir=args.tmp_dir) as tmp:
        r = import_dcp(args.dcp_dir, tmp, args.step, budget=_budget(args), progress=sys.stderr.isatty())
        budget = None if args.budget_mib is None else _budget(args)
        cmd_reshard(argparse.Namespace(src=tmp, dst=args.url, step=r.step, world=args.world, layout=args.layout,
                                       mesh=args.mesh, compression=None, budget=budget))
    return r


def cmd_export_dcp(args: argparse.Namespace) -> int:
    from flexckpt.convert.dcp import export_dcp

    r = export_dcp(args.url, args.dcp_dir, args.step, budget=_budget(args), progress=sys.stderr.isatty())
    print(f"exported step {r.step}: {r.tensors} tensors ({_mib(r.nbytes)}) to {args.dcp_dir}")
    for what in r.left_out:
        print(f"  left out: {what}")
    return 0


def cmd_export_safetensors(args: argparse.Namespace) -> int:
    from flexckpt.convert.safetensors_out import export_safetensors

    r = export_safetensors(args.url, args.out_dir, args.step, select=args.select, strip_prefix=args.strip_prefix,
                           dtype=args.dtype, max_shard_size=args.max_shard_size, budget=_budget(args),
                           progress=sys.stderr.isatty())
    files = f"{len(r.files)} file{'s' if len(r.files) != 1 else ''}"
    print(f"exported step {r.step}: {r.tensors} tensors ({_mib(r.nbytes)}) in {files} to {args.out_dir}")
    return 0


def _command(sub: Any, name: str, fn: Any, src: str, dst: str, help: str, description: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=description)
    what = {"url": "flexckpt checkpoint folder or URL (file://, s3://bucket/prefix; for a flextrain run, RUN_DIR/ckpt)",
            "dcp_dir": "torch.distributed.checkpoint folder" + (" to write (new or empty)" if dst == "dcp_dir" else ""),
            "out_dir": "output folder (new or empty)"}
    p.add_argument(src, help=what[src])
    p.add_argument(dst, help="where to write the checkpoint: a folder or URL (file://, s3://bucket/prefix)"
                   if dst == "url" else what[dst])
    p.add_argument("--step", type=int, help="the step number to write (default: see above)" if name == "import-dcp"
                   else "a committed step (default: the newest)")
    p.add_argument("--budget-mib", type=int, default=None, metavar="MIB",
                   help=f"tensors read together, in MiB (default {DEFAULT_BUDGET >> 20}; peak memory is about twice "
                   "this or the largest tensor)" + ("; with --world, also the most one target rank may hold (its share "
                   "is read and written whole): a larger share is refused before writing" if name == "import-dcp" else ""))
    p.set_defaults(fn=_one_line_os_errors(fn))
    return p


def add_parsers(sub: Any) -> None:
    from flexckpt.convert.reshard import parse_mesh

    p = _command(sub, "import-dcp", cmd_import_dcp, "dcp_dir", "url",
             help="a torch.distributed.checkpoint folder as a flexckpt checkpoint",
             description="Write a checkpoint saved by torch.distributed.checkpoint.save (any world size, FSDP2 or "
             "plain) as one flexckpt step that loads at any world size. The step is --step, else a top-level plain "
             "'step' value of the checkpoint, else 0. With --world N (and --mesh, --layout as for reshard) the tensors "
             "are laid out for N ranks, e.g. --world 4 --mesh fsdp=2,tp=2 --layout 'model/*=S0,S1': the import is "
             "staged in a temporary folder (a full copy; --tmp-dir) and then resharded to URL. "
             "(export-dcp and export-safetensors write whole tensors: they take no target.) "
             + TRUST + " " + NO_CHECKSUMS)
    p.add_argument("--world", type=int, help="lay the tensors out for this many ranks (default: as loaded anywhere)")
    p.add_argument("--layout", action="append", default=[], metavar="PATTERN=KIND",
                   help="glob PATTERN=KIND (repeatable; needs --world), as for reshard: replicate, shard, owned, "
                   "block[:SIZE], hybrid:GROUP[:BLOCK], or one placement per --mesh dim (R, S<d>, SS<d>:<sf>)")
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="NAME=SIZE,...",
                   help="target device mesh (e.g. fsdp=2,tp=2), row-major over ranks; sizes multiply to --world")
    p.add_argument("--tmp-dir", metavar="DIR", help="where the import is staged with --world (default: the system's)")
    _command(sub, "export-dcp", cmd_export_dcp, "url", "dcp_dir",
             help="a flexckpt checkpoint as a torch.distributed.checkpoint folder",
             description="Write one committed step (the newest unless --step) as a DCP checkpoint that "
             "torch.distributed.checkpoint.load reads at any world size. Tensors and plain values are exported; "
             "per-lane and per-rank values are left out and listed. DCP_DIR must be new or empty.")
    p = _command(sub, "export-safetensors", cmd_export_safetensors, "url", "out_dir",
                 help="consolidated weights as safetensors files (Hugging Face layout)",
                 description="Write the selected tensors of one step whole, as model-0000k-of-0000n.safetensors "
                 "files and model.safetensors.index.json (loadable by safetensors.torch.load_file). Names are the "
                 "checkpoint's, less --strip-prefix, with '/' turned into '.'. OUT_DIR must be new or empty.")
    p.add_argument("--select", action="append", metavar="GLOB", help="tensor names to export (repeatable; default all)")
    p.add_argument("--strip-prefix", metavar="P", help="drop this prefix from names, e.g. model/")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point tensors")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest file: e.g. 5GB (the default; 10**9 bytes a GB), 500MB, 2GiB or a byte count")
