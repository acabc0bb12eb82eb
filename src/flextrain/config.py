"""The trainer's configuration: one dataclass per part, a preset by name, a TOML or JSON
file, and ``--set section.key=value`` overrides (torchtitan style), validated once.

Fields split in two: those that decide the numbers a run computes (model, data, seed,
optimizer and schedule) enter the *fingerprint* and must match on resume; performance
settings (world size, micro batch, placement, checkpoint interval, workers) may change.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

CORPUS = Path(__file__).resolve().parent / "corpus"  # the bundled corpora: package data, in the wheel too


class ConfigError(ValueError):
    """A configuration value is wrong; the message names it and the fix."""


class WorldRefused(ConfigError):
    """The data layout does not split over this many ranks: the same on every rank, so the
    CLI prints it on rank 0 only."""


@dataclass
class ModelConfig:
    vocab_size: int = 50257  # GPT-2
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 384
    rope_base: float = 10000.0
    init_std: float = 0.02


@dataclass
class DataConfig:
    sources: dict[str, str] = field(default_factory=lambda: {
        "prose": str(CORPUS / "kjv.jsonl.zst"), "code": str(CORPUS / "python_stdlib.jsonl.zst")})
    shares: dict[str, float] = field(default_factory=lambda: {"prose": 0.7, "code": 0.3})
    tokenizer: str = "gpt2"
    max_length: int = 256
    packing: str = "wrap"
    shuffle_buffer: int = 64
    lanes: int = 8
    global_batch: int = 16
    micro_batch: int = 2          # performance: rows per forward pass
    workers: int = 1              # performance: tokenizer threads
    heldout_fraction: float = 0.1
    eval_batches: int = 2         # held-out global batches per evaluation
    loader: str = "zephon"        # or "usual": the per-rank streaming baseline of the experiments


@dataclass
class OptimConfig:
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    decay: str = "cosine"         # or "linear"
    min_lr_ratio: float = 0.1
    placement: str = "owned"      # performance: or "fsdp"
    compute_copy: str = "full"    # "mxfp8": gather BlockShard weights as MXFP8


@dataclass
class TrainConfig:
    run_dir: str = "runs/flextrain"
    seed: int = 0
    steps: int = 100
    ckpt_every: int = 20          # performance
    keep_last: int = 3            # performance
    ckpt_local_every: int = 0     # performance: a fast-tier save (node memory + a peer copy) every N steps; 0: off
    ckpt_local_replicas: int = 1  # performance: copies of each fast save on other nodes
    ckpt_local_dir: str = "/dev/shm/flexckpt"  # performance: the node-local folder of the fast tier
    eval_every: int = 50
    log_every: int = 1
    device: str = "auto"          # performance: "cuda", "cpu" or "auto" (CUDA when present); flextrain.device
    autocast: str = "auto"        # "bf16", "none" or "auto" (bf16 on CUDA); resolved at start, fingerprinted
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "TrainConfig":
        """Every field against its range or choices (``RULES``), then the rules between fields."""
        for path, rule in RULES.items():
            *heads, name = path.split(".")
            obj = self
            for h in heads:
                obj = getattr(obj, h)
            rule(path, getattr(obj, name))
        m, d = self.model, self.data
        if m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2:
            raise ConfigError(f"model.d_model={m.d_model} must split into model.n_heads={m.n_heads} heads of even size")
        if m.vocab_size != 50257 and d.tokenizer == "gpt2":
            raise ConfigError(f"model.vocab_size={m.vocab_size} but the GPT-2 tokenizer has 50257 tokens; keep 50257")
        if set(d.shares) != set(d.sources):
            raise ConfigError(f"data.shares names {sorted(d.shares)}, data.sources {sorted(d.sources)}: name the same sources")
        if d.global_batch % d.lanes:
            raise ConfigError(f"data.global_batch={d.global_batch} must be a multiple of data.lanes={d.lanes}")
        return self

    def check_world(self, world: int) -> None:
        """Lanes and the global batch must split evenly over ``world`` ranks."""
        problems = world_problems(self.data.lanes, self.data.global_batch, self.data.micro_batch, world)
        if problems:
            raise WorldRefused(f"cannot run on {world} rank{'' if world == 1 else 's'}: {problems}; rank counts that work with these "
                              f"settings: {working_sizes(self.data.lanes, self.data.global_batch, self.data.micro_batch)}")


def world_problems(lanes: int, global_batch: int, micro_batch: int, world: int) -> str:
    """Why ``world`` ranks cannot run this data layout ('' when they can)."""
    if lanes % world:
        return f"data.lanes={lanes} is not a multiple of {world} ranks"
    if (global_batch // world) % min(micro_batch, global_batch // world):
        return (f"the per-rank batch {global_batch // world} (data.global_batch / ranks) is not a multiple of "
                f"data.micro_batch={micro_batch}; pick a micro batch dividing it")
    return ""


def working_sizes(lanes: int, global_batch: int, micro_batch: int = 1) -> list[int]:
    return [w for w in range(1, lanes + 1) if not world_problems(lanes, global_batch, micro_batch, w)]


def eval_micro_batch(micro_batch: int, lanes: int, world: int) -> int:
    """Rows per forward pass in evaluation: the largest divisor of the per-rank held-out rows
    (one row per lane per batch, ``lanes / world``) not above ``micro_batch``, so every layout
    that trains also evaluates (6 lanes on 2 ranks with micro batch 2: 3 rows, micro batch 1)."""
    rows = lanes // world
    return max(k for k in range(1, min(micro_batch, rows) + 1) if rows % k == 0)


# ---- the range or choices of every field ------------------------------------------------------
# A rule gets (dotted field name, value) and raises one line naming both and what is allowed.
SEED_MAX = 2**63 - 1  # torch, numpy and zephon all take it
DEVICES = ("auto", "cuda", "cpu")  # flextrain.device resolves them (here: read before torch is imported)
AUTOCASTS = ("auto", "bf16", "none")


def _fail(path: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{path}={value!r} is not allowed: it must be {allowed}")


def _int(lo: int, hi: int | None = None):
    allowed = f"an int from {lo} to {hi}" if hi is not None else f"an int >= {lo}"

    def rule(path: str, v: Any) -> None:
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            _fail(path, v, allowed)
    return rule


def _is_number(v: Any) -> bool:
    if type(v) is int:
        return -1e308 < v < 1e308  # exact comparison; float(v) would overflow past that
    return type(v) is float and math.isfinite(v)


def _real(lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """A finite number (an int is fine) in the interval from ``lo`` to ``hi``."""
    if hi is None:
        allowed = f"a finite number {'>' if lo_open else '>='} {lo:g}"
    else:
        allowed = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def rule(path: str, v: Any) -> None:
        if not _is_number(v) or (v <= lo if lo_open else v < lo) or (
                hi is not None and (v >= hi if hi_open else v > hi)):
            _fail(path, v, allowed)
    return rule


def _one_of(*choices: str):
    def rule(path: str, v: Any) -> None:
        if v not in choices or type(v) is not str:
            _fail(path, v, "one of " + ", ".join(repr(c) for c in choices))
    return rule


def _packing(path: str, v: Any) -> None:
    from zephon_state.pack import ALGORITHMS  # here: the CLI reads the configuration before the heavy imports

    _one_of(*ALGORITHMS)(path, v)


def _text(path: str, v: Any) -> None:
    if type(v) is not str or not v.strip():
        _fail(path, v, "a non-empty string")


def _sources(path: str, v: Any) -> None:
    if not isinstance(v, dict) or not v:
        _fail(path, v, "a table of source name = path (a file, a glob or a URL), at least one")
    for name, p in v.items():
        _text(f"{path}[{name!r}]", p)


def _shares(path: str, v: Any) -> None:
    if not isinstance(v, dict) or not v:
        _fail(path, v, "a table of source name = share, one per source")
    for name, share in v.items():
        _real(0, lo_open=True)(f"{path}[{name!r}]", share)


RULES: dict[str, Any] = {
    "run_dir": _text,
    "seed": _int(0, SEED_MAX),
    "steps": _int(1), "ckpt_every": _int(1), "keep_last": _int(1), "eval_every": _int(1), "log_every": _int(1),
    "model.vocab_size": _int(1), "model.d_model": _int(1), "model.n_layers": _int(1), "model.n_heads": _int(1),
    "model.d_ff": _int(1),
    "model.rope_base": _real(1, lo_open=True),  # the base of the rotary wavelengths; 0 makes them infinite
    "model.init_std": _real(0, 10, lo_open=True),
    "data.sources": _sources, "data.shares": _shares, "data.tokenizer": _text,
    "data.max_length": _int(2),  # a row holds at least one input and its label
    "data.packing": _packing,
    "data.shuffle_buffer": _int(1), "data.lanes": _int(1), "data.global_batch": _int(1), "data.micro_batch": _int(1),
    "data.workers": _int(1, 256),  # tokenizer threads
    "data.heldout_fraction": _real(0, 0.5, lo_open=True),  # the held-out side is the smaller one
    "data.eval_batches": _int(1),
    "data.loader": _one_of("zephon", "usual"),
    # bounded far above any useful value, below where the float32 update overflows (a traceback)
    "optim.muon_lr": _real(0, 100), "optim.adamw_lr": _real(0, 100), "optim.weight_decay": _real(0, 100),
    "optim.warmup_steps": _int(0),
    "optim.decay": _one_of("cosine", "linear"),
    "optim.min_lr_ratio": _real(0, 1),
    "optim.placement": _one_of("owned", "fsdp"),
    "optim.compute_copy": _one_of("full", "mxfp8"),
    "ckpt_local_every": _int(0), "ckpt_local_replicas": _int(0), "ckpt_local_dir": _text,
    "device": _one_of(*DEVICES),  # performance: flextrain.device
    "autocast": _one_of(*AUTOCASTS),  # resolved at start, fingerprinted
}


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {"model": {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 768}, "data": {"max_length": 512}},
    # A real model's mix (13.3% of the parameters in embedding and head; Llama 3 8B: about 13%)
    # through a 4,096-token BPE trained on the bundled corpora: with GPT-2's 50,257 tokens the
    # same mix needs n_layers * d_model >= ~44k (585M parameters at d=1024), minutes a step here.
    "blocks": {"model": {"vocab_size": 4096, "d_model": 512, "n_layers": 8, "n_heads": 8, "d_ff": 1536},
               "data": {"tokenizer": "corpus-bpe-4096"}},
}

# Fields that change which numbers a run computes: they must match on resume.
SEMANTIC = {
    "seed": None,
    "autocast": None,
    "model": None,
    "data": ("sources", "shares", "tokenizer", "max_length", "packing", "shuffle_buffer", "lanes", "global_batch",
             "heldout_fraction", "eval_batches", "loader"),
    "optim": ("muon_lr", "adamw_lr", "weight_decay", "warmup_steps", "decay", "min_lr_ratio", "compute_copy"),
}


def semantic_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, keys in SEMANTIC.items():
        value = cfg.get(section, "none" if section == "autocast" else None)  # runs before autocast were fp32
        if keys is None:
            out[section] = value
        else:
            out[section] = {k: value.get(k) for k in keys} if isinstance(value, dict) else None
    return out


def fingerprint(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(semantic_fields(cfg)).encode()).hexdigest()  # key order kept: source order matters


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``path: saved X, now Y`` for every fingerprinted field that differs."""
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b:
            out.append(f"{path}: saved {a!r}, now {b!r}")

    walk(_bundled_by_name(semantic_fields(saved)), _bundled_by_name(semantic_fields(now)), "")
    return out


def _bundled_by_name(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with each data source that is a bundled corpus named by its file, not its
    absolute path: a run folder resumes from another checkout, venv or wheel install (the
    data pipeline's own fingerprint compares the documents' sha256 anyway)."""
    sources = (fields.get("data") or {}).get("sources")
    if not isinstance(sources, dict):
        return fields
    named = {k: _bundled_name(v) for k, v in sources.items()}
    return {**fields, "data": {**fields["data"], "sources": named}}


def _bundled_name(source: Any) -> Any:
    if not isinstance(source, str):
        return source
    path = Path(source)
    if path.parent.name == CORPUS.name and path.parent.parent.name == CORPUS.parent.name \
            and (CORPUS / path.name).is_file():
        return f"<bundled corpus {path.name}>"
    return source


def _merge(cfg: Any, values: dict[str, Any], where: str) -> None:
    for key, value in values.items():
        if not hasattr(cfg, key) or key.startswith("_"):
            known = [f.name for f in dataclasses.fields(cfg)]
            raise ConfigError(f"{where}{key}: unknown key {key!r}; known: {known}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} is a section; give a table/object, not {value!r}")
            _merge(current, value, f"{where}{key}.")
        else:
            setattr(cfg, key, value)


def _parse_value(text: str, current: Any, key: str) -> Any:
    if isinstance(current, str):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        if not isinstance(current, (dict, list)):  # steps=abc: validate() names the field and its range
            return text
        raise ConfigError(f"--set {key}={text}: not a JSON value (quote strings inside dicts)") from None
    if isinstance(current, float) and type(value) is int:  # --set optim.muon_lr=1 means 1.0
        value = float(value) if abs(value) < 1e308 else value  # a huge int stays one: the range check names it
    return value  # anything else as written (true stays a bool): validate() names a wrong type


def apply_set(cfg: TrainConfig, assignment: str) -> None:
    """``section.key=value`` (value parsed as JSON unless the field is a string)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: write key=value, e.g. --set data.global_batch=32")
    path, text = assignment.split("=", 1)
    *heads, last = path.strip().split(".")
    obj: Any = cfg
    for h in heads:
        obj = getattr(obj, h, None)
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"--set {path}: {h!r} is not a section of the configuration")
    if not hasattr(obj, last):
        raise ConfigError(f"--set {path}: unknown key {last!r}; known: {[f.name for f in dataclasses.fields(obj)]}")
    setattr(obj, last, _parse_value(text, getattr(obj, last), path))


def from_dict(values: dict[str, Any]) -> TrainConfig:
    cfg = TrainConfig()
    _merge(cfg, values, "")
    return cfg


def load_config(preset: str = "tiny", path: str | None = None, sets: list[str] = ()) -> TrainConfig:
    """Preset, then the file (TOML or JSON), then ``--set`` overrides; validated."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is not one of {sorted(PRESETS)}")
    cfg = from_dict(json.loads(json.dumps(PRESETS[preset])))
    if path:
        try:
            text = Path(path).read_bytes()
            values = tomllib.loads(text.decode()) if path.endswith(".toml") else json.loads(text)
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
        except (ValueError, UnicodeDecodeError) as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
            kind = "TOML" if path.endswith(".toml") else "JSON (name it .toml for TOML)"
            raise ConfigError(f"--config {path}: not valid {kind}: {e}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path}: wants a table of sections and keys, got {type(values).__name__}")
        _merge(cfg, values, f"{path}: ")
    for s in sets:
        apply_set(cfg, s)
    return cfg.validate()
