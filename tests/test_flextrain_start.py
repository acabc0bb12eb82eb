"""Where a flextrain run starts, and the configuration it saves.

The start decision is pure (``flextrain.start``): every combination of what the user asked
(``--resume``, ``--fresh``, neither) and what the store and the fast tier hold, with exact
outputs and messages, without processes or files. The configuration a run saves in its
checkpoints (``trainer/config``, which ``check_resumable`` compares on resume) is byte for
byte what main's code (at ``782a9db``) saved, frozen in
``tests/data/flextrain_saved_config.json`` from real runs of that code (one step of each
preset, and a 2-step run of a shrunk ``tiny``); a run folder written so resumes."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from flextrain.config import CORPUS, PRESETS, load_config
from flextrain.device import resolve
from flextrain.start import Start, decide_after_tier_failure, decide_start, resume_refusal
from flextrain.trainer import checkpoint_state

RUN = Path("/runs/r1")
TIER = "/dev/shm/flexckpt"
FRESH_STORE = ("--fresh: /runs/r1/ckpt holds committed steps up to 7 of an earlier run, which a restart would resume "
               "from and retention would keep over this run's; pass a new --run-dir (or remove that folder to start "
               "over there)")
FRESH_TIER = ("--fresh: the fast tier (/dev/shm/flexckpt) holds step 5 of an earlier run in /runs/r1, which a restart "
              "would resume from; pass a new --run-dir (or remove that folder to start over there)")
RESUME_NONE = "--resume: no committed checkpoint under /runs/r1/ckpt; drop --resume to start a new run there"

# (asked, the store's newest step, the tier's newest step) -> the start; every combination
STARTS = {
    (None, None, None): Start("fresh"),
    (None, None, 5): Start("tier", 5),
    (None, 7, None): Start("store", 7),
    (None, 7, 5): Start("store", 7),  # the store's step first (the trainer asks the tier only when it has none)
    (True, None, None): Start("refuse", message=RESUME_NONE),
    (True, None, 5): Start("tier", 5),
    (True, 7, None): Start("store", 7),
    (True, 7, 5): Start("store", 7),
    (False, None, None): Start("fresh"),
    (False, None, 5): Start("refuse", message=FRESH_TIER),
    (False, 7, None): Start("refuse", message=FRESH_STORE),
    (False, 7, 5): Start("refuse", message=FRESH_STORE),
}


@pytest.mark.parametrize("asked,newest,held", list(STARTS), ids=[f"asked={a}-store={n}-tier={h}" for a, n, h in STARTS])
def test_the_start_of_every_request_and_folder(asked, newest, held):
    assert decide_start(asked, newest, held, RUN, TIER) == STARTS[(asked, newest, held)]


def test_a_start_is_a_frozen_value():
    start = decide_start(None, 7, None, RUN, TIER)
    with pytest.raises(AttributeError):
        start.step = 3  # type: ignore[misc]
    assert start == Start("store", 7, "") and hash(start) == hash(Start("store", 7))


WHY = "the fast tier's step 5 cannot be restored (node 1 lost with the only copy of rank 1's part)"
AFTER_TIER = {
    (None, False): Start("fresh", message=f"flextrain: {WHY}, and the persistent store has no checkpoint: starting "
                                          "from step 0"),
    (False, False): Start("fresh", message=f"flextrain: {WHY}, and the persistent store has no checkpoint: starting "
                                           "from step 0"),
    (True, False): Start("refuse", message=f"--resume: no committed checkpoint under /runs/r1/ckpt, and {WHY}; drop "
                                           "--resume to start the run over there"),
}
OTHER = Start("refuse", message=f"{WHY}: it was saved with another model structure than this config's; restore the "
                                "run's config to resume from it (the tier keeps it), or pass a new --run-dir")
AFTER_TIER.update({(asked, True): OTHER for asked in (None, False, True)})


@pytest.mark.parametrize("asked,other_structure", list(AFTER_TIER))
def test_the_start_when_the_tier_cannot_restore_its_step(asked, other_structure):
    got = decide_after_tier_failure(asked, 5, "node 1 lost with the only copy of rank 1's part", other_structure, RUN)
    assert got == AFTER_TIER[(asked, other_structure)]


def test_a_changed_fingerprinted_field_is_named_and_a_performance_one_is_not():
    saved = json.dumps(load_config().to_dict())
    assert resume_refusal(saved, load_config(sets=["ckpt_every=3", "data.micro_batch=1", "device=cpu"])) == ""
    assert resume_refusal(saved, load_config(sets=["seed=4", "data.max_length=128"])) == (
        "the checkpoint was written by a run with other numbers; these fields differ:\n"
        "  data.max_length: saved 256, now 128\n  seed: saved 0, now 4\n"
        "set them back (e.g. --set data.max_length=...), or start a new run in another --run-dir. Performance "
        "settings (ranks, device, data.micro_batch, optim.placement, ckpt_every, data.workers) may change.")


def test_a_run_saved_from_another_install_of_the_bundled_corpora_resumes_and_another_file_does_not():
    # the default sources are absolute paths into the installed package: a run folder made from
    # a checkout must resume from a wheel install (or a moved venv), whose paths differ
    saved_cfg = load_config().to_dict()
    elsewhere = "/opt/venv/lib/python3.12/site-packages/flextrain/corpus"
    saved_cfg["data"]["sources"] = {"prose": f"{elsewhere}/kjv.jsonl.zst", "code": f"{elsewhere}/python_stdlib.jsonl.zst"}
    saved = json.dumps(saved_cfg)
    assert resume_refusal(saved, load_config()) == ""
    swapped = load_config(sets=[f'data.sources={{"prose": "{CORPUS}/python_stdlib.jsonl.zst", '
                                f'"code": "{CORPUS}/python_stdlib.jsonl.zst"}}'])
    assert "  data.sources.prose: saved '<bundled corpus kjv.jsonl.zst>', now '<bundled corpus python_stdlib" \
        in resume_refusal(saved, swapped)
    mine = load_config(sets=['data.sources={"prose": "/data/kjv.jsonl.zst", "code": "/data/py.jsonl.zst"}'])
    assert "data.sources.prose: saved '<bundled corpus kjv.jsonl.zst>', now '/data/kjv.jsonl.zst'" \
        in resume_refusal(saved, mine)


def test_resolve_gives_a_new_config_and_leaves_the_given_one_as_it_was():
    cfg = load_config()
    before = copy.deepcopy(cfg.to_dict())
    on_cpu, on_cuda = resolve(cfg, torch.device("cpu")), resolve(cfg, torch.device("cuda", 0))
    assert (cfg.autocast, on_cpu.autocast, on_cuda.autocast) == ("auto", "none", "bf16")
    assert cfg.to_dict() == before
    on_cpu.data.sources["web"] = "x"  # shares nothing with the given one
    assert cfg.to_dict() == before
    assert resolve(load_config(sets=["autocast=bf16"]), torch.device("cpu")).autocast == "bf16"
    assert resolve(on_cuda, torch.device("cpu")).validate().autocast == "bf16"


# ---- the saved configuration, byte for byte as main's code saved it ---------------------------
FROZEN = json.loads((Path(__file__).parent / "data" / "flextrain_saved_config.json").read_text())


def _expected(name: str, run_dir: str) -> str:
    return FROZEN["configs"][name].replace("{CORPUS}", str(CORPUS)).replace("{RUN_DIR}", run_dir)


class _NoParameters:
    def state_dict(self) -> dict:
        return {"step": 0, "params": {}}


def test_every_preset_saves_the_config_main_saved():
    assert sorted(FROZEN["configs"]) == sorted([*PRESETS, "tiny-2step"])  # a new preset: freeze it too
    for preset in PRESETS:
        run_dir = f"/tmp/t28main/runs/{preset}"
        cfg = resolve(load_config(preset, sets=["device=cpu", *FROZEN["preset_sets"], f"run_dir={run_dir}"]),
                      torch.device("cpu"))
        saved = checkpoint_state(_NoParameters(), 1, cfg, {"lanes": {}})["trainer"]["config"]
        assert saved == _expected(preset, run_dir), preset


def test_a_run_folder_saved_as_main_saved_it_resumes_and_the_given_config_stays_as_it_was(tmp_path, capsys):
    """A 2-step run (the CLI) saves main's bytes; a resume from it (a ``Trainer`` given a
    config of 3 steps) loads step 2 and trains step 3, and changes nothing in that config."""
    from flexckpt import Checkpointer
    from flextrain.cli import main
    from flextrain.launch import metrics
    from flextrain.trainer import Trainer, saved_trainer_values

    run = tmp_path / "run"
    sets = ["device=cpu", *FROZEN["tiny_2step_sets"]]
    assert main(["train", "--run-dir", str(run), *[arg for s in sets for arg in ("--set", s)]]) == 0
    with Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True) as ckpt:
        assert saved_trainer_values(ckpt)[1]["config"] == _expected("tiny-2step", str(run))
    cfg = load_config(sets=[*sets, "steps=3", f"run_dir={run}"])
    given = copy.deepcopy(cfg.to_dict())
    trainer = Trainer(cfg, quiet=True)
    try:
        assert (trainer.resumed_from, trainer.cfg.autocast) == (2, "none")
        trainer.train()
    finally:
        trainer.close()
    assert cfg.to_dict() == given  # main's trainer set the caller's autocast to "none"
    assert sorted(metrics(run)) == [1, 2, 3]
    assert "flextrain: resumed step 2 on 1 rank" in capsys.readouterr().err
