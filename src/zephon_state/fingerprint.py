"""The data fingerprint: everything that decides which tokens land in which global batch.

Sources and their order (content digests), tokenizer, seed and data phase, mix shares,
context length, packing algorithm, window (shuffle buffer size), bad-record policy, global
batch and lane count. Left out, because they decide no batch and may change between runs:
performance settings (workers, prefetch, readahead, data-parallel size) and the mix's
calibration, which only sizes how far ahead each source is tokenized (the shares are met
with exact token quotas, see ``mix.py``).
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Mapping

import orjson

from .errors import short

if TYPE_CHECKING:
    from .mixture import Mix, Plan
    from .tokenize import LoadedTokenizer

VERSION = 1

_FIX = {
    "sources": "read the same files, with the same content, in the same order",
    "shares": "use the saved Mix shares",
    "tokenizer": "use the saved tokenizer (tokenize(tokenizer_id=..., eos=...))",
    "seed": "pass the saved seed to .shuffle(seed=...)",
    "data_phase": "use the saved .options(data_phase=...)",
    "max_length": "pass the saved .pack_flat(max_length=...)",
    "packing": "pass the saved .pack_flat(algorithm=...)",
    "window": "use the saved shuffle buffer size (.shuffle(buffer_size=...)) or packing window",
    "shuffle": "configure .shuffle(...) as the saved run did",
    "bad_records": "use the saved .options(bad_records=...)",
    "global_batch": "pass the saved .batch(global_batch_size=...)",
    "lanes": "pass the saved .lanes(...)",
    "holdout": "use the saved .holdout(fraction=..., seed=..., side=...)",
    "version": "resume with the zephon_state version that wrote the checkpoint",
}


def plan_fields(
    mix: "Mix",
    plan: "Plan",
    field_name: str,
    tokenizer: "LoadedTokenizer",
    *,
    max_length: int,
    packing: str,
    window: int,
    shuffle: bool,
    bad_records: str,
    global_batch: int,
    lanes: int,
    data_phase: str,
) -> dict[str, Any]:
    """The fingerprinted values, as plain JSON."""
    return {
        "version": VERSION,
        "sources": [
            {"name": name, "kind": docs.kind, "field": source.text_field(field_name),
             "documents": len(docs), "sha256": docs.sha256}
            for name, docs, source in zip(plan.names, plan.documents, mix.sources.values())
        ],
        "shares": list(mix.weights()),
        "tokenizer": {"sha256": tokenizer.sha256, "eos": tokenizer.eos_id},
        "seed": plan.seed,
        "data_phase": data_phase,
        "max_length": max_length,
        "packing": packing,
        "window": window,
        "shuffle": shuffle,
        "bad_records": bad_records,
        "global_batch": global_batch,
        "lanes": lanes,
    }


def fingerprint(fields: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the fields as canonical JSON (sorted keys)."""
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _diff(saved: Any, now: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        for key in sorted(set(saved) | set(now), key=str):
            _diff(saved.get(key), now.get(key), f"{path}.{key}" if path else str(key), out)
    elif isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        for i, (a, b) in enumerate(zip(saved, now)):
            _diff(a, b, f"{path}[{i}]", out)
    elif saved != now:
        out.append((path, saved, now))


NEW_PHASE = ".options(data_phase='<new name>') and call load_state_dict(state, new_phase=True)"


def mismatch_message(saved: Mapping[str, Any] | None, now: Mapping[str, Any], *,
                     fixes: Mapping[str, str] = _FIX, new_phase: str = NEW_PHASE) -> str:
    """Which fields differ, their saved and current values, and how to fix each (``fixes``,
    per top-level field, and ``new_phase``: an integration names its own settings)."""
    head = "the checkpoint's data fingerprint differs from this pipeline's"
    tail = "; if the change is on purpose, it is a new data phase, not a resume: set " + new_phase
    if not isinstance(saved, Mapping):
        return head + " (the checkpoint does not say why)" + tail
    found: list[tuple[str, Any, Any]] = []
    _diff(saved, now, "", found)
    if not found:
        return head + " (its fields match; the fingerprint was altered)" + tail
    lines = []
    for path, was, is_now in found[:8]:
        top = path.split(".")[0].split("[")[0]
        lines.append(f"{path}: saved {short(was)}, now {is_now!r} ({fixes.get(top, 'restore the saved value')})")
    more = f"; and {len(found) - 8} more" if len(found) > 8 else ""
    return head + ":\n  " + "\n  ".join(lines) + more + "\n" + tail.lstrip("; ")
