"""Untrusted checkpoints (issue 11, defects 9 and 10) on both manifest versions the library
reads: each damage the issue found gives flexckpt's own error (the CLI reports it, no
traceback) and bounded work; then the fuzzer (``helpers/manifest_fuzz.py``) over mutated real
checkpoints, v1 and v2 manifests, v2 chunk tables and data files."""
import contextlib
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import orjson
import pytest
import torch

from flexckpt import ByLane, Checkpointer, CheckpointError, ManifestError
from flexckpt.catalog import read_manifest
from flexckpt.cli import main as cli
from flexckpt.errors import MissingFile, TooLarge, TruncatedFile
from flexckpt.format.jsondoc import SEAL_FIELD, seal, unseal
from flexckpt.format.manifest import MAX_MANIFEST_BYTES
from flexckpt.storage import Storage
from flexshard import HybridShard, Shard, ShardedTensor
from manifest_edit import set_at

DATA = Path(__file__).resolve().parents[1] / "data" / "v1"
HERE = Path(__file__).resolve().parents[1]
DEEP = b"[" * 1010 + b"1" + b"]" * 1010
DEEP_TREE = b'["l",[' * 150 + b"0" + b"]]" * 150  # containers 150 levels deep (deeper than orjson writes)
# with zephon_state/test_bad_input.py's cursor fuzzer (2,000) and compressed-source fuzzer (300): 10,300 cases a run
FUZZ_CASES = 8000
FUZZ_PROCESSES = 2 if (os.cpu_count() or 1) >= 2 else 1  # the suite runs one test at a time: use a second core


def _v1(tmp_path):
    root = tmp_path / "v1"
    shutil.copytree(DATA / "zstd", root)
    return root


def _v2(tmp_path):
    root = tmp_path / "v2"
    with Checkpointer(str(root), run_id="bad", chunk_bytes=256, compression="zstd") as ck:
        ck.save(3, {"w": torch.arange(300.0), "lanes": ByLane({"0": {"doc": 1}}), "k": 3}).result(timeout=30)
    return root


def _v2_hybrid(tmp_path):
    root = tmp_path / "v2h"
    cks = [Checkpointer(str(root), rank=r, world_size=2, run_id="bad", chunk_bytes=256) for r in range(2)]
    handles = [ck.save(3, {"e": ShardedTensor.from_global(torch.ones(40, 2), HybridShard(1), r, 2), "c": torch.ones(())})
               for r, ck in enumerate(cks)]
    for h, ck in zip(handles, cks):
        h.result(timeout=30)
        ck.close()
    return root


def _v2_bytes(tmp_path):
    root = tmp_path / "v2b"
    with Checkpointer(str(root), run_id="bad", chunk_bytes=256) as ck:
        ck.save(3, {"w": torch.arange(300.0), "blob": b"x" * 50}).result(timeout=30)
    return root


def _edit(root, edit):
    (path,) = glob.glob(f"{root}/step-*/manifest.json")
    doc = orjson.loads(Path(path).read_bytes())
    sealed = doc.pop(SEAL_FIELD, None) is not None
    edit(doc)
    data = orjson.dumps(doc).replace(b'"DEEP"', DEEP).replace(b'"DEEPTREE"', DEEP_TREE)
    # the checksum recomputed, as an attacker would: the validator below must still catch it
    Path(path).write_bytes(seal(data) if sealed else data)


def _run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli([str(a) for a in argv])
    return rc, out.getvalue()


V1_BLOCK = ("tensors", "t/block")
CASES = {
    "file name a list": (_v1, set_at(V1_BLOCK + ("pieces", 0, 0), ["x"]), r"piece 0 names file \['x'\]"),
    "no pieces": (_v1, set_at(V1_BLOCK + ("pieces",), []), r"pieces do not cover its 210 elements exactly once"),
    "int 1,010 lists deep": (_v1, set_at(V1_BLOCK + ("pieces", 0, 1), "DEEP"), r"start must be an int .* got \[\[\[\["),
    "time 1e20 (v1)": (_v1, set_at(("time",), 1e20), r"time 1e\+20 is not seconds since 1970"),
    "time 1e20 (v2)": (_v2, set_at(("time",), 1e20), r"time 1e\+20 is not seconds since 1970"),
    "2**30 elements, pieces not covering (v1)": (_v1, set_at(V1_BLOCK + ("shape",), [2**30]),
                                                 r"pieces do not cover its 1073741824 elements"),
    # found by the fuzzer once it drew its own cases: RecursionError from repr in these messages
    "run id 1,010 lists deep": (_v1, set_at(("run_id",), "DEEP"), r"run id must match .*, got \[\[\[\["),
    "rank entry 1,010 lists deep (v2)": (_v2, set_at(("ranks", 0), "DEEP"), r"rank 0 entry must be .*, got \[\[\[\["),
    "bytes value entry 1,010 lists deep (v2)": (_v2_bytes, set_at(("keyed", "blob"), "DEEP"),
                                                r"bytes value 'blob' must be .*, got \[\[\[\["),
    # JSON equal to a valid value but of another type: never taken for the value a load kept
    "a dimension true or 300.0 (v2)": (_v2, set_at(("tensors", "w", "shape"), [True, 300.0]),
                                       r"tensor 'w' dimension must be an int in \[0, \d+\], got True"),
    "an owner true (v2)": (_v2, set_at(("tensors", "w", "layout"), {"kind": "owned", "owner": True}),
                           r"tensor 'w': layout field 'owner' must be an int, got True"),
    # found by the fuzzer once its state had a hybrid-sharded tensor: OverflowError from planning
    "hybrid block of 2**62 (v2)": (_v2_hybrid, set_at(("tensors", "e", "layout", "block_size"), 2**62),
                                   r"invalid checkpoint manifest .*: Python int too large"),
    # the container tree of version 4: shapes, tags, keys, depth and counts checked before use
    "tree 1,010 lists deep": (_v2, set_at(("tree",), "DEEP"), r"container tree is malformed: its root must be a dict"),
    "tree key 1,010 lists deep": (_v2, set_at(("tree", 1, 0), "DEEP"), r"dict key list is repeated, or not"),
    "tree key true": (_v2, set_at(("tree", 1, 0), True), r"dict key bool is repeated, or not"),
    "tree key repeated": (_v2, set_at(("tree", 1), ["w", "w", "k"]), r"dict key 'w' is repeated"),
    "tree keys without kids": (_v2, set_at(("tree", 2), [0]), r"a dict node has 3 keys and 1 values"),
    "tree tag unknown": (_v2, set_at(("tree", 2, 2), ["set", [0]]), r"a container node must be .* \(tag 'set'\)"),
    "tree 150 lists deep": (_v2, set_at(("tree", 2, 2), "DEEPTREE"), r"containers nested deeper than 100 levels"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_damage_the_issue_found_is_flexckpts_own_error_in_every_command(tmp_path, case):
    make, edit, message = CASES[case]
    root = make(tmp_path)
    _edit(root, edit)
    with pytest.raises(ManifestError, match=message):
        read_manifest(Storage(str(root)), 3)
    # before the fix: TypeError, ValueError, RecursionError or OverflowError tracebacks
    assert _run("steps", root)[0] == 1 and "DAMAGED" in _run("steps", root)[1]
    assert _run("verify", root)[0] == 1
    for argv in (("inspect", root, "--tensors"), ("plan", root, "--world", 3)):
        rc, out = _run(*argv)
        assert rc == 2 and out.startswith("flexckpt: invalid checkpoint manifest"), out


def _v2_alike(tmp_path):
    root = tmp_path / "v2a"  # six tensors of one dtype, shape and layout: the entry a manifest repeats
    with Checkpointer(str(root), run_id="bad", chunk_bytes=256) as ck:
        ck.save(3, {f"w{i}": ShardedTensor.from_global(torch.ones(1, 4), Shard(0), 0, 1) for i in range(6)}).result(timeout=30)
    return root


ALIKE = {  # entries changed to JSON equal (==) to the other tensors' but of another type; the first bad one named
    "a dimension true": ([("w3", "shape", [True, 4])], r"tensor 'w3' dimension must be an int in \[0, \d+\], got True"),
    "a dimension 4.0": ([("w0", "shape", [1, 4.0])], r"tensor 'w0' dimension must be an int in \[0, \d+\], got 4.0"),
    "a layout dim false": ([("w5", "layout", {"kind": "shard", "dim": False})],
                           r"tensor 'w5': layout field 'dim' must be an int, got False"),
    "two, the later first": ([("w4", "dtype", "float99"), ("w2", "layout", {"kind": "shard", "dim": 0.0})],
                             r"tensor 'w2': layout field 'dim' must be an int, got 0.0"),
}


@pytest.mark.parametrize("case", sorted(ALIKE))
def test_a_tensor_whose_entry_only_equals_the_others_in_json_is_named_and_refused(tmp_path, case):
    # the parse checks each distinct entry once (issue 29): a bool or a float for an int is another entry
    root = _v2_alike(tmp_path)
    m = read_manifest(Storage(str(root)), 3)
    assert {(t.dtype, t.shape, t.layout) for t in m.tensors.values()} == {(torch.float32, (1, 4), Shard(0))}
    edits, message = ALIKE[case]
    _edit(root, lambda doc: [doc["tensors"][name].__setitem__(field, value) for name, field, value in edits])
    with pytest.raises(ManifestError, match=message):
        read_manifest(Storage(str(root)), 3)


@pytest.mark.parametrize("make", [_v1, _v2])
def test_inspect_lists_a_non_ascii_digit_lane_key(tmp_path, make):
    root = make(tmp_path)
    _edit(root, lambda doc: doc["lanes"].setdefault("lanes", {}).__setitem__("²", {"doc": 1}))
    rc, out = _run("inspect", root)
    assert rc == 0 and "²" in out  # before: ValueError from int("²")


def test_a_2kb_v2_manifest_with_shape_2_30_does_not_drive_plan_or_verify_to_gigabytes(tmp_path):
    root = _v2(tmp_path)
    _edit(root, set_at(("tensors", "w", "shape"), [2**30]))
    assert os.path.getsize(glob.glob(f"{root}/step-*/manifest.json")[0]) < 2048
    tracemalloc.start()
    try:
        for argv in (("plan", root, "--world", 3), ("verify", root), ("inspect", root, "--tensors")):
            rc, out = _run(*argv)
            assert rc in (0, 1, 2), out
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "the plan gives rank 0 a stream of 4294967296 bytes, which" in _run("verify", root)[1]
    assert peak < 16 << 20, peak  # before the fix: 8.4 GB RSS from tuple(FlatRange) in an error message


@pytest.mark.parametrize("make", [_v1, _v2])
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_truncated_or_missing_data_is_reported_by_verify_and_raised_as_flexckpts_error_by_load(tmp_path, make, damage):
    root = make(tmp_path)
    data = sorted(glob.glob(f"{root}/step-*/**/*.data", recursive=True))[0]
    if damage == "truncated":
        os.truncate(data, 100)
    else:
        os.remove(data)
    rc, out = _run("verify", root)
    assert rc == 1 and "DAMAGED" in out
    assert ("is missing" if damage == "missing" else ("ends at byte" if make is _v1 else "is 100 bytes")) in out
    if make is _v2:
        with Checkpointer(str(root), run_id="reader") as ck:
            with pytest.raises((MissingFile, ManifestError) if damage == "missing" else ManifestError):
                ck.load({"w": torch.zeros(300), "lanes": ByLane(), "k": 0})
    else:
        storage = Storage(str(root))
        m = read_manifest(storage, 3)
        name = os.path.basename(data)
        with pytest.raises(MissingFile if damage == "missing" else TruncatedFile):
            with storage.open_reader(f"step-000000000003/{name}") as r:
                c = m.files[name].chunks[-1]
                r.read_into(c.offset, memoryview(bytearray(c.length)))


def test_a_manifest_over_the_cap_is_refused_before_it_is_read(tmp_path):
    root = _v2(tmp_path)
    (path,) = glob.glob(f"{root}/step-*/manifest.json")
    os.truncate(path, MAX_MANIFEST_BYTES + 1)  # sparse: nothing is written or read
    with pytest.raises(TooLarge, match=rf"more than the {MAX_MANIFEST_BYTES} allowed"):
        read_manifest(Storage(str(root)), 3)
    assert issubclass(TooLarge, CheckpointError)


@pytest.mark.timeout(240)
def test_fuzzed_manifests_tables_and_data_give_success_or_flexckpts_errors_within_memory_and_time(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE)] + sys.path))
    work = tmp_path
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):  # many small writes: keep them in memory
        work = Path(__import__("tempfile").mkdtemp(prefix="flexckpt-fuzz-", dir="/dev/shm"))
    shards, children = FUZZ_PROCESSES, []
    outs = [(tmp_path / f"fuzz{i}.out", tmp_path / f"fuzz{i}.err") for i in range(shards)]
    try:  # the cases split over processes side by side, each under its own memory cap
        for i, (out, err) in enumerate(outs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                children.append(subprocess.Popen(
                    [sys.executable, str(HERE / "helpers" / "manifest_fuzz.py"), str(work / str(i)), str(FUZZ_CASES),
                     "--shard", f"{i}/{shards}"], env=env, stdout=stdout, stderr=stderr))
        deadline = time.monotonic() + 220
        for child in children:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        if work != tmp_path:
            shutil.rmtree(work, ignore_errors=True)
    for child, (out, err) in zip(children, outs):
        assert child.returncode == 0, out.read_text()[-3000:] + err.read_text()[-6000:]
    counts = _sum([json.loads(out.read_text().strip().splitlines()[-1]) for out, _ in outs])
    print(f"manifest fuzzer: {counts}")
    assert counts["cases"] == FUZZ_CASES
    # past parsing into planning and reading, or the fuzzer tests only the parser
    assert counts["parsed"] >= 0.25 * FUZZ_CASES and counts["planned"] >= 0.25 * FUZZ_CASES, counts
    assert counts["loaded"] >= 0.05 * FUZZ_CASES and counts["unmutated_exact"] >= 1, counts
    assert counts["dict_loaded"] >= 0.02 * FUZZ_CASES and counts["dict_exact"] >= 1, counts
    assert set(counts["by_kind"]) >= {"json", "bytes", "table", "data", "data-missing", "values", "none"}, counts


def _sum(parts: list[dict]) -> dict:
    """The counts of the fuzzer's processes added up (figures that are not counts: the largest)."""
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                total[key] = _sum([total.get(key, {}), value])
            elif key in ("memory_cap_mib", "seconds"):
                total[key] = max(total.get(key, 0), value)
            else:
                total[key] = total.get(key, 0) + value
    return total


@pytest.mark.parametrize("edit", [(b'"k":3', b'"k":7'), (b'"shape":[300]', b'"shape":[200]'), (b'"doc":1', b'"doc":4')],
                         ids=["plain value", "shape", "lane cursor"])
def test_a_digit_edited_within_range_fails_the_manifest_checksum(tmp_path, edit):
    # before the checksum: "k": 7 loaded as 7, and a cursor edited the same way replayed other data
    root = _v2(tmp_path)
    (path,) = glob.glob(f"{root}/step-*/manifest.json")
    data = Path(path).read_bytes()
    assert data.count(edit[0]) == 1
    edited = data.replace(*edit)
    assert read_manifest(Storage(str(root)), 3).sealed and unseal(data)[1]
    Path(path).write_bytes(edited)
    with pytest.raises(ManifestError, match="manifest is damaged or was edited"):
        read_manifest(Storage(str(root)), 3)
    with Checkpointer(str(root), run_id="reader") as ck:
        with pytest.raises(ManifestError, match="its checksum is [0-9a-f]{16}, the manifest_checksum it records is"):
            ck.load({"w": torch.zeros(300), "lanes": ByLane(), "k": 0})
    rc, out = _run("verify", root)
    assert rc == 1 and "DAMAGED manifest" in out and "manifest_checksum" in out, out


def test_verify_reports_the_manifest_checksum_and_an_older_manifest_without_one_still_loads(tmp_path):
    rc, out = _run("verify", _v2(tmp_path))
    assert rc == 0 and "manifest checksum ok, ok" in out, out
    root = _v1(tmp_path)
    rc, out = _run("verify", root)
    assert rc == 0 and "manifest has no checksum" in out, out
    assert not read_manifest(Storage(str(root)), 3).sealed
    # a checksum moved out of first place (the document was rewritten) is refused, not ignored
    (path,) = glob.glob(f"{root}/step-*/manifest.json")
    doc = orjson.loads(Path(path).read_bytes())
    doc["manifest_checksum"] = "0" * 16
    Path(path).write_bytes(orjson.dumps(doc))
    with pytest.raises(ManifestError, match="manifest_checksum is not the document's first field"):
        read_manifest(Storage(str(root)), 3)
