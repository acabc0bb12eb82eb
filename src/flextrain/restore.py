"""``flextrain plan``: whether and how a run resumes on N ranks, from its checkpoint alone.

The tensor part is flexckpt's ``restore_plan`` with the layouts the optimizer would give
at N ranks (``flexshard.plan_layouts``: ``Owned`` owners balanced by Newton-Schulz cost);
the data part replays the lane cursors in one process to digest the next global batches."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flexckpt import ByLane, Checkpointer, Storage, committed_steps, read_manifest, subset_load
from flexckpt.restore_plan import restore_plan
from flexshard import MuonConfig, ShardingConfig, plan_layouts
from flexshard.world import ranks
from zephon_state import global_batch_digest

from flextrain.config import ConfigError, from_dict, working_sizes, world_problems
from flextrain.data import build_pipeline
from flextrain.model import Transformer


def _layouts(cfg: Any, names: list[str], world: int) -> dict:
    import torch

    with torch.device("meta"):
        model = Transformer(cfg.model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    per_param = plan_layouts(shapes, world, ShardingConfig(placement=cfg.optim.placement), MuonConfig(),
                             model.hidden_matrices())
    out = {}
    for name in names:
        parts = name.split("/")
        param = parts[1] if parts[0] == "model" else parts[2]  # model/<p>, optim/state/<p>/<kind>
        out[name] = per_param[param]
    return out


def next_batch_digests(cfg: Any, data_state: dict, k: int, calibration: dict | None = None) -> list[str]:
    """Digests of the next ``k`` global batches after ``data_state`` (one process, all lanes)."""
    with build_pipeline(cfg.data, cfg.seed, 0, 1, calibration=calibration) as pipeline:
        pipeline.load_state_dict(data_state)
        out = []
        while len(out) < k:
            digests: dict[int, bytes] = {}
            while True:
                b = next(pipeline)
                digests.update(b.lane_digests)
                if b.last_in_step:
                    break
            out.append(global_batch_digest(digests))
    return out


def plan_restore(run_dir: str, world: int, step: int | None = None, batches: int = 0) -> dict[str, Any]:
    url = str(Path(run_dir).resolve() / "ckpt")
    if world < 1:
        raise ConfigError(f"--world {world}: must be >= 1")
    if batches < 0:
        raise ConfigError(f"--batches {batches}: must be >= 0 (how many of the next global batches to digest)")
    if not Path(run_dir).is_dir():  # looked at, not created
        raise ConfigError(f"{run_dir} does not exist; give the run folder of flextrain train (its --run-dir)")
    ckpt = Checkpointer(url, rank=0, world_size=1, run_id="plan", read_only=True)  # a plan changes nothing
    try:
        if not ckpt.steps():
            here = Path(run_dir).resolve()
            hint = (f"; {run_dir} is a checkpoint folder: give the run folder, {here.parent}"
                    if committed_steps(Storage(str(here))) else "; give the run folder of flextrain train (its --run-dir)")
            raise ConfigError(f"no committed checkpoint under {url}{hint}")
        probe = {"data": ByLane(), "trainer": {"step": 0, "config": "", "fingerprint": "", "data_state": "",
                                               "calibration": ""}}
        try:
            with subset_load():
                got = ckpt.load(probe, step=step, strict=False, fallback=step is None)  # as the resume would
        except Exception as e:  # noqa: BLE001 - a missing or unreadable run is the user's to fix
            raise ConfigError(str(e) if url in str(e) else f"{url}: {e}") from None
    finally:
        ckpt.close()
    cfg = from_dict(json.loads(probe["trainer"]["config"]))
    d = cfg.data
    problems = world_problems(d.lanes, d.global_batch, 1, world)
    manifest = read_manifest(Storage(url), got)
    plan: dict[str, Any] = {
        "run_dir": str(run_dir), "step": got, "saved_world": manifest.world_size, "world": world,
        "ok": not problems, "problem": problems, "working_sizes": working_sizes(d.lanes, d.global_batch),
        "lanes": d.lanes, "global_batch": d.global_batch,
    }
    if problems:
        return plan
    rp = restore_plan(manifest, _layouts(cfg, sorted(manifest.tensors), world), world)
    per = d.lanes // world
    plan["ranks"] = [dict(r.__dict__, lanes=[r.rank * per, (r.rank + 1) * per - 1],
                          microbatches=(d.global_batch // world) // min(d.micro_batch, d.global_batch // world))
                     for r in rp.ranks]
    kinds: dict[str, dict] = {}
    for t in rp.tensors:
        part = "model (fp32 masters)" if t.name.startswith("model/") else "optimizer state"
        key = f"{t.saved['kind']} -> {t.target['kind']}"
        kinds.setdefault(part, {}).setdefault(key, 0)
        kinds[part][key] += 1
    plan["tensors"] = kinds
    plan["plain"] = list(rp.plain)
    plan["by_lane"] = list(rp.lanes)
    plan["per_rank"] = list(rp.per_rank)
    if batches:
        data_state = json.loads(probe["trainer"]["data_state"])
        data_state["lanes"] = probe["data"].values
        plan["next_batches"] = [{"step": got + 1 + i, "global_batch_sha256": h}
                                for i, h in enumerate(next_batch_digests(
                                    cfg, data_state, batches, json.loads(probe["trainer"]["calibration"] or "null")))]
    return plan


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def describe(plan: dict[str, Any]) -> str:
    lines = [f"{plan['run_dir']}: step {plan['step']} saved on {ranks(plan['saved_world'])}; resume on {plan['world']}:"]
    if not plan["ok"]:
        lines.append(f"  NO: {plan['problem']}")
        lines.append(f"  sizes that work (lanes {plan['lanes']}, global batch {plan['global_batch']}): "
                     f"{plan['working_sizes']}")
        return "\n".join(lines)
    for part, moves in plan["tensors"].items():
        lines.append(f"  {part}: " + ", ".join(f"{n} x {k}" for k, n in moves.items()) + " (resharded on load)")
    lines.append(f"  lane cursors ({', '.join(plan['by_lane'])}): {plan['lanes']} lanes, every rank takes its "
                 f"{plan['lanes'] // plan['world']}; the global batches stay the same")
    lines.append(f"  plain values ({len(plan['plain'])}: step, config, fingerprints): restored as they are")
    lines.append(f"  per-rank values: {plan['per_rank'] or 'none'} (RNG is derived from seed and step)")
    lines.append(f"  {'rank':>4}  {'lanes':>7}  {'microbatches':>12}  {'holds':>12}  {'reads':>12}  {'requests':>8}  {'memory':>12}")
    for r in plan["ranks"]:
        lines.append(f"  {r['rank']:>4}  {r['lanes'][0]:>3}-{r['lanes'][1]:<3}  {r['microbatches']:>12}  "
                     f"{_mib(r['holds']):>12}  {_mib(r['reads']):>12}  {r['requests']:>8}  {_mib(r['memory']):>12}")
    for b in plan.get("next_batches", []):
        lines.append(f"  step {b['step']:>6}  global_batch_sha256 {b['global_batch_sha256']}")
    return "\n".join(lines)
