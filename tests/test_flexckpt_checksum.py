"""Checksums of large buffers are hashed a piece at a time (the GIL is let go between
pieces) and equal xxh3-64 of the whole, whatever the buffer's type or element size."""
import numpy as np
import pytest
import torch
import xxhash

from flexckpt.checksum import PIECE, checksum, checksum_int
from flexckpt.tier.inventory import pack, unpack
from flexckpt.tier.transport import digest


@pytest.mark.parametrize("n", [0, 7, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 12345])
def test_piecewise_checksum_equals_xxh3_of_the_whole(n):
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = xxhash.xxh3_64_intdigest(raw)
    assert checksum_int(raw) == checksum_int(memoryview(raw)) == digest(np.frombuffer(raw, np.uint8)) == want
    assert checksum(bytearray(raw)) == format(want, "016x")
    floats = torch.frombuffer(bytearray(raw[: n // 4 * 4]), dtype=torch.float32) if n >= 4 else torch.zeros(0)
    assert checksum(memoryview(floats.numpy())) == format(xxhash.xxh3_64_intdigest(floats.numpy().tobytes()), "016x")


def test_a_packed_copy_unpacks_to_the_same_marker_and_bytes():
    data = torch.arange(300_000, dtype=torch.float32)
    files = [memoryview(data.numpy()), b"table", b""]
    doc = {"step": 3, "files": {"a.data": [data.numel() * 4, checksum(files[0])], "a.table": [5, checksum(b"table")],
                                "a.values": [0, checksum(b"")]}}
    payload = pack(doc, files)
    assert payload.dtype == np.uint8 and payload.flags.writeable  # a tensor can wrap it for a send
    got, parts = unpack(payload)
    assert got == doc and [rel for rel, _ in parts] == ["a.data", "a.table", "a.values"]
    assert [bytes(v) for _, v in parts] == [data.numpy().tobytes(), b"table", b""]
