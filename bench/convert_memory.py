"""Peak memory of the checkpoint converters against
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (which loads the whole
checkpoint, then ``torch.save``s it), on one DCP checkpoint of ``--gib`` GiB.

    python3 dev.py bench convert_memory [--gib 1.25] [--largest-mib 128] [--budget-mib 256] [--dir PATH]

The checkpoint: fp32 tensors in a transformer-like size mix (the largest ``--largest-mib``
MiB, the rest a quarter of it or smaller), nested as ``{"model": ..., "optim": ..., "step"}``
and saved by ``dcp.save``. Every conversion runs in a fresh process; its peak is that
process's peak RSS (``VmHWM``: ``ru_maxrss`` would carry the parent's over fork and exec), and "over start" subtracts the RSS the same process had
after its imports, before converting. Conversions run one after another: import-dcp,
export-dcp of the imported checkpoint, export-safetensors of it, and the peer.
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

MIB = 1 << 20

CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint  # imports before the start figure
from flexckpt.cli import main
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
start = status("VmRSS")
t0 = time.perf_counter()
argv = json.loads(sys.argv[1])
if argv[0] == "dcp_to_torch_save":
    dcp_to_torch_save(argv[1], argv[2])
    rc = 0
else:
    rc = main(argv)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec from the parent
print(json.dumps({"rc": rc, "start": start, "peak": status("VmHWM"),
                  "seconds": time.perf_counter() - t0}))
"""


def build_dcp(folder: str, gib: float, largest_mib: int) -> dict:
    """Tensors of ``largest`` and ``largest / 4`` MiB in turn (and small vectors) until ``gib``."""
    import torch
    import torch.distributed.checkpoint as dcp

    total, i = 0, 0
    model, optim = {}, {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": []}]}
    sizes = [largest_mib * MIB, largest_mib * MIB // 4, largest_mib * MIB // 4, 16 * 1024]
    while total < gib * 2**30:
        nbytes = sizes[i % len(sizes)]
        rows = nbytes // 4 // 1024
        t = torch.full((rows, 1024) if rows else (nbytes // 4,), float(i))
        fqn = f"layers.{i}.weight"
        if i % 3 == 2:  # every third is an optimizer moment
            optim["state"][f"layers.{i - 1}.weight"] = {"exp_avg": t, "step": torch.tensor(1.0)}
        else:
            model[fqn] = t
            optim["param_groups"][0]["params"].append(fqn)
        total += t.numel() * 4
        i += 1
    dcp.save({"model": model, "optim": optim, "step": 100}, checkpoint_id=folder, no_dist=True)
    return {"bytes": total, "tensors": i, "largest": max(sizes)}


def run_child(argv: list[str]) -> dict:
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.25, help="checkpoint size in GiB (default 1.25)")
    ap.add_argument("--largest-mib", type=int, default=128, help="largest tensor in MiB (default 128)")
    ap.add_argument("--budget-mib", type=int, default=256, help="converters' --budget-mib (default 256, their default)")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary folder, removed after)")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="flexckpt-convert-")
    os.makedirs(root, exist_ok=True)
    try:
        t0 = time.perf_counter()
        info = build_dcp(f"{root}/dcp", args.gib, args.largest_mib)
        print(f"DCP checkpoint: {info['tensors']} tensors, {info['bytes'] / 2**30:.2f} GiB, largest "
              f"{info['largest'] / MIB:.0f} MiB (built in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        budget = ["--budget-mib", str(args.budget_mib)]
        runs = [
            ("flexckpt import-dcp", ["import-dcp", f"{root}/dcp", f"{root}/flex", *budget]),
            ("flexckpt export-dcp", ["export-dcp", f"{root}/flex", f"{root}/dcp2", *budget]),
            ("flexckpt export-safetensors", ["export-safetensors", f"{root}/flex", f"{root}/st", *budget]),
            ("dcp_to_torch_save (peer)", ["dcp_to_torch_save", f"{root}/dcp", f"{root}/all.pt"]),
        ]
        rows = []
        for label, a in runs:
            r = run_child(a)
            rows.append((label, r))
            print(f"  {label}: peak {r['peak'] / MIB:,.0f} MiB ({r['seconds']:.1f} s)", file=sys.stderr)
        peer = rows[-1][1]["peak"] - rows[-1][1]["start"]
        print(f"\nCheckpoint {info['bytes'] / 2**30:.2f} GiB ({info['tensors']} fp32 tensors, largest "
              f"{info['largest'] / MIB:.0f} MiB), converters' budget {args.budget_mib} MiB\n")
        print("| conversion | peak RSS | RSS at start (imports) | peak over start | over start / checkpoint | vs peer | time |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, r in rows:
            over = r["peak"] - r["start"]
            print(f"| {label} | {r['peak'] / MIB:,.0f} MiB | {r['start'] / MIB:,.0f} MiB | {over / MIB:,.0f} MiB | "
                  f"{over / info['bytes']:.2f} | {over / peer:.2f} | {r['seconds']:.1f} s |")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
