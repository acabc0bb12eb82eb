"""Checksums equal xxh3-64 of the whole buffer (and a digest streamed in pieces), whatever
the buffer's type, size or element size; a
fast-tier copy's files are checked against its marker and chunk table."""
import numpy as np
import pytest
import torch
import xxhash

from flexckpt.format.checksum import checksum, checksum_int
from flexckpt.tier.inventory import check_copy, file_lengths
from flexckpt.tier.transport import digest

PIECE = 1 << 20


@pytest.mark.parametrize("n", [0, 7, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 12345])
def test_checksum_equals_xxh3_of_the_whole_and_streamed_in_pieces(n):
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = xxhash.xxh3_64_intdigest(raw)
    streamed = xxhash.xxh3_64()
    for i in range(0, n, PIECE):
        streamed.update(raw[i : i + PIECE])
    assert streamed.intdigest() == want  # the digest written before checksums were one call
    assert checksum_int(raw) == checksum_int(memoryview(raw)) == digest(np.frombuffer(raw, np.uint8)) == want
    assert checksum(bytearray(raw)) == format(want, "016x")
    floats = torch.frombuffer(bytearray(raw[: n // 4 * 4]), dtype=torch.float32) if n >= 4 else torch.zeros(0)
    assert checksum(memoryview(floats.numpy())) == format(xxhash.xxh3_64_intdigest(floats.numpy().tobytes()), "016x")


def _copy(nbytes: int = 3 * PIECE + 100, chunk: int = PIECE):
    """A saved rank's files as a fast save writes them (data, table, values), and its marker."""
    from flexckpt.format.manifest import StoredChunk
    from flexckpt.format.names import data_name, table_name, values_name
    from flexckpt.save.writer import table_bytes, values_bytes

    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    chunks = [StoredChunk(o, min(chunk, nbytes - o), o, min(chunk, nbytes - o), "none",
                          checksum(data[o : o + chunk])) for o in range(0, nbytes, chunk)]
    attempt = "s.1"
    table = table_bytes(rank=2, attempt=attempt, codec="none", chunks=chunks)
    values = values_bytes({"rng": b'{"seed":3}'})
    files = {data_name(attempt, 2): data, table_name(attempt, 2): table, values_name(attempt, 2): values}
    doc = {"step": 7, "rank": 2, "attempt": attempt, "chunks": len(chunks),
           "line": ["fp", checksum(table), len(table), nbytes, checksum(values), len(values)],
           "files": {rel: memoryview(b).nbytes for rel, b in files.items()}}
    return doc, files


def test_a_received_copy_is_checked_file_by_file_against_its_marker_and_table():
    doc, files = _copy()
    check_copy(doc, list(files.items()))  # every byte hashed once: table, values, each data chunk
    for rel in files:  # one flipped byte in any file, anywhere, is caught and named
        for at in (0, memoryview(files[rel]).nbytes - 1):
            bad = {r: np.frombuffer(b, np.uint8).copy() for r, b in files.items()}
            bad[rel][at] ^= 1
            kind = {"data": "data chunk at byte", "table": "chunk table", "values": "per-rank values"}[rel.rsplit(".", 1)[1]]
            with pytest.raises(ValueError, match=kind):
                check_copy(doc, list(bad.items()))
    short = {r: b[:-1] if r.endswith(".data") else b for r, b in files.items()}
    with pytest.raises(ValueError, match=f"data file is {3 * PIECE + 99} bytes, its marker says {3 * PIECE + 100}"):
        check_copy(doc, list(short.items()))
    with pytest.raises(ValueError, match="chunk table"):  # a table that is not the one the marker names
        check_copy(doc, [(r, b) for r, b in files.items() if not r.endswith(".table")])


def test_marker_file_lengths_read_old_markers_with_a_checksum_and_refuse_bad_ones():
    doc, files = _copy()
    assert file_lengths(doc) == {rel: memoryview(b).nbytes for rel, b in files.items()}
    old = dict(doc, files={rel: [n, "0123456789abcdef"] for rel, n in doc["files"].items()})  # before it was dropped
    assert file_lengths(old) == file_lengths(doc) and list(file_lengths(old)) == list(files)
    with pytest.raises(ValueError, match=r"file 'x' has length -1; expected a non-negative int"):
        file_lengths(dict(doc, files={"x": -1}))
