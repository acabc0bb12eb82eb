"""Where a run starts: step 0, the persistent store's newest step, or the fast tier's, or a
refusal naming why and the fix. Pure functions of what the run folder and the tier hold and
what the user asked (nanoGPT keeps its ``init_from`` as obvious); the trainer asks the
store and the tier, calls these, and does what they say."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flextrain.config import TrainConfig, differences


@dataclass(frozen=True)
class Start:
    """``fresh``: from step 0 (``message``, if any, is said first); ``store``: resume the
    persistent store's newest committed step ``step`` (the load falls back to an older one
    if it cannot read it); ``tier``: resume the fast tier's newest held step ``step`` (the
    store has none); ``refuse``: start nothing and change nothing, ``message`` says why and
    the fix."""
    source: Literal["fresh", "store", "tier", "refuse"]
    step: int | None = None
    message: str = ""


def decide_start(asked: bool | None, newest: int | None, held: int | None, run_dir: Path,
                 tier_root: str | None = None) -> Start:
    """The start, from what the user asked and what the run folder holds.

    ``asked``: True for ``--resume`` (a checkpoint is required), False for ``--fresh`` (none
    may exist: an earlier run's steps would outrank this run's, for a restart and for
    retention), None for neither (resume when there is one). ``newest``: the store's newest
    committed step; ``held``: the fast tier's newest step (None when the store has one or
    there is no tier; ``tier_root`` is the tier's folder, for the message)."""
    ckpt = run_dir / "ckpt"
    if asked is not False:
        if newest is not None:
            return Start("store", newest)
        if held is not None:
            return Start("tier", held)
        if asked:
            return Start("refuse", message=f"--resume: no committed checkpoint under {ckpt}; "
                                           "drop --resume to start a new run there")
        return Start("fresh")
    if newest is not None:
        return Start("refuse", message=f"--fresh: {ckpt} holds committed steps up to {newest} of an earlier run, "
                                       f"which a restart would resume from and retention would keep over this "
                                       f"run's; pass a new --run-dir (or remove that folder to start over there)")
    if held is not None:
        return Start("refuse", message=f"--fresh: the fast tier ({tier_root}) holds step {held} of an earlier run "
                                       f"in {run_dir}, which a restart would resume from; pass a new --run-dir "
                                       f"(or remove that folder to start over there)")
    return Start("fresh")


def decide_after_tier_failure(asked: bool | None, held: int, reason: str, other_structure: bool,
                              run_dir: Path) -> Start:
    """The start when the store has no checkpoint and the fast tier's step ``held`` could not
    be restored (``reason``, the tier's recovery says; ``other_structure``: it was saved with
    another model structure). A changed config is refused, as a store resume refuses it,
    and the tier keeps the step; ``--resume`` is refused; otherwise a fresh start, said."""
    why = f"the fast tier's step {held} cannot be restored ({reason})"
    if other_structure:
        return Start("refuse", message=f"{why}: it was saved with another model structure than this config's; restore "
                                       f"the run's config to resume from it (the tier keeps it), or pass a new --run-dir")
    if asked:
        return Start("refuse", message=f"--resume: no committed checkpoint under {run_dir / 'ckpt'}, and {why}; "
                                       "drop --resume to start the run over there")
    return Start("fresh", message=f"flextrain: {why}, and the persistent store has no checkpoint: starting from step 0")


def resume_refusal(saved_config: str, cfg: TrainConfig) -> str:
    """'' when a checkpoint whose ``trainer/config`` is ``saved_config`` may resume under
    ``cfg`` (its fingerprinted fields equal), else the message naming each field that
    differs and the fix."""
    diffs = differences(json.loads(saved_config), cfg.to_dict())
    if not diffs:
        return ""
    return ("the checkpoint was written by a run with other numbers; these fields differ:\n  " + "\n  ".join(diffs)
            + "\nset them back (e.g. --set data.max_length=...), or start a new run in another --run-dir. "
            "Performance settings (ranks, device, data.micro_batch, optim.placement, ckpt_every, data.workers) "
            "may change.")
