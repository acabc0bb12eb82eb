"""``Pipeline``: the chained, checkpointable data pipeline.

    pipeline = (
        Pipeline(source)
        .options(io_options={"cache": {"enabled": True}})
        .tokenize(tokenizer_id="gpt2", field="text", parallelism=4)
        .pack_flat(max_length=2048, algorithm="wrap")
        .shuffle(buffer_size=1024, seed=42)
        .batch(microbatch_size=8)
    )
    for batch in pipeline:
        train_step(batch.to_training())

Each chained call returns a new pipeline; nothing is read until the first batch (or
``state_dict``/``fingerprint``) is asked for. Lanes (``.lanes``), the global batch
(``.batch(global_batch_size=...)``) and the data-parallel rank and size (``.data_parallel``)
are set on the same object; the defaults run in one process with one lane. Iteration never
ends: sources start new epochs.
"""
from __future__ import annotations

import copy
import re
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

from .batch import Batch
from .config import BatchConfig, DataParallel, Options, PackConfig, ShuffleConfig, TokenizeConfig
from .cursor import LaneCursor
from .errors import ConfigError, FingerprintMismatch, StateError, short
from .fingerprint import fingerprint, mismatch_message, plan_fields
from .holdout import HoldoutConfig, split
from .lane import LaneSetup
from .mixture import Mix, Plan, as_mix, resolve
from .producer import Producer, Resume, resume_point
from .source import SourceReport
from .storage import IoOptions
from .tokenize import LoadedTokenizer, TokenizerPool, load_tokenizer
from .topology import Topology

STATE_FORMAT = "zephon_state/1"
_LANE_KEY = re.compile(r"0|[1-9][0-9]{0,17}")


def _is_lane_key(key: object, lanes: int) -> bool:
    return isinstance(key, str) and _LANE_KEY.fullmatch(key) is not None and int(key) < lanes


def _is_phase(value: object) -> bool:
    return (isinstance(value, Mapping) and set(value) == {"data_phase", "fingerprint"}
            and all(isinstance(v, str) for v in value.values()))


@dataclass(frozen=True)
class PipelineConfig:
    """Everything a pipeline is built from; each chained call replaces one part."""

    mix: Mix
    tokenize: TokenizeConfig | None = None
    pack: PackConfig | None = None
    shuffle: ShuffleConfig | None = None
    batch: BatchConfig | None = None
    lanes: int = 1
    data_parallel: DataParallel | None = None
    options: Options = field(default_factory=Options)
    holdout: HoldoutConfig | None = None


@dataclass(eq=False)
class _Prepared:
    topology: Topology
    plan: Plan
    tokenizer: LoadedTokenizer
    fields: dict[str, Any]
    fingerprint: str
    setup: LaneSetup


class _Resources:
    """What must be stopped when the pipeline goes away (kept apart so a finalizer can)."""

    def __init__(self) -> None:
        self.pool: TokenizerPool | None = None
        self.producer: Producer | None = None
        self.closed = False

    def stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def close(self) -> None:
        self.closed = True
        self.stop_producer()
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def _torch_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Pipeline:
    """The data pipeline (see the module docstring). ``source`` is a ``Mix``, a ``Source``
    (``JsonLines``, ``TextFiles``, ``InMemory``), a path, or a list of texts or records."""

    def __init__(self, source: Any = None, *, config: PipelineConfig | None = None) -> None:
        if config is None:
            if source is None:
                raise ConfigError("Pipeline needs a source: a path, a list of texts, a Source or a Mix")
            config = PipelineConfig(as_mix(source))
        self.config = config
        self._prepared: _Prepared | None = None
        self._consumed: dict[int, LaneCursor] = {}
        self._resume: Resume | None = None
        self._phases: list[dict[str, str]] = []
        self._resources = _Resources()
        weakref.finalize(self, self._resources.close)

    # ---- building -------------------------------------------------------------------

    def _with(self, **changes: Any) -> "Pipeline":
        return Pipeline(config=replace(self.config, **changes))

    def options(
        self,
        io_options: IoOptions | Mapping[str, Any] | None = None,
        *,
        bad_records: str | None = None,
        data_phase: str | None = None,
        prefetch: int | None = None,
        readahead_windows: float | None = None,
        chunk_bytes: int | None = None,
    ) -> "Pipeline":
        """I/O (``{"cache": {"enabled": True}, "storage_options": {...}}``), the bad-record
        policy, the data phase, and performance settings; see ``Options``."""
        given = {
            "bad_records": bad_records, "data_phase": data_phase, "prefetch": prefetch,
            "readahead_windows": readahead_windows, "chunk_bytes": chunk_bytes,
        }
        changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if io_options is not None:
            changes["io"] = IoOptions.from_value(io_options)
        return self._with(options=replace(self.config.options, **changes))

    def tokenize(
        self, tokenizer_id: str = "gpt2", field: str = "text", parallelism: int = 1, eos: str | int | None = None
    ) -> "Pipeline":
        """Tokenize ``field`` of each record with ``parallelism`` worker threads; EOS ends each document."""
        return self._with(tokenize=TokenizeConfig(tokenizer_id, field, parallelism, eos))

    def pack_flat(self, max_length: int, algorithm: str = "wrap", window: int = 64) -> "Pipeline":
        """Pack documents into rows of ``max_length`` tokens ("wrap" or "best_fit")."""
        return self._with(pack=PackConfig(max_length, algorithm, window))  # type: ignore[arg-type]

    def shuffle(self, buffer_size: int, seed: int = 0) -> "Pipeline":
        """Shuffle each lane's rows in windows of ``buffer_size`` rows."""
        return self._with(shuffle=ShuffleConfig(buffer_size, seed))

    def batch(self, microbatch_size: int, global_batch_size: int | None = None) -> "Pipeline":
        """Yield microbatches of ``microbatch_size`` rows; ``global_batch_size`` rows per step
        over all ranks (default: one microbatch per rank)."""
        return self._with(batch=BatchConfig(microbatch_size, global_batch_size))

    def holdout(self, fraction: float, seed: int = 0, side: str = "train") -> "Pipeline":
        """Read only the ``side`` ("train" or "heldout") of a deterministic split that holds out
        about ``fraction`` of each source's documents (chosen by ``seed`` and the document
        index; the same for every rank count). Part of the fingerprint."""
        return self._with(holdout=HoldoutConfig(fraction, seed, side))  # type: ignore[arg-type]

    def lanes(self, count: int) -> "Pipeline":
        """Deal documents to ``count`` lanes (a multiple of every data-parallel size to run at)."""
        if type(count) is not int or count < 1:
            raise ConfigError(f"lanes({count!r}): the lane count must be a positive int")
        return self._with(lanes=count)

    def data_parallel(self, rank: int, size: int) -> "Pipeline":
        """Run as data-parallel ``rank`` of ``size`` (no torch.distributed needed)."""
        return self._with(data_parallel=DataParallel(rank, size))

    # ---- preparing ------------------------------------------------------------------

    def _topology(self) -> Topology:
        cfg = self.config
        if cfg.batch is None:
            raise ConfigError("the pipeline has no batch size; call .batch(microbatch_size=...)")
        dp = cfg.data_parallel
        if dp is None:
            world = _torch_world_size()
            if world > 1:
                raise ConfigError(
                    f"torch.distributed runs {world} processes but the pipeline was not told its data-parallel "
                    "place; call .data_parallel(rank=..., size=...) with the data-parallel group's rank and size"
                )
            dp = DataParallel()
        g = cfg.batch.global_batch_size or cfg.batch.microbatch_size * dp.size
        return Topology(cfg.lanes, g, cfg.batch.microbatch_size, dp.rank, dp.size)

    def _prepare(self) -> _Prepared:
        if self._resources.closed:
            raise ConfigError("the pipeline was closed; build a new one (a closed pipeline has no workers)")
        if self._prepared is not None:
            return self._prepared
        cfg = self.config
        if cfg.tokenize is None:
            raise ConfigError("the pipeline does not tokenize; call .tokenize(tokenizer_id='gpt2', field='text')")
        if cfg.pack is None:
            raise ConfigError("the pipeline does not pack; call .pack_flat(max_length=...)")
        topology = self._topology()
        tokenizer = load_tokenizer(cfg.tokenize.tokenizer_id, cfg.tokenize.eos)
        if self._resources.pool is None:
            self._resources.pool = TokenizerPool(cfg.tokenize.parallelism)
        pool = self._resources.pool
        opts, seed = cfg.options, cfg.shuffle.seed if cfg.shuffle else 0
        plan = resolve(cfg.mix, cfg.tokenize.field, opts.io, opts.bad_records, tokenizer, pool, seed, opts.data_phase)
        if cfg.holdout is not None:
            plan = replace(plan, documents=tuple(split(d, cfg.holdout) for d in plan.documents))
        window = cfg.shuffle.buffer_size if cfg.shuffle else cfg.pack.window
        plan.check(topology.lanes, window * cfg.pack.max_length)
        fields = plan_fields(
            cfg.mix, plan, cfg.tokenize.field, tokenizer, max_length=cfg.pack.max_length,
            packing=cfg.pack.algorithm, window=window, shuffle=cfg.shuffle is not None,
            bad_records=opts.bad_records, global_batch=topology.global_batch, lanes=topology.lanes,
            data_phase=opts.data_phase,
        )
        if cfg.holdout is not None:  # only when set, so fingerprints without a split stay as they were
            fields["holdout"] = cfg.holdout.fields()
        setup = LaneSetup.build(plan, tokenizer, pool, topology.lanes, cfg.pack.max_length, cfg.pack.algorithm,
                                window, cfg.shuffle is not None, opts.chunk_bytes, opts.readahead_windows)
        self._prepared = _Prepared(topology, plan, tokenizer, fields, fingerprint(fields), setup)
        self._consumed = {lane: LaneCursor.start(len(plan.names)) for lane in topology.hosted}
        self._resume = resume_point(topology, self._consumed)
        return self._prepared

    # ---- information ----------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        """Lanes, global batch, microbatch, rank and size, checked."""
        return self._prepare().topology

    def fingerprint(self) -> str:
        """Hex digest of everything that decides which tokens land in which batch."""
        return self._prepare().fingerprint

    def plan_fields(self) -> dict[str, Any]:
        """The values the fingerprint is computed from (plain JSON)."""
        return copy.deepcopy(self._prepare().fields)

    def calibration(self) -> dict[str, float]:
        """Tokens per byte of each source (measured, or as given in the Mix)."""
        plan = self._prepare().plan
        return dict(zip(plan.names, plan.tokens_per_byte))

    def report(self) -> tuple[SourceReport, ...]:
        """Per source: documents, bytes, bad records skipped per reason, first examples."""
        return tuple(d.report for d in self._prepare().plan.documents)

    # ---- iterating ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def start(self) -> "Pipeline":
        """Start producing in the background now (the first ``next()`` otherwise does): a
        restart then tokenizes its lanes' windows while the model and checkpoint load. A
        later ``load_state_dict`` stops it and starts over from the state."""
        prepared = self._prepare()
        if self._resources.producer is None:
            assert self._resume is not None
            self._resources.producer = Producer(
                prepared.setup, prepared.topology, self._consumed, self._resume, self.config.options.prefetch
            )
        return self

    def __next__(self) -> Batch:
        self.start()
        batch = self._resources.producer.get()
        self._consumed.update(batch.lane_cursors)
        return batch

    def close(self) -> None:
        """Stop the background producer and the tokenizer workers."""
        self._resources.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: ``fingerprint``, ``plan`` (its fields), ``phases`` (earlier data
        phases) and ``lanes``: one cursor per lane this rank hosts, keyed by the lane id as a
        string, describing the batches the caller has received (not prefetched ones). Every
        key but ``lanes`` is the same on every rank."""
        prepared = self._prepare()
        return {
            "format": STATE_FORMAT,
            "fingerprint": prepared.fingerprint,
            "plan": copy.deepcopy(prepared.fields),
            "phases": copy.deepcopy(self._phases),
            "lanes": {str(lane): cursor.to_dict() for lane, cursor in sorted(self._consumed.items())},
        }

    def load_state_dict(self, state: Mapping[str, Any], *, new_phase: bool = False) -> None:
        """Resume from ``state``, whose ``lanes`` may hold every lane (the union of all ranks,
        saved at any data-parallel size); this rank takes the lanes it hosts. The fingerprint
        must match. ``new_phase=True`` instead starts this pipeline's plan from its beginning
        as a new data phase (its ``data_phase`` must differ from the saved one)."""
        prepared = self._prepare()
        if not isinstance(state, Mapping) or state.get("format", STATE_FORMAT) != STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise StateError(f"not a zephon_state state dict (format {found!r}, expected {STATE_FORMAT!r})")
        saved_fp, lanes = state.get("fingerprint"), state.get("lanes")
        if not isinstance(saved_fp, str) or not isinstance(lanes, Mapping):
            raise StateError("a zephon_state state dict needs a 'fingerprint' string and a 'lanes' mapping")
        phases = state.get("phases") or []
        if not isinstance(phases, list) or not all(_is_phase(p) for p in phases):
            raise StateError(
                f"the state's 'phases' must be a list of {{'data_phase': str, 'fingerprint': str}}, got {short(phases)}"
            )
        if new_phase:
            self._start_new_phase(state, saved_fp, phases)
            return
        if saved_fp != prepared.fingerprint:
            raise FingerprintMismatch(mismatch_message(state.get("plan"), prepared.fields))
        topo = prepared.topology
        bad_keys = [k for k in lanes if not _is_lane_key(k, topo.lanes)]
        if bad_keys:
            raise StateError(
                f"the state names lanes {short(bad_keys)}; lane keys are decimal strings without leading "
                f"zeros, '0' to '{topo.lanes - 1}'"
            )
        cursors = {}
        for lane in topo.hosted:
            if str(lane) not in lanes:
                raise StateError(
                    f"the state has no cursor for lane {lane}, which rank {topo.rank} of {topo.size} hosts "
                    f"(it holds lanes {sorted(lanes, key=int)}); pass the union of every rank's 'lanes'"
                )
            cursors[lane] = LaneCursor.from_dict(lanes[str(lane)], len(prepared.plan.names), lane)
            prepared.setup.check_cursor(cursors[lane], lane)
        try:
            resume = resume_point(topo, cursors)
        except ValueError as e:
            raise StateError(str(e)) from None
        self._resources.stop_producer()
        self._consumed, self._resume, self._phases = cursors, resume, copy.deepcopy(list(phases))

    def _start_new_phase(self, state: Mapping[str, Any], saved_fp: str, phases: list) -> None:
        prepared = self._prepare()
        plan = state.get("plan")
        saved_phase = plan.get("data_phase") if isinstance(plan, Mapping) else None
        if saved_phase == prepared.fields["data_phase"]:
            raise StateError(
                f"new_phase=True but the data phase is still {saved_phase!r}; name the new phase with "
                ".options(data_phase='<new name>') so its document orders differ from the saved phase's"
            )
        self._resources.stop_producer()
        n = len(prepared.plan.names)
        self._consumed = {lane: LaneCursor.start(n) for lane in prepared.topology.hosted}
        self._resume = resume_point(prepared.topology, self._consumed)
        self._phases = copy.deepcopy(list(phases)) + [{"data_phase": saved_phase, "fingerprint": saved_fp}]
