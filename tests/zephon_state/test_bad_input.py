"""zephon_state under bad input (issue 11, defects 13 and 14): empty documents, absurd or
malformed cursors, damaged compressed sources; and a fuzzer over lane cursors."""
import copy
import gzip
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import zstandard

from zephon_state import ConfigError, InMemory, IoOptions, JsonLines, Mix, Pipeline, SourceError, StateError, TextFiles

CORPUS = Path(__file__).resolve().parents[2] / "src" / "flextrain" / "corpus"
PROSE, CODE = str(CORPUS / "kjv.jsonl.zst"), str(CORPUS / "python_stdlib.jsonl.zst")


def _kjv_raw() -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(Path(PROSE).read_bytes(), read_across_frames=True).read()


def _small(source, *, lanes=2, algorithm="wrap", max_length=32):
    return (Pipeline(source).tokenize().pack_flat(max_length, algorithm=algorithm).shuffle(4, seed=3)
            .batch(2).lanes(lanes))


# ---- defect 13: read-ahead over empty documents, absurd cursors --------------------------


def test_a_source_of_only_empty_documents_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"source 'memory' has 50 documents but every one is empty"):
        next(iter(_small([""] * 50)))


@pytest.mark.timeout(60)
def test_mostly_empty_documents_still_make_progress():
    # Before the fix, read-ahead counted bytes only: a chunk of empty documents added 0 and the
    # lane submitted chunks without end (RSS grew ~14 MB/s).
    texts = [""] * 300 + ["In the beginning God created the heaven and the earth."] * 2
    with _small(texts) as p:
        batches = list(itertools.islice(p, 3))
    assert [b.input_ids.shape for b in batches] == [(2, 32)] * 3


def _state_and_pipeline(algorithm="wrap"):
    with _small(PROSE, algorithm=algorithm) as p:
        list(itertools.islice(p, 3))
        return p.state_dict()


def test_a_cursor_with_an_absurd_window_is_refused_naming_the_field():
    state = _state_and_pipeline()
    state["lanes"]["0"]["window"] = 10**12
    with _small(PROSE) as p, pytest.raises(StateError, match=r"lane 0 is invalid: 'sources\[0\]\.tokens' is \d+, but at the start of window 1000000000000"):
        p.load_state_dict(state)


# ---- defect 14: malformed cursor fields ----------------------------------------------------


@pytest.mark.parametrize("algorithm", ["wrap", "best_fit"])
def test_a_cursor_with_tokens_off_its_quota_is_refused_naming_the_field(algorithm):
    state = _state_and_pipeline(algorithm)
    # wrap: was numpy's "cannot reshape array of size 251 into shape (7,32)" from the producer
    state["lanes"]["1"]["sources"][0][3] += 40
    with _small(PROSE, algorithm=algorithm) as p, pytest.raises(StateError, match=r"lane 1 is invalid: 'sources\[0\]\.tokens' is"):
        p.load_state_dict(state)


def test_lane_keys_must_be_canonical_decimal_strings():
    state = _state_and_pipeline()
    for key in ("01", "\u00b2", " 1", "+1", "1" * 5000):
        bad = copy.deepcopy(state)
        bad["lanes"][key] = bad["lanes"].pop("1")
        with _small(PROSE) as p, pytest.raises(StateError, match=r"the state names lanes .*lane keys are decimal strings without leading zeros, '0' to '1'"):
            p.load_state_dict(bad)


@pytest.mark.parametrize("path, value, field", [
    (("sources", 0, 0), 2**70, r"'sources\[0\]\.epoch' must be an int in \[0, 2\*\*53\), got 1180591620717411303424"),
    (("sources", 0, 0), 5, r"'sources\[0\]\.tokens' is \d+, but its epoch 5, index \d+ and offset \d+ mean at least"),
    (("sources", 0, 1), 10**6, r"'sources\[0\]\.index' is 1000000, but the lane's share of the source has 520 documents"),
    (("sources", 0, 2), 1.5, r"'sources\[0\]\.offset' must be an int in \[0, 2\*\*53\), got 1.5"),
    (("emitted",), 4, r"'emitted' is 4, but a window has 4 rows"),
    (("sequences",), 1, r"'sequences' is 1, but window \d+ and emitted \d+ make it"),
    (("window",), True, r"'window' must be an int in \[0, 2\*\*53\), got True"),
    (("extra",), 0, r"its keys are \['emitted', 'extra', 'sequences', 'sources', 'version', 'window'\], expected"),
    (("version",), 3, r"'version' is 3; this pipeline reads cursor versions 1 and 2"),
    (("sources", 0, 4), 7, r"'sources\[0\]' resumes at char 7, token 0, but a resume point is both 0"),
    (("sources", 0, 5), 10**9, r"'sources\[0\]' resumes at char 0, token 1000000000, but a resume point is both 0 "
                              r"\(the document start\) or both positive with the token at most offset"),
])
def test_an_out_of_range_or_malformed_cursor_field_is_refused_naming_it(path, value, field):
    state = _state_and_pipeline()
    target = state["lanes"]["0"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with _small(PROSE) as p, pytest.raises(StateError, match=r"cursor of lane 0 is invalid: " + field):
        p.load_state_dict(state)


def test_malformed_phases_are_refused():
    state = _state_and_pipeline()
    state["phases"] = 5
    with _small(PROSE) as p, pytest.raises(StateError, match=r"'phases' must be a list of"):
        p.load_state_dict(state)


# ---- defect 14: damaged sources ------------------------------------------------------------


def test_a_truncated_zstd_source_fails_naming_file_and_byte_offset(tmp_path):
    # Before the fix: 477 of 1,039 documents, one invalid_json counted, and training went on.
    data = Path(PROSE).read_bytes()
    cut = tmp_path / "kjv.jsonl.zst"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceError, match=rf"source file '{cut}' is truncated: its zstd frame starting at byte 0 is cut off at byte {len(data) // 2}, the end"):
        JsonLines(str(cut)).load("text", IoOptions(), "count")


def test_a_truncated_gzip_member_after_a_whole_one_fails_naming_where_it_starts(tmp_path):
    raw = _kjv_raw()
    first, second = gzip.compress(raw[:100_000]), gzip.compress(raw[100_000:])
    path = tmp_path / "kjv.jsonl.gz"
    path.write_bytes(first + second[:5000])
    with pytest.raises(SourceError, match=rf"truncated: its gzip frame starting at byte {len(first)} is cut off at byte {len(first) + 5000}"):
        JsonLines(str(path)).load("text", IoOptions(), "count")
    path.write_bytes(first + second)  # both members whole: every document, as before
    assert len(JsonLines(str(path)).load("text", IoOptions(), "raise")) == 1039


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_garbage_compressed_sources_fail_naming_file_and_bytes(tmp_path, suffix):
    path = tmp_path / f"notes.txt{suffix}"
    path.write_bytes(b"this is not compressed at all\n" * 10)
    codec = "zstd" if suffix == ".zst" else "gzip"
    with pytest.raises(SourceError, match=rf"source file '{path}' is damaged: its {codec} frame starting at byte 0 fails between bytes 0 and 300 of 300"):
        TextFiles(str(path)).load("text", IoOptions(), "count")


_RECORDS = b"".join(orjson.dumps({"text": f"verse {i}: " + "and it was so. " * (i % 7)}) + b"\n" for i in range(60))
_COMPRESSED = {".zst": zstandard.ZstdCompressor(write_checksum=True).compress(_RECORDS), ".gz": gzip.compress(_RECORDS)}


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_fuzzed_compressed_sources_load_or_raise_source_errors(tmp_path_factory, suffix):
    """Cut, flipped and spliced bytes: every truncation inside the stream is a SourceError;
    any other outcome is documents or a zephon_state error, never a foreign exception."""
    from hypothesis import given, settings, strategies as st

    from zephon_state import ZephonError

    good = _COMPRESSED[suffix]
    folder = tmp_path_factory.mktemp("fuzz")
    seen = {"cases": 0, "docs": 0, "source_error": 0, "other_zephon_error": 0}

    @settings(max_examples=150, derandomize=True, deadline=None, database=None)
    @given(cut=st.integers(1, len(good) - 1), flips=st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)), max_size=3),
           mode=st.sampled_from(["cut", "flip", "splice"]))
    def case(cut, flips, mode):
        data = bytearray(good)
        if mode == "cut":
            data = data[:cut]
        elif mode == "flip":
            for at, mask in flips:
                data[at] ^= mask
        else:
            data = data[:cut] + bytes(mask for _, mask in flips) + data[cut:]
        path = folder / f"case{suffix}"
        path.write_bytes(bytes(data))
        seen["cases"] += 1
        try:
            docs = JsonLines(str(path)).load("text", IoOptions(), "count")
            seen["docs"] += 1
        except SourceError as e:
            assert str(path) in str(e) and "byte" in str(e)
            seen["source_error"] += 1
            return
        except ZephonError:
            seen["other_zephon_error"] += 1
            return
        assert mode != "cut", f"a stream cut at byte {cut} of {len(good)} loaded {len(docs)} documents"

    case()
    print(f"compressed-source fuzz {suffix}: {seen}")
    assert seen["source_error"] >= 50


# ---- the cursor fuzzer ---------------------------------------------------------------------

FUZZ_CASES = 2000
FUZZ_PROCESSES = 2 if (os.cpu_count() or 1) >= 2 else 1  # the suite runs one test at a time: use a second core
FUZZ_RSS_CAP = 2 << 30  # each
FUZZ_TIME_S = 150


@pytest.mark.timeout(FUZZ_TIME_S + 30)
def test_fuzzed_cursors_load_and_run_or_raise_zephon_errors_within_memory_and_time():
    """Runs ``_fuzz`` in children side by side (a share of the cases each), watched for RSS
    and time (a case that hangs or balloons is a failure too; each child's progress file
    names its last case)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        children, peak, start = [], 0, time.monotonic()
        try:
            for i in range(FUZZ_PROCESSES):
                with open(Path(tmp) / f"out{i}", "w") as out:
                    children.append(subprocess.Popen(
                        [sys.executable, __file__, "--fuzz", str(Path(tmp) / f"progress{i}"),
                         "--shard", f"{i}/{FUZZ_PROCESSES}"], env=env, stdout=out, stderr=subprocess.STDOUT))
            while any(child.poll() is None for child in children):
                peak = max([peak] + [_rss(child.pid) for child in children if child.poll() is None])
                if peak > FUZZ_RSS_CAP or time.monotonic() - start > FUZZ_TIME_S:
                    for child in children:
                        child.kill()
                        child.wait()
                    last = [(Path(tmp) / f"progress{i}").read_text().rstrip() if (Path(tmp) / f"progress{i}").exists()
                            else "(none)" for i in range(FUZZ_PROCESSES)]
                    pytest.fail(f"a fuzz child exceeded {FUZZ_RSS_CAP >> 20} MiB or {FUZZ_TIME_S} s "
                                f"(peak {peak >> 20} MiB); last cases: {last}")
                time.sleep(0.05)
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        outs = [(Path(tmp) / f"out{i}").read_text() for i in range(FUZZ_PROCESSES)]
    for child, out in zip(children, outs):
        assert child.returncode == 0, out[-6000:]
    parts = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    stats = {key: sum(part[key] for part in parts) for key in parts[0]}
    print(f"cursor fuzz: {stats}, peak RSS {peak >> 20} MiB")  # figures for the closing note
    assert stats["cases"] >= FUZZ_CASES
    assert stats["loaded"] / stats["cases"] >= 0.25, stats  # else it fuzzes only the parser
    assert stats["batches"] >= 0.2 * stats["cases"], stats


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_CHARS = "0123456789 abxyz-_.,:\\\"\x00\n\u00b2\u0660\u00e9\u4e00\U0001f600"
_INTS = [0, 1, 2, 3, -1, -2, 2**31, 2**32, 2**53 - 1, 2**53, 2**63, 10**12, 2**70, -(2**70)]
_FLOATS = [0.0, -0.0, 0.5, 1.0, 3.0, 1e-300, 1e300, float("inf"), float("-inf"), float("nan")]


def _text(rng: random.Random, max_size: int) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, max_size)))


def _int(rng: random.Random) -> int:
    pick = rng.randrange(3)
    return rng.choice(_INTS) if pick == 0 else rng.randint(-3, 300) if pick == 1 else rng.randint(-2**70, 2**70)


def _json_value(rng: random.Random, leaves: int = 12):
    """A JSON-like value: a leaf (null, bool, int, float, short text), or lists and dicts of
    such values, nested, with at most ``leaves`` leaves."""
    budget = [leaves]

    def value(depth: int):
        if depth < 4 and budget[0] > 1 and rng.random() < 0.25:
            n = rng.randint(0, 4)
            if rng.random() < 0.5:
                return [value(depth + 1) for _ in range(n)]
            return {_text(rng, 6): value(depth + 1) for _ in range(n)}
        budget[0] -= 1
        kind = rng.randrange(5)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return _int(rng)
        if kind == 2:
            return rng.choice(_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
        return _text(rng, 8)

    return value(0)


def _fuzz(progress: Path, cases: int = FUZZ_CASES, seed: int = 0, only: int | None = None,
          shard: tuple[int, int] = (0, 1)) -> dict:
    """Mutate real states (wrap and best_fit, several points of a run), load each into a live
    pipeline, take a batch: the outcome must be a batch or a ``ZephonError``; an unmutated
    state must give exactly the batch the run gave. Each case draws from its own
    ``random.Random`` (seed, case number), so one case replays alone (``--case N``);
    hypothesis's engine cost half of each case's time here. ``shard`` (I, N): cases I, I+N,
    I+2N ... of ``cases``."""
    from zephon_state import ZephonError

    # Short documents (verses, code lines of the shipped corpora) keep each case's tokenizing cheap.
    verses = [v for line in _kjv_raw().splitlines()[:60] for v in orjson.loads(line)["text"].split("\n") if v.strip()]
    code = zstandard.ZstdDecompressor().stream_reader(Path(CODE).read_bytes(), read_across_frames=True).read()
    code_lines = [c for c in orjson.loads(code.split(b"\n", 1)[0])["text"].splitlines() if c.strip()][:400]
    mix = Mix({"prose": InMemory(verses[:400]), "code": InMemory(code_lines, name="code")}, {"prose": 0.7, "code": 0.3})

    def build(algorithm):  # rank 0 of 2 hosts lanes 0 and 1 of 4; two rows per step from each
        return (_small(mix, lanes=4, algorithm=algorithm, max_length=16).batch(2, global_batch_size=8)
                .data_parallel(0, 2).options(prefetch=1, readahead_windows=0))

    runs = {}
    for algorithm in ("wrap", "best_fit"):
        with build(algorithm) as p:
            saved = []
            for _ in range(4):
                state = p.state_dict()
                batch = next(p)
                saved.append((orjson.dumps(state), batch.input_ids.tobytes()))
                list(itertools.islice(p, 3))
        runs[algorithm] = (build(algorithm), saved)

    counts = {"cases": 0, "loaded": 0, "batches": 0, "zephon_errors": 0, "unchanged_exact": 0}

    def mutate(rng, state):
        kind = rng.choice(
            ["none", "none", "v1", "row", "offset", "index", "char", "base", "resume", "delta", "any_int", "json",
             "drop", "add", "lane_key", "top"]
        )
        lanes = state["lanes"]
        lane = rng.choice(sorted(lanes))
        cursor = lanes[lane]
        spots = [(cursor, k) for k in ("window", "emitted", "sequences")]
        spots += [(src, i) for src in cursor["sources"] for i in range(len(src))]
        holder, key = rng.choice(spots)
        delta = rng.randint(-3, 3)
        if kind == "row":  # another row of the window: in range, so only the run can tell
            cursor["emitted"] += delta
            cursor["sequences"] += delta
        elif kind == "v1":  # the same cursor as version 1 wrote it: must give the same batch
            for c in lanes.values():
                del c["version"]
                c["sources"] = [src[:4] for src in c["sources"]]
        elif kind in ("offset", "index", "char", "base"):
            source = rng.choice(cursor["sources"])
            source[{"index": 1, "offset": 2, "char": 4, "base": 5}[kind]] += delta
        elif kind == "resume":  # a resume point inside the document, plausible in range
            source = rng.choice(cursor["sources"])
            source[5] = rng.randint(1, max(1, source[2]))
            source[4] = rng.randint(1, 4 * source[5])
        elif kind == "delta":
            holder[key] += delta
        elif kind == "any_int":
            holder[key] = _int(rng)
        elif kind == "json":
            holder[key] = _json_value(rng)
        elif kind == "drop":
            del cursor[rng.choice(sorted(cursor))]
        elif kind == "add":
            cursor[_text(rng, 6)] = _json_value(rng)
        elif kind == "lane_key":
            key = rng.choice(["01", "\u00b2", "-1", "4", "1.0", " 0"]) if rng.random() < 0.5 else _text(rng, 4)
            lanes[key] = lanes.pop(lane)
        elif kind == "top":
            state[rng.choice(["format", "fingerprint", "lanes", "phases", "plan"])] = _json_value(rng)
        return kind

    fd = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # the last case, for the watcher
    for number in range(shard[0], cases, shard[1]) if only is None else [only]:
        rng = random.Random(seed * 1_000_003 + number)
        algorithm = rng.choice(["wrap", "best_fit"])
        point = rng.randrange(4)
        pipeline, saved = runs[algorithm]
        state, expected = orjson.loads(saved[point][0]), saved[point][1]  # a fresh copy to mutate
        kind = mutate(rng, state)
        note = f"case {number} of seed {seed} ({kind}; replay: {__file__} --fuzz FILE --seed {seed} --case {number}): "
        os.pwrite(fd, (note + repr(state))[:4000].encode().ljust(16400), 0)  # one size: no truncating
        counts["cases"] += 1
        try:
            pipeline.load_state_dict(state)
            counts["loaded"] += 1
            batch = next(pipeline)
            counts["batches"] += 1
        except ZephonError:
            counts["zephon_errors"] += 1
            continue
        except BaseException:
            print(note + "failed", flush=True)
            raise
        if kind in ("none", "v1"):
            assert batch.input_ids.tobytes() == expected, note + "an unmutated state gave another batch"
            counts["unchanged_exact"] += 1
    os.close(fd)
    for pipeline, _ in runs.values():
        pipeline.close()
    return counts


if __name__ == "__main__" and sys.argv[1:2] == ["--fuzz"]:
    import argparse

    given = argparse.ArgumentParser()
    given.add_argument("--fuzz", type=Path, required=True, help="the progress file")
    given.add_argument("--cases", type=int, default=FUZZ_CASES)
    given.add_argument("--seed", type=int, default=0)
    given.add_argument("--case", type=int, default=None, help="replay this case alone")
    given.add_argument("--shard", default="0/1", help="I/N: cases I, I+N, I+2N ...")
    args = given.parse_args()
    print(json.dumps(_fuzz(args.fuzz, args.cases, args.seed, args.case, tuple(map(int, args.shard.split("/"))))))
