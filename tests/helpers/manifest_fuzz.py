"""The manifest fuzzer (issue 11): mutate real small checkpoints (format version 1, and the
version written now with its container tree, chunk tables, data files and values files:
per-rank and bytes values) and drive every reader over them: parse, the ``flexckpt plan``
path, a load at another world size, a load without a template (``load_dict``), ``verify``,
``inspect`` and ``steps``.
Every outcome must be success or one of flexckpt's own errors, under a memory cap
(RLIMIT_AS) and a time bound per case.

Run as ``python helpers/manifest_fuzz.py FOLDER CASES [--seed S] [--case N] [--shard I/N]``: it
prints one JSON line of counts (``--shard I/N``: cases I, I+N, I+2N ... of CASES, for N
processes side by side). A foreign exception, a case over its time bound or a MemoryError
ends the run with exit status 1, naming the case and the command that replays it alone.

Each case draws from its own ``random.Random`` (seed, case number), not from hypothesis:
hypothesis's engine cost a third of each case's time here, and a failing case is small
enough to read without shrinking.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import orjson
import torch

from flexckpt import ByLane, Checkpointer, CheckpointError, PerRank
from flexckpt import cli, storage as storage_module
from flexckpt.catalog import read_manifest
from flexckpt.format.checksum import checksum
from flexckpt.format.jsondoc import seal, unseal
from flexckpt.storage import Storage
from flexshard import BlockShard, HybridShard, Owned, Replicate, Shard, ShardedTensor

STEP = 3
CASE_SECONDS = 10.0  # per case; a clean case takes milliseconds
MEMORY_HEADROOM = 1 << 30  # address space the fuzzing may add to what setup left
DATA = Path(__file__).resolve().parents[1] / "data" / "v1"

V2_TENSORS = {
    "a": ((37, 5), torch.float32, Shard(0)),
    "b": ((70,), torch.bfloat16, BlockShard(32)),
    "c": ((), torch.float64, Replicate()),
    "d": ((9, 3), torch.int64, Owned(1)),
    "e": ((40, 2), torch.float16, HybridShard(1)),
}


class CaseTimeout(BaseException):
    """A case ran past CASE_SECONDS."""


def _global(name: str) -> torch.Tensor:
    shape, dtype, _ = V2_TENSORS[name]
    g = torch.Generator().manual_seed(ord(name))
    return (torch.randn(shape, generator=g) * 40).to(dtype)


def _v2_state(rank: int, world: int) -> dict:
    return {
        "t": {n: ShardedTensor.from_global(_global(n), lay, rank, world) for n, (_, _, lay) in V2_TENSORS.items()},
        "meta": {"step": STEP, "pair": [1, "x"], "lr": 0.5},
        "hp": HP,  # the container tree and tagged plain values of format version 4
        "lanes": ByLane({str(rank): {"doc": 10 + rank, "off": [rank, 7]}}),
        "rng": PerRank(torch.arange(4, dtype=torch.int32) + rank),
        "dl": {f"dp_rank_{rank}": _blob(rank), "shared": _blob(9)},  # bytes values, by key
    }


HP = {7: (None, -0.0), "7": [], "dt": torch.bfloat16, "dev": torch.device("cpu"), "cls": torch.nn.GELU,
      "nested": [{"k": ()}, (torch.ones(2), b"b")], "empty": {}}


def _blob(i: int) -> bytes:
    return bytes(range(i, i + 40)) * 3


def _v2_target(rank: int, world: int) -> dict:
    return {
        "t": {n: ShardedTensor.empty(shape, Owned(world - 1) if isinstance(lay, Owned) else lay, dtype, rank=rank,
                                     world_size=world)
              for n, (shape, dtype, lay) in V2_TENSORS.items()},
        "meta": {"step": 0, "pair": [0, ""], "lr": 0.0},
        "lanes": ByLane(),
        "rng": PerRank(None),
        "dl": {f"dp_rank_{rank % 2}": b"", "shared": b""},
    }


def _v1_target(rank: int, world: int) -> dict:
    shapes = {"block": ((70, 3), torch.float32), "shard": ((9, 2), torch.int64), "owned": ((5, 4), torch.bfloat16),
              "rep": ((6,), torch.float32), "scalar": ((), torch.float64)}
    return {
        "t": {n: ShardedTensor.empty(s, Shard(0) if s else Replicate(), d, rank=rank, world_size=world)
              for n, (s, d) in shapes.items()},
        "step": 0, "lanes": ByLane(), "rng": PerRank(None),
    }


def make_bases(folder: Path) -> dict[str, dict[str, bytes]]:
    """Four real checkpoints of step 3: version 1 (plain, zstd) from tests/data, version 2
    (plain, zstd) saved here by two ranks. Returns each one's files, by path."""
    for sub in ("plain", "zstd"):
        shutil.copytree(DATA / sub, folder / f"v1{sub}")
    for codec in ("none", "zstd"):
        root = str(folder / f"v2{codec}")
        cks = [Checkpointer(root, rank=r, world_size=2, run_id="fz", chunk_bytes=256,
                            compression=None if codec == "none" else "zstd", direct_io=False, fsync=False)
               for r in range(2)]
        handles = [ck.save(STEP, _v2_state(r, 2)) for r, ck in enumerate(cks)]
        for h in handles:
            h.result(timeout=60)
        for ck in cks:
            ck.close()
    bases = {}
    for base in sorted(os.listdir(folder)):
        files = {}
        for path in sorted((folder / base).rglob("*")):
            if path.is_file():
                files[str(path.relative_to(folder / base))] = path.read_bytes()
        bases[base] = files
    return bases


# -- mutations ---------------------------------------------------------------------------------
INTERESTING = [
    None, True, False, 0, -1, 1, 2, 3, 7, 255, 256, 2**30, 2**31, 2**32, 2**40, 2**62, 2**63, -(2**63), "HUGE",
    0.5, -0.0, 1e20, -1e300, "", "x", "²", "..", "../../etc/passwd", "/abs", "r00000.data", "0" * 16, "f" * 16,
    "zstd", "none", "float32", "bfloat16", "nope", [], [1], ["x"], [[1, 2]], [0, 1, 2, 3], {}, {"kind": "shard", "dim": 0},
    {"kind": "replicate"}, {"kind": "owned", "owner": 5}, {"kind": "hybrid_shard", "group_size": 3, "block_size": None},
    {"$tuple": "x"}, {"$float": "nan"}, {"$tensor": {"dtype": "float32", "shape": [2**40], "data": ""}},
    "DEEP", {"$class": "os:system"}, {"$dtype": "load"}, {"$dataclass": "subprocess:Popen", "fields": {}},
    {"$enum": "torch:float32", "name": "x"}, {"$path": "/x", "type": "os"}, ["d", [1, 1], [0, 0]], ["l", [0]],
    ["t", [["d", ["x"], [0]]]], ["d", [True], [0]], ["q", []],
]
DEEP = b"[" * 1010 + b"1" + b"]" * 1010


def _nodes(doc, path=()):
    """Every (path, value) in a JSON document."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, path + (i,))


def _at(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], one time in eight an end of it (where off-by-ones live)."""
    return rng.choice((lo, hi)) if rng.random() < 0.125 else rng.randint(lo, hi)


def _json_edit(data: bytes, rng: random.Random) -> bytes:
    doc = orjson.loads(data)
    nodes = list(_nodes(doc))
    path, value = rng.choice(nodes)
    op = rng.choice(["replace", "replace", "replace", "delete", "add", "grow", "shrink", "tweak"])
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    new = rng.choice(INTERESTING)
    if op == "tweak" and isinstance(value, int) and not isinstance(value, bool):
        new = value + rng.choice([-1, 1, 64, -64, 4096, 2**20])
    elif op == "tweak" and isinstance(value, str):
        new = value[:-1] + ("0" if value[-1:] != "0" else "1") if value else "0"
    if op in ("replace", "tweak"):
        if path:
            parent[path[-1]] = new
        else:
            doc = new
    elif op == "delete" and path:
        del parent[path[-1]]
    elif op == "add" and isinstance(value, dict):
        value[rng.choice(["x", "²", "0", "1", "a", "t/zz", "extra"])] = new
    elif op == "add" and isinstance(value, list):
        value.insert(_at(rng, 0, len(value)), new)
    elif op == "grow" and isinstance(value, list) and value:
        value.extend(value[-1:] * rng.randint(1, 3))
    elif op == "shrink" and isinstance(value, list) and value:
        del value[_at(rng, 0, len(value) - 1)]
    return orjson.dumps(doc).replace(b'"DEEP"', DEEP).replace(b'"HUGE"', b"1" + b"0" * 30)


def _byte_edit(data: bytes, rng: random.Random) -> bytes:
    op = rng.choice(["flip", "flip", "cut", "splice"])
    if not data:
        return b"\x00"
    if op == "cut":
        return data[: _at(rng, 0, len(data) - 1)]
    out = bytearray(data)
    if op == "flip":
        for _ in range(rng.randint(1, 4)):
            out[_at(rng, 0, len(out) - 1)] ^= 1 << rng.randrange(8)
        return bytes(out)
    i = _at(rng, 0, len(out))
    return bytes(out[:i] + rng.randbytes(rng.randint(1, 24)) + out[i:])


def _table_edit(data: bytes, rng: random.Random) -> bytes:
    """A table with a header field set to an edge value, or its bytes edited."""
    import struct

    if rng.random() < 0.5:
        return _byte_edit(data, rng)
    fields = list(struct.unpack_from("<8sIIQQI", data))
    i = rng.randint(1, 5)
    fields[i] = rng.choice([0, 1, 2, 3, 2**31, 2**32 - 1] + ([2**40, 2**63] if i in (3, 4) else []))
    return struct.pack("<8sIIQQI", *fields) + data[struct.calcsize("<8sIIQQI"):]


def _vouch(manifest: bytes, table_rel: str, table: bytes) -> bytes:
    """The manifest, saying the (edited) table is the one it committed."""
    doc = orjson.loads(manifest)
    rank = int(table_rel.rsplit("/r", 1)[1].split(".")[0])
    doc["ranks"][rank][:2] = [checksum(table), len(table)]
    return reseal(orjson.dumps(doc))


SEAL_HEAD = b'{"manifest_checksum":"'


def reseal(data: bytes) -> bytes:
    """An edited manifest with its checksum recomputed, as an attacker would, so that the
    edit reaches the validator. Bytes that no longer start with a well-formed checksum field
    (the edit hit it) stay as they are: those test the checksum's own checks."""
    head = len(SEAL_HEAD) + 16
    if not data.startswith(SEAL_HEAD) or data[head : head + 2] != b'",':
        return data
    try:
        unseal(data)
        return data  # still intact (an edit that changed nothing)
    except CheckpointError:
        pass
    return seal(b"{" + data[head + 2 :])


def _vouch_values(manifest: bytes, rel: str, data: bytes) -> bytes:
    """The manifest, saying the (edited) values file is the one it committed: a rank's
    per-rank values file by its line, the bytes values file key by key."""
    doc = orjson.loads(manifest)
    if rel.endswith("keyed.values"):
        for entry in doc["keyed"].values():
            entry[2] = checksum(data[entry[0] : entry[0] + entry[1]])
    else:
        rank = int(rel.rsplit("/r", 1)[1].split(".")[0])
        doc["ranks"][rank][3:5] = [checksum(data), len(data)]
    return orjson.dumps(doc)


def mutate(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes | None]]:
    """(what was done, the files to change: new bytes or None to delete)."""
    manifest_rel = next(k for k in files if k.endswith("manifest.json"))
    tables = sorted(k for k in files if k.endswith(".table"))
    datas = sorted(k for k in files if k.endswith(".data"))
    values = sorted(k for k in files if k.endswith(".values"))
    if rng.randrange(24) == 0:  # the checkpoint as saved: it must load exactly at any world size
        return "none", {}
    kinds = ["json", "json", "json", "bytes", "data"] + (["table", "table", "table"] if tables else [])
    kinds += ["values"] if values else []
    kind = rng.choice(kinds)
    if kind == "json":
        edited = _json_edit(files[manifest_rel], rng)
        field = len(SEAL_HEAD) + 18  # the checksum field, intact: the edit is elsewhere
        if tables and rng.randrange(10) == 0 and edited != files[manifest_rel] and edited[:field] == files[manifest_rel][:field]:
            return "unsealed", {manifest_rel: edited}  # an edit the checksum must catch
        return kind, {manifest_rel: reseal(edited)}
    if kind == "bytes":
        return kind, {manifest_rel: reseal(_byte_edit(files[manifest_rel], rng))}
    if kind == "table":
        rel = rng.choice(tables)
        table = _table_edit(files[rel], rng)
        out: dict[str, bytes | None] = {rel: table}
        if rng.randrange(5):  # mostly vouched for: past the manifest's checksum
            out[manifest_rel] = _vouch(files[manifest_rel], rel, table)
        return kind, out
    if kind == "values":
        rel = rng.choice(values)
        if rng.randrange(6) == 0:
            return "values-missing", {rel: None}
        data = _byte_edit(files[rel], rng)
        out = {rel: data}
        if rng.randrange(3):  # mostly vouched for: past the manifest's checksums
            out[manifest_rel] = _vouch_values(files[manifest_rel], rel, data)
        return kind, out
    rel = rng.choice(datas)  # kind "data"
    if rng.randrange(6) == 0:
        return "data-missing", {rel: None}
    return kind, {rel: _byte_edit(files[rel], rng)}


# -- the run -----------------------------------------------------------------------------------
def _cli(cmd: str, url: str, **options) -> int:
    """``flexckpt CMD URL ...`` as ``cli.main`` runs it (its own errors: status 2), without
    building the argument parser each time; anything else propagates."""
    args = argparse.Namespace(url=url, step=None, all=False, tensors=True, layout=[], **options)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return getattr(cli, f"cmd_{cmd}")(args)
        except CheckpointError:
            return 2


def run(folder: Path, cases: int, seed: int = 0, only: int | None = None, shard: tuple[int, int] = (0, 1)) -> dict:
    """Cases 0 .. cases-1 of ``seed`` (those of ``shard``; or case ``only`` alone), each from
    its own generator."""
    bases = make_bases(folder / "bases")
    work = folder / "work"
    for name, files in bases.items():
        for rel, data in files.items():
            (work / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / name / rel).write_bytes(data)
    names = sorted(bases)
    counts = {"cases": 0, "parsed": 0, "planned": 0, "loaded": 0, "load_errors": 0, "verified_ok": 0,
              "verify_damaged": 0, "unmutated_exact": 0, "by_kind": {}}
    # every reader below logs its failures: keep the output to the counts
    import logging
    logging.getLogger("flexckpt").setLevel(logging.CRITICAL)

    def on_alarm(signum, frame):
        raise CaseTimeout(f"a case ran past {CASE_SECONDS} s")

    # the stall timeout runs each storage call on a helper thread; the per-case alarm bounds
    # time here, so calls run directly (three times as many cases in the same minute)
    storage_module.bounded = lambda stall_timeout, what, fn: fn()
    signal.signal(signal.SIGALRM, on_alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = _address_space()
    resource.setrlimit(resource.RLIMIT_AS, (used + MEMORY_HEADROOM, hard))
    counts["memory_cap_mib"] = (used + MEMORY_HEADROOM) >> 20

    for number in range(shard[0], cases, shard[1]) if only is None else [only]:
        rng = random.Random(seed * 1_000_003 + number)
        name = rng.choice(names)
        root = work / name
        kind, changes = mutate(bases[name], rng)
        for rel, new in changes.items():
            if new is None:
                (root / rel).unlink(missing_ok=True)
            else:
                (root / rel).write_bytes(new)
        world = rng.randint(1, 3)
        rank = rng.randrange(world)
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
        try:
            drive(root, name, kind, world, rank, counts, number)
        except BaseException:
            print(f"manifest fuzz case {number} of seed {seed} failed: {name} {kind} edit of {sorted(changes)}, "
                  f"read at world {world} by rank {rank}; replay it alone with: python {__file__} FOLDER 1 "
                  f"--seed {seed} --case {number}", file=sys.stderr, flush=True)
            raise
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for rel in changes:
                (root / rel).write_bytes(bases[name][rel])
        counts["cases"] += 1
        counts["by_kind"][kind] = counts["by_kind"].get(kind, 0) + 1
    return counts


def drive(root: Path, name: str, kind: str, world: int, rank: int, counts: dict, number: int) -> None:
    storage = Storage(str(root))
    try:
        manifest = read_manifest(storage, STEP)
    except CheckpointError as e:
        manifest = None
        if kind == "unsealed" and "manifest_checksum" in str(e):
            counts["checksum_caught"] = counts.get("checksum_caught", 0) + 1
    if kind == "unsealed" and manifest is not None:
        raise AssertionError(f"{name}: a manifest edited without its checksum recomputed was accepted")
    if manifest is not None:
        counts["parsed"] += 1
        if _cli("plan", str(root), world=world) == 0:
            counts["planned"] += 1
    target = (_v1_target if name.startswith("v1") else _v2_target)(rank, world)
    with Checkpointer(str(root), rank=rank, world_size=world, run_id="reader", read_threads=2) as ck:
        try:
            ck.load(target, step=STEP, strict=False)
            counts["loaded"] += 1
            if kind == "none" and name.startswith("v2"):
                for n, t in target["t"].items():
                    want = ShardedTensor.from_global(_global(n), t.layout, rank, world).local
                    if not torch.equal(t.local, want):
                        raise AssertionError(f"{name}: unmutated tensor {n} loads differently at world {world}")
                if target["dl"] != {f"dp_rank_{rank % 2}": _blob(rank % 2), "shared": _blob(9)}:
                    raise AssertionError(f"{name}: unmutated bytes values load differently at world {world}")
                counts["unmutated_exact"] += 1
        except CheckpointError:
            counts["load_errors"] += 1
        if kind == "none" or number % 3 == 0:  # a third of the cases (time), and every unmutated one
            _drive_load_dict(ck, name, kind, world, counts)
    rc = _cli("verify", str(root))
    counts["verified_ok" if rc == 0 else "verify_damaged"] += 1
    assert rc in (0, 1, 2), rc
    if number % 4 == 0:
        for cmd in ("steps", "inspect"):
            assert _cli(cmd, str(root)) in (0, 1, 2)


def _drive_load_dict(ck: Checkpointer, name: str, kind: str, world: int, counts: dict) -> None:
    """A load without a template: the container tree and the tagged plain values."""
    try:
        got = ck.load_dict(step=STEP, exclude=() if world == 2 or name.startswith("v1") else (("rng",),))
        counts["dict_loaded"] = counts.get("dict_loaded", 0) + 1
        if kind == "none" and name.startswith("v2"):
            nested = got["hp"].pop("nested")
            if (got["hp"] != {k: v for k, v in HP.items() if k != "nested"} or nested[0] != {"k": ()}
                    or not torch.equal(nested[1][0], torch.ones(2)) or nested[1][1] != b"b"
                    or any(not torch.equal(got["t"][n], _global(n)) for n in V2_TENSORS)):
                raise AssertionError(f"{name}: unmutated state loads differently without a template")
            counts["dict_exact"] = counts.get("dict_exact", 0) + 1
    except CheckpointError:
        counts["dict_errors"] = counts.get("dict_errors", 0) + 1


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


if __name__ == "__main__":
    cli_args = argparse.ArgumentParser()
    cli_args.add_argument("folder", type=Path)
    cli_args.add_argument("cases", type=int)
    cli_args.add_argument("--seed", type=int, default=0)
    cli_args.add_argument("--case", type=int, default=None, help="replay this case alone")
    cli_args.add_argument("--shard", default="0/1", help="I/N: cases I, I+N, I+2N ...")
    given = cli_args.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    out = run(given.folder, given.cases, given.seed, given.case, tuple(map(int, given.shard.split("/"))))
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out), flush=True)
