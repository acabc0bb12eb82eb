"""The training loop, top to bottom: build the model, the optimizer, the data and the
checkpointer; resume if the run folder holds a checkpoint; loop, log, save.

One step on D ranks: take this rank's microbatches; forward and backward every
microbatch with the *sum* of token losses; one small all-reduce of (label count, stop
flag), which also waits for the slowest rank's backward, so that ``optim_s`` times the
optimizer alone; divide the gradients by the global label count (so the loss does not
depend on D); reduce gradients to their owners; fence the checkpoint staged
in the previous step; set the learning rate; optimizer step; gather the lane digests and
loss sums (one small all-gather; a loss or weights that are not finite stop every rank
here, before the save); log; maybe save (async) and evaluate.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from flexckpt import ByLane, Checkpointer, LoadError
from flexckpt.load import subset_load
from flexckpt.tier import LocalTier
from flexshard import AdamWConfig, MuonConfig, ShardedOptimizer, ShardingConfig
from flexshard.world import ranks
from zephon_state import Pipeline, global_batch_digest

from flextrain.config import TrainConfig, fingerprint
from flextrain.data import build_pipeline, check_inputs, heldout_pipeline
from flextrain.device import autocast, backend_for, choose_device, prepare, resolve, to_device
from flextrain.model import Transformer, token_loss_sum
from flextrain.preempt import Preemption, StartupStopped
from flextrain.schedule import lr_scale
from flextrain.start import Start, decide_after_tier_failure, decide_start, resume_refusal
from flextrain.usual_loader import UsualLoader

class ResumeRefused(RuntimeError):
    """The checkpoint was written by a run whose numbers this configuration would change, or
    ``--resume`` found no checkpoint to resume from."""


class TrainingDiverged(RuntimeError):
    """The step's loss or its updated weights are not finite: every rank stops at that step,
    before its checkpoint."""


class FinalSaveFailed(RuntimeError):
    """The run's last checkpoint (at its last step, or at a stop) was not committed: a
    restart resumes from an earlier step."""


def init_distributed(backend: str = "gloo") -> tuple[int, int]:
    """(rank, world): torchrun's environment, else one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_optimizer(model: Transformer, cfg: TrainConfig) -> ShardedOptimizer:
    o = cfg.optim
    return ShardedOptimizer(
        model.named_parameters(),
        MuonConfig(lr=o.muon_lr, weight_decay=o.weight_decay),
        AdamWConfig(lr=o.adamw_lr, weight_decay=o.weight_decay),
        ShardingConfig(placement=o.placement, average_gradients=False, compute_copy=o.compute_copy),
        muon_params=model.hidden_matrices(),
    )


def checkpoint_state(opt: ShardedOptimizer, step: int, cfg: TrainConfig, data_state: dict,
                     calibration: dict | None = None) -> dict:
    """Masters once under ``model/<name>``, optimizer state under ``optim/``, lane cursors
    by lane, the rest as plain values under ``trainer/``."""
    sd = opt.state_dict()
    meta = {k: v for k, v in data_state.items() if k != "lanes"}
    values = cfg.to_dict()
    return {
        "model": {n: p["master"] for n, p in sd["params"].items()},
        "optim": {"step": sd["step"], "state": {n: {k: v for k, v in p.items() if k != "master"}
                                                for n, p in sd["params"].items()}},
        "data": ByLane(dict(data_state.get("lanes", {}))),
        "trainer": {"step": step, "config": json.dumps(values),
                    "fingerprint": fingerprint(values), "data_state": json.dumps(meta, sort_keys=True),
                    "calibration": json.dumps(calibration)},
    }


def adopt_checkpoint_state(opt: ShardedOptimizer, state: dict) -> None:
    """Hand the loaded pieces (already in place) back to the optimizer, which re-gathers
    the parameters."""
    params = {n: {"master": m, **state["optim"]["state"][n]} for n, m in state["model"].items()}
    opt.load_state_dict({"step": state["optim"]["step"], "params": params})


def saved_trainer_values(ckpt: Checkpointer, step: int | None = None) -> tuple[int, dict]:
    """The ``trainer/`` plain values of a checkpoint and its lane cursors (``lanes``); no
    tensor is read."""
    probe = {"trainer": {"step": 0, "config": "", "fingerprint": "", "data_state": "", "calibration": ""},
             "data": ByLane({})}
    with subset_load():  # a probe of a few values: the rest is not dropped
        got = ckpt.load(probe, step=step, strict=False, fallback=step is None)
    return got, {**probe["trainer"], "lanes": probe["data"].values}


def data_state_of(saved: dict) -> dict:
    """The pipeline's state from a checkpoint's ``trainer/`` values and lane cursors."""
    data_state = json.loads(saved["data_state"])
    data_state["lanes"] = saved["lanes"]
    return data_state


def check_resumable(saved_config: str, cfg: TrainConfig) -> None:
    """Raise ``ResumeRefused`` naming every fingerprinted field of ``cfg`` that differs from
    the checkpoint's ``trainer/config`` (``resume_refusal``)."""
    refusal = resume_refusal(saved_config, cfg)
    if refusal:
        raise ResumeRefused(refusal)


def launch_timings() -> dict[str, float]:
    """``process_start_s``: seconds since launch, when a benchmark set ``FLEXTRAIN_LAUNCH_TIME``
    (the wall clock at launch)."""
    launched = os.environ.get("FLEXTRAIN_LAUNCH_TIME")
    return {"process_start_s": time.time() - float(launched)} if launched else {}


@dataclass
class Metrics:
    path: Path | None
    rows: list[dict] = field(default_factory=list)

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def weights_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite, in one reduction pass and one host
    sync: IEEE addition keeps a NaN or an infinity, so a tensor whose sum is finite holds
    only finite values; only a sum that is not finite (a non-finite element, or finite
    values whose sum overflows) sends its tensors to the element-by-element check."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    if bool(torch.stack([t.sum() for t in tensors]).isfinite().all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else 0.0


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool | None = None, quiet: bool = False,
                 preempt: Preemption | None = None) -> None:
        """Start-up, in order: check ``cfg`` and the inputs it names; choose the device and
        resolve ``cfg`` for it into ``self.cfg`` (a new configuration, never changed after;
        ``cfg`` is not changed); join the ranks; decide where the run starts (``decide_start``:
        ``resume`` True requires a checkpoint, False refuses one, None resumes when there is
        one); build the model and, on a thread beside it, the data pipeline; load the
        checkpoint. A refusal (``ResumeRefused``) leaves the run folder as it was; a signal
        stops start-up before any step (``StartupStopped``)."""
        self.preempt = preempt  # installed by the CLI at start; train() installs one otherwise
        self.persisted = False  # train() ended with its last step committed to the store (see close)
        self._closed = False
        cfg.validate()
        check_inputs(cfg.data, cfg.model.vocab_size)
        self.device = choose_device(cfg.device)  # flextrain.device decides; the rest follows it
        self.cfg = resolve(cfg, self.device)  # autocast resolved before anything is fingerprinted
        prepare(self.device)
        self.rank, self.world = init_distributed(backend_for(self.device))
        self.cfg.check_world(self.world)
        self._stop_if_signalled()
        self.quiet = quiet or self.rank != 0
        self.run_dir = Path(self.cfg.run_dir).resolve()
        self.timings = launch_timings()
        self.ckpt = self._open_checkpointer()
        start, saved = self._timed("checkpoint_probe_s", self._decide_start, resume)
        self._claim_run_dir()
        # the pipeline is built, restored and started on a thread while the model builds and
        # the tensors load: a restart waits only for what is left of it (pipeline_build_s)
        # (from the fast tier, whose values come only with the load: built after it, on this thread)
        data = self._start_pipeline_on_a_thread(saved) if start.source != "tier" else None
        self._timed("model_build_s", self._build_model)
        self.step, self.resumed_from = 0, None
        self._stop_if_signalled(agree=True, starting=data)  # every rank is here: a stop skips the load
        saved, data_state = self._timed("checkpoint_load_s", self._load, start, saved, resume)
        self._timed("pipeline_build_s", self._finish_pipelines, data, saved, data_state)
        self._stop_if_signalled()
        self.metrics = Metrics(self.run_dir / "metrics.jsonl" if self.rank == 0 else None)

    def _timed(self, name: str, step: Callable[..., Any], *args: Any) -> Any:
        """``step(*args)``, its seconds kept in ``timings[name]``."""
        t = time.perf_counter()
        out = step(*args)
        self.timings[name] = time.perf_counter() - t
        return out

    def _open_checkpointer(self) -> Checkpointer:
        """The run's checkpointer on ``RUN_DIR/ckpt``, with the fast tier when it is on."""
        cfg = self.cfg
        local = None
        if cfg.ckpt_local_every:
            local = LocalTier(dir=cfg.ckpt_local_dir, every=cfg.ckpt_local_every, replicas=cfg.ckpt_local_replicas)
        return Checkpointer(str(self.run_dir / "ckpt"), keep_last=cfg.keep_last, local=local)

    def _decide_start(self, resume: bool | None) -> tuple[Start, dict | None]:
        """Where this run starts (``decide_start``, from the store's newest step and the fast
        tier's) and, resuming from the store, its newest checkpoint's ``trainer/`` values
        (plain values only: a changed run is refused before any tensor is read). Raises
        ``ResumeRefused``."""
        newest = self.ckpt.latest_step()
        tier = self.ckpt.tier
        # the store has none: a run killed before its first persistent save may have fast-tier
        # steps (a collective: every rank asks, all get the same answer)
        held = tier.newest_held() if newest is None and tier is not None else None
        start = decide_start(resume, newest, held, self.run_dir, tier.root if tier is not None else None)
        if start.source == "refuse":
            raise ResumeRefused(start.message)
        if start.source != "store":
            return start, None
        _, saved = saved_trainer_values(self.ckpt)
        check_resumable(saved["config"], self.cfg)
        return start, saved

    def _claim_run_dir(self) -> None:
        """The run folder (made only now: a refused run leaves it as it was) and this rank's
        pid file in it (where to send a signal)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / f"rank{self.rank}.pid").write_text(str(os.getpid()))

    def _start_pipeline_on_a_thread(self, saved: dict | None) -> Future:
        """``_start_pipeline(saved)`` on a thread of its own; its future."""
        starter = ThreadPoolExecutor(1, thread_name_prefix="flextrain-data")
        data = starter.submit(self._start_pipeline, saved)
        starter.shutdown(wait=False)
        return data

    def _load(self, start: Start, saved: dict | None, resume: bool | None) -> tuple[dict | None, dict | None]:
        """Load the checkpoint ``start`` names into the model and optimizer built for step 0.
        Returns the ``trainer/`` values the pipeline starts from (the probed ones; the tier's,
        which come only with its load; None from step 0) and, from the store, the data state
        loaded (a damaged newest step falls back to an older one, with its own cursors)."""
        if start.source == "store":
            return saved, data_state_of(self._resume())
        if start.source == "tier":
            return self._resume_from_tier(start.step, resume), None
        return None, None

    def _finish_pipelines(self, data: Future | None, saved: dict | None, data_state: dict | None) -> None:
        """The training pipeline (from its thread, else built here from ``saved``), moved to
        ``data_state`` when the load fell back, and the held-out pipeline."""
        cfg = self.cfg
        self.pipeline, started_from = data.result() if data is not None else self._start_pipeline(saved)
        if data_state is not None and data_state != started_from:  # the full load fell back to an older step
            self.pipeline.load_state_dict(data_state)
        self._calibration = self.pipeline.calibration() if isinstance(self.pipeline, Pipeline) else None
        self.heldout = heldout_pipeline(cfg.data, cfg.seed, self.rank, self.world, calibration=self._calibration)
        self.heldout.fingerprint()  # its split and batch geometry too: an evaluation cannot fail on them later
        self._heldout_start: dict | None = None

    def _start_pipeline(self, saved: dict | None) -> tuple[Any, dict | None]:
        """The training pipeline, restored to the probed checkpoint's data state and started."""
        cfg = self.cfg
        if cfg.data.loader == "usual":
            pipeline = UsualLoader(cfg.data, cfg.seed, self.rank, self.world)
        else:
            calibration = json.loads(saved["calibration"]) if saved and saved["calibration"] else None
            pipeline = build_pipeline(cfg.data, cfg.seed, self.rank, self.world, calibration=calibration)
            pipeline.fingerprint()  # load the sources, calibrate the mix, check the plan: before any step
        if saved is None:
            return pipeline, None
        data_state = data_state_of(saved)
        pipeline.load_state_dict(data_state)
        if isinstance(pipeline, Pipeline):
            pipeline.start()
        return pipeline, data_state

    def _build_model(self) -> None:
        """The model and optimizer as step 0 has them (seeded: the same bits on every rank)."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.model = Transformer(cfg.model)
        self.model.init_weights(cfg.seed)  # on the CPU (its generator), the same bits on every device
        self.model.to(self.device)
        self.opt = build_optimizer(self.model, cfg)
        if cfg.optim.compute_copy == "mxfp8":
            self.opt.gather_parameters()  # compute on the dequantized weights from the first step on

    # ---- resume ---------------------------------------------------------------------------
    def _resume(self) -> dict:
        """Load the checkpoint's tensors and values; returns its ``trainer/`` values and lane
        cursors (``lanes``), as ``saved_trainer_values`` gives them."""
        newest = self.ckpt.latest_step()
        state = checkpoint_state(self.opt, 0, self.cfg, {"lanes": {}})
        got = self.ckpt.load(state, fallback=True)
        recovery = self.ckpt.tier.last_recovery if self.ckpt.tier is not None else None
        if recovery is not None and recovery.source == "tier":
            store = f"the persistent store's newest: {newest}" if newest is not None else "the persistent store has none"
            self._say(f"flextrain: resuming from the fast tier's step {got} ({store})")
        elif got != newest:
            self._say(f"flextrain: the newest checkpoint (step {newest}) could not be read; resumed from step {got}")
        check_resumable(state["trainer"]["config"], self.cfg)
        adopt_checkpoint_state(self.opt, state)
        values = {**state["trainer"], "lanes": state["data"].values}
        self.step = self.resumed_from = int(state["trainer"]["step"])
        stats = self.ckpt.last_load_stats
        record = {"step": got, "world": self.world, "rank": self.rank,
                  "bytes_read": stats.bytes_read if stats else None, "chunks": stats.chunks if stats else None}
        (self.run_dir / f"resume-w{self.world}-r{self.rank}.json").write_text(json.dumps(record))
        self._say(f"flextrain: resumed step {got} on {ranks(self.world)}; rank {self.rank} read "
                  f"{record['bytes_read']} bytes", all_ranks=True)
        if self.step >= self.cfg.steps:  # else the run ends at once, without a word
            self._say(f"flextrain: the checkpoint is at step {self.step} and steps={self.cfg.steps}: nothing to "
                      f"train; pass --set steps=N with N > {self.step} to train on")
        return values

    def _resume_from_tier(self, held: int, resume: bool | None) -> dict | None:
        """The store has no checkpoint and some node's fast tier holds step ``held``: restore
        the newest step the tier can (its recovery: every rank agrees on the step and on its
        load's success). Its values as ``_resume`` returns them; None when the tier cannot
        (a node lost with the only copy of a rank's part): a fresh start, said, on a model
        built anew (a failed read may have written into it). A step saved with another model
        structure (a changed config) is refused, as a store resume refuses it, and kept
        (``decide_after_tier_failure``)."""
        try:
            return self._resume()
        except LoadError:  # the tier gave no step, and the store has none
            recovery = self.ckpt.tier.last_recovery
            if recovery is None or recovery.source == "tier":
                raise
        start = decide_after_tier_failure(resume, held, recovery.reason, recovery.other_structure, self.run_dir)
        if start.source == "refuse":
            raise ResumeRefused(start.message)
        self._say(start.message)
        self._build_model()
        return None

    def _stop_if_signalled(self, agree: bool = False, starting: Future | None = None) -> None:
        """A signal during start-up stops the run before its first step, with nothing to save.
        One rank stops on its own flag at once; ranks stop only together, on ``agree`` (an
        all-reduce: before the checkpoint load and when start-up ends), as a rank stopping
        alone would leave the others waiting. ``starting``: the pipeline being built on its
        thread, which the process must join before it can exit in any case."""
        flag = torch.tensor([float(self.preempt is not None and self.preempt.requested)], device=self.device)
        if agree and self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        elif self.world > 1:
            return
        if flag.item():
            try:
                if starting is not None:
                    self.pipeline = starting.result()[0]
            finally:
                self.close()  # run() closes only a built trainer
            resumed = getattr(self, "resumed_from", None)
            kept = f" (step {resumed}, resumed from, stays the newest checkpoint)" if resumed else ""
            raise StartupStopped(f"stopped by a signal during start-up, before any step; nothing to save{kept}")

    def _say(self, msg: str, all_ranks: bool = False) -> None:
        if all_ranks or self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    # ---- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the fixed held-out batches (the same rows at any D)."""
        if self._heldout_start is None:
            self._heldout_start = self.heldout.state_dict()
        else:
            self.heldout.load_state_dict(self._heldout_start)
        total = torch.zeros(2, dtype=torch.float64)
        for _ in range(self.cfg.data.eval_batches):
            while True:
                b = next(self.heldout)
                with autocast(self.cfg.autocast, self.device):
                    loss, n = token_loss_sum(self.model, to_device(b.to_training(), self.device))
                total += torch.tensor([loss.item(), n], dtype=torch.float64)
                if b.last_in_step:
                    break
        if self.world > 1:
            total = total.to(self.device)
            dist.all_reduce(total)
        return float(total[0] / total[1])

    # ---- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg, o = self.cfg, self.cfg.optim
        preempt = self.preempt = self.preempt or Preemption()
        bar = None
        if not self.quiet and sys.stderr.isatty():
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps, initial=self.step, desc="train", file=sys.stderr)
        handle = None
        waits: list[float] = []
        t_start = time.perf_counter()
        stopped = False
        last_save = self.resumed_from
        try:
            self._stop_if_signalled(agree=True)
            preempt.training = True
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                flag = float(preempt.requested)
                micro = [next(self.pipeline)]
                while not micro[-1].last_in_step:
                    micro.append(next(self.pipeline))
                data_wait = time.perf_counter() - t0
                if self.step == (self.resumed_from or 0):
                    self.timings.setdefault("first_batch_s", data_wait)
                count = torch.tensor([float(sum(int((b.labels != -100).sum()) for b in micro)), flag],
                                     dtype=torch.float64, device=self.device)
                loss_sum = 0.0
                for b in micro:
                    with autocast(cfg.autocast, self.device):
                        loss, _ = token_loss_sum(self.model, to_device(b.to_training(), self.device))
                    loss.backward()
                    loss_sum += loss.item()
                t_sync = time.perf_counter()
                if self.world > 1:  # after backward: the ranks' skew is waited here, not in the optimizer
                    dist.all_reduce(count)
                sync_s = time.perf_counter() - t_sync
                labels, stop = count[0].item(), count[1].item() > 0
                for p in self.model.parameters():
                    p.grad.div_(labels)
                t_opt = time.perf_counter()
                self.opt.reduce_gradients()
                opt_s = time.perf_counter() - t_opt
                ckpt_wait = 0.0
                if handle is not None:
                    handle.wait_staged()
                    ckpt_wait = handle.trainer_wait
                    waits.append(ckpt_wait)
                    handle = None
                scale = lr_scale(self.step, cfg.steps, o.warmup_steps, o.decay, o.min_lr_ratio)
                self.opt.set_lr(muon=o.muon_lr * scale, adamw=o.adamw_lr * scale)
                t_opt = time.perf_counter()
                self.opt.step()
                opt_s += time.perf_counter() - t_opt
                self.opt.zero_grad()
                self.step += 1
                final = stop or self.step == cfg.steps
                save = self.step % cfg.ckpt_every == 0 or final
                save_local = not save and bool(cfg.ckpt_local_every) and self.step % cfg.ckpt_local_every == 0
                t_save = time.perf_counter()
                weights_ok = not (save or save_local) or weights_finite([e.master.local for e in self.opt.entries])
                save_s = time.perf_counter() - t_save  # with the state and save() below: this thread's save work
                digest, loss_total, finite = self._gather_step(micro, loss_sum, weights_ok)
                if not (finite and math.isfinite(loss_total)):  # every rank has the same values: all stop here
                    raise TrainingDiverged(
                        f"step {self.step}: the loss is {loss_total / labels:.6g}"
                        + ("" if finite else " and the updated weights are not finite")
                        + "; stopped on every rank before this step's checkpoint ("
                        + (f"the last one taken is step {last_save}" if last_save else "no checkpoint was taken")
                        + "); lower optim.muon_lr / optim.adamw_lr or check the data")
                row = {"step": self.step, "loss": loss_total / labels, "tokens": int(labels),
                       "lr": o.muon_lr * scale, "lr_adamw": o.adamw_lr * scale, "global_batch_sha256": digest,
                       "step_s": 0.0, "data_wait_s": data_wait, "ckpt_wait_s": ckpt_wait, "save_s": save_s,
                       "world": self.world,
                       "sync_s": sync_s, "optim_s": opt_s, **{f"optim_{k}_s": v for k, v in self.opt.phase_s.items()}}
                if save or save_local:
                    t_save = time.perf_counter()
                    state = checkpoint_state(self.opt, self.step, cfg, self.pipeline.state_dict(), self._calibration)
                    if save:
                        last_save = self.step
                        handle = self.ckpt.save(self.step, state)
                    else:  # None: skipped, the previous fast save is still copying (counted by the tier)
                        handle = self.ckpt.save_local(self.step, state)
                    row["save_s"] += time.perf_counter() - t_save
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    row["eval_loss"] = self.evaluate()
                row["step_s"] = time.perf_counter() - t0
                self.metrics.write(row)
                self._log(row, bar)
                if stop:
                    self._say(f"flextrain: stopping at step {self.step} (preemption); final checkpoint taken")
                    stopped = True
                    break
            if handle is not None:
                handle.wait_staged()
                waits.append(handle.trainer_wait)
            self.ckpt.wait()
            if handle is not None:  # the final save: the run ends on it, and a restart resumes from it
                self._check_final_save(handle)
            # the fast tier's folder may go only once the store holds the run's newest step
            # (a failed final save leaves it in the tier; a resume with nothing to train too)
            self.persisted = self.ckpt.tier is None or self.ckpt.latest_step() == self.step
        finally:
            preempt.restore()
            if bar is not None:
                bar.close()
        summary = self._summary(time.perf_counter() - t_start, waits, stopped)
        (self.run_dir / f"summary-w{self.world}-r{self.rank}.json").write_text(json.dumps(summary))
        return summary

    def _check_final_save(self, handle: Any) -> None:
        """Raise ``FinalSaveFailed`` when the final checkpoint was not committed (every rank
        learns it from the store: the commit or the failure marker), naming what a restart
        resumes from. Saves before it may fail and training goes on; the last one may not."""
        try:
            handle.result()
        except Exception as e:  # noqa: BLE001 - SaveError, or a commit that never came (TimeoutError)
            why = e.__cause__ or e  # the storage's own error, not "save of step N failed" twice
            newest = self.ckpt.latest_step()
            tier = self.ckpt.tier is not None and self.ckpt.tier.saved > 0
            who = f"rank {self.rank}: " if self.world > 1 else ""  # each rank says its own
            raise FinalSaveFailed(
                f"{who}the final checkpoint, step {self.step}, failed: {why}; a restart resumes from "
                + (f"step {newest}" if newest is not None else "scratch (no committed checkpoint)")
                + (" (or the fast tier's newest step, if newer: this node's folder is kept)" if tier else "")
                + "; fix the storage and rerun: it trains again from there") from None

    def _gather_step(self, micro: list, loss_sum: float, weights_ok: bool = True) -> tuple[str, float, bool]:
        """One all-gather of this rank's step digests, loss sum and whether its updated weights
        are finite: the global batch digest, the global loss sum (added in rank order, the same
        on every rank) and whether every rank's weights are finite."""
        if isinstance(self.pipeline, UsualLoader):
            mine, combine = UsualLoader.step_digests(micro), UsualLoader.combine
        else:
            lanes: dict[int, bytes] = {}
            for b in micro:
                lanes.update(b.lane_digests)
            mine, combine = [lanes[k] for k in sorted(lanes)], global_batch_digest
        if self.world == 1:
            return combine(mine), loss_sum, weights_ok
        tail = np.array([loss_sum, float(weights_ok)], dtype=np.float64).tobytes()
        payload = np.frombuffer(b"".join(mine) + tail, dtype=np.uint8).copy()
        out = [torch.empty(len(payload), dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        dist.all_gather(out, torch.from_numpy(payload).to(self.device))
        out = [t.cpu() for t in out]
        digests: list[bytes] = []
        total, ok = 0.0, True
        for t in out:  # ranks in order: lanes in lane order
            raw = t.numpy().tobytes()
            digests += [raw[i: i + 32] for i in range(0, len(raw) - 16, 32)]
            loss, rank_ok = np.frombuffer(raw[-16:], dtype=np.float64)
            total += float(loss)
            ok = ok and bool(rank_ok)
        return combine(digests), total, ok

    def _log(self, row: dict, bar: Any) -> None:
        if self.quiet:
            return
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}")
        elif row["step"] % self.cfg.log_every == 0 or "eval_loss" in row:
            ev = f" eval {row['eval_loss']:.4f}" if "eval_loss" in row else ""
            print(f"step {row['step']:>6}  loss {row['loss']:.4f}{ev}  lr {row['lr']:.3g}  "
                  f"{row['step_s'] * 1e3:.0f} ms  batch {row['global_batch_sha256'][:12]}", flush=True)

    def _summary(self, wall: float, waits: list[float], stopped: bool) -> dict[str, Any]:
        rows = self.metrics.rows
        steps = [r["step_s"] for r in rows]
        data = [r["data_wait_s"] for r in rows]
        tokens = sum(r["tokens"] for r in rows)
        busy = sum(steps)
        summary = {
            "steps": len(rows), "last_step": self.step, "stopped": stopped, "world": self.world,
            "tokens_per_s": tokens / busy if busy else 0.0,
            "goodput": 1 - (sum(data) + sum(waits)) / busy if busy else 0.0,
            "ckpt_wait_p99_s": p99(waits), "data_wait_p99_s": p99(data[1:]), "data_wait_total_s": sum(data),
            "timings": self.timings, "wall_s": wall,
        }
        if rows and not self.quiet:
            print(f"flextrain: {summary['steps']} step{'' if summary['steps'] == 1 else 's'} on {ranks(self.world)}, {summary['tokens_per_s']:.0f} labelled "
                  f"tokens/s, goodput {summary['goodput']:.1%} (not waiting for data or checkpoints), checkpoint "
                  f"wait p99 {summary['ckpt_wait_p99_s'] * 1e3:.1f} ms, data wait p99 after step 1 "
                  f"{summary['data_wait_p99_s'] * 1e3:.2f} ms, final loss {rows[-1]['loss']:.4f}"
                  + (f", eval {rows[-1]['eval_loss']:.4f}" if "eval_loss" in rows[-1] else ""), flush=True)
        return summary

    def close(self) -> None:
        """Close what start-up built (all of it, once built). The fast tier's node folder
        goes only after a clean finish, its last step committed to the store; otherwise (an
        exception out of training, a stop during start-up, a failed final save) it stays,
        as its newest step may be newer than the store's and a restart resumes from it."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "ckpt"):
            self.ckpt.close(keep_tier=not self.persisted)
        for part in ("pipeline", "heldout"):
            if hasattr(self, part):
                getattr(self, part).close()


def run(cfg: TrainConfig, resume: bool | None = None, preempt: Preemption | None = None) -> dict[str, Any]:
    trainer = Trainer(cfg, resume=resume, preempt=preempt)
    try:
        return trainer.train()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
