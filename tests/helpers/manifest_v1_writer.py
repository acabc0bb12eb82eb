"""Version-1 checkpoints written for tests. flexckpt reads format version 1 (the manifest
lists every piece of every tensor and every chunk of every file) but writes only version 2
and later; the tests still write version 1, in memory, to check that the reader and the
read planner take it. A helper module: no tests of its own."""
from __future__ import annotations

import orjson
import torch
from hypothesis import strategies as st

from flexckpt.format.checksum import ALGORITHM, checksum
from flexckpt.format.jsondoc import seal
from flexckpt.format.manifest import FORMAT, FileEntry, Manifest, SavedPiece, SavedTensor, StoredChunk
from flexckpt.format.write_plan import make_write_plan
from flexckpt.state.structure import TensorSpec
from flexshard import BlockShard, Owned, Replicate, Shard

LAYOUTS = [Replicate(), Shard(0), Owned(0), BlockShard(4)]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float64]


def v1_manifest_bytes(manifest: Manifest) -> bytes:
    """``manifest`` (version 1: its files' chunks and its tensors' pieces listed) as the
    sealed document the version-1 writer wrote."""
    if manifest.version != 1:
        raise ValueError(f"manifest version {manifest.version} given to the version-1 writer; pass a version-1 manifest")
    doc = {
        "format": FORMAT,
        "version": 1,
        "checksum": ALGORITHM,
        "step": manifest.step,
        "run_id": manifest.run_id,
        "world_size": manifest.world_size,
        "time": manifest.time,
        "fingerprint": manifest.fingerprint,
        "files": {name: _file_json(f) for name, f in manifest.files.items()},
        "tensors": {name: _tensor_json(t) for name, t in manifest.tensors.items()},
        "plain": manifest.plain,
        "lanes": manifest.lanes,
        "per_rank": manifest.per_rank,
    }
    return seal(orjson.dumps(doc))


def _file_json(entry: FileEntry) -> dict:
    return {"nbytes": entry.nbytes, "chunks": [list(c) for c in entry.chunks]}


def _tensor_json(tensor: SavedTensor) -> dict:
    return {**tensor.to_json(), "pieces": [[p.file, p.start, p.stop, p.raw_offset] for p in tensor.pieces or ()]}


def random_specs(shapes: list[tuple[int, ...]], world: int) -> list[TensorSpec]:
    """Tensors of ``shapes``, their dtypes and layouts cycling through :data:`DTYPES` and
    :data:`LAYOUTS` (an owned tensor's owner a rank of ``world``)."""
    specs = []
    for i, shape in enumerate(shapes):
        layout = LAYOUTS[i % 4]
        if isinstance(layout, Owned):
            layout = Owned(i % world)
        specs.append(TensorSpec(f"t{i:03d}", DTYPES[i % len(DTYPES)], shape, layout))
    return specs


shapes_st = st.lists(
    st.one_of(st.just(()), st.tuples(st.integers(0, 70)), st.tuples(st.integers(0, 40), st.integers(0, 6))),
    min_size=1, max_size=12,
)


def save_in_memory(globals_: dict[str, torch.Tensor], specs: list[TensorSpec], world: int,
                   chunk: int) -> tuple[Manifest, dict[str, bytearray]]:
    """``globals_`` saved at ``world`` ranks by the write plan, in memory: each rank's raw
    stream (file ``r<rank>``, uncompressed) and the version-1 manifest listing its pieces
    and chunks."""
    plan = make_write_plan(specs, world, chunk)
    files, streams, pieces = {}, {}, {s.name: [] for s in plan.specs}
    for r, rp in enumerate(plan.ranks):
        stream = bytearray(rp.nbytes)
        for p in rp.pieces:
            spec = plan.specs[p.spec_index]
            flat = globals_[spec.name].reshape(-1)[p.start : p.stop].contiguous()
            stream[p.offset : p.offset + p.nbytes] = flat.view(torch.uint8).numpy().tobytes()
            pieces[spec.name].append(SavedPiece(f"r{r}", p.start, p.stop, p.offset))
        chunks = tuple(
            StoredChunk(c.offset, c.length, c.offset, c.length, "none", checksum(bytes(stream[c.offset : c.offset + c.length])))
            for c in rp.chunks
        )
        if rp.nbytes:
            files[f"r{r}"] = FileEntry(f"r{r}", rp.nbytes, chunks)
            streams[f"r{r}"] = stream
    tensors = {s.name: SavedTensor(s.name, s.dtype, s.shape, s.layout, tuple(pieces[s.name])) for s in plan.specs}
    return Manifest(1, "run", world, 0.0, "fp", files, tensors, {}, {}, {}), streams
