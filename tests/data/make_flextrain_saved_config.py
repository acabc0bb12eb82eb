"""How tests/data/flextrain_saved_config.json was made: run with flextrain at commit
782a9db (whose trainer resolved ``autocast`` by changing the config it was given), from a
copy of that commit's ``src`` in /tmp/t28main. Kept for the record, not run by the tests.

    git archive 782a9db src | tar -x -C /tmp/t28main
    cd /tmp/t28main && PYTHONPATH=/tmp/t28main/src python .../make_flextrain_saved_config.py OUT.json

Each case trains (one step of each preset; two of a shrunk ``tiny``) in
/tmp/t28main/runs/<case> and keeps the checkpoint's ``trainer/config`` as saved, with the
bundled corpus folder written ``{CORPUS}`` and the 2-step run's folder ``{RUN_DIR}``.
(This one took 5.7 minutes on 2 shared cores.)
"""
import json
import sys
from pathlib import Path

from flexckpt import Checkpointer
from flextrain.cli import main
from flextrain.config import CORPUS, PRESETS
from flextrain.trainer import saved_trainer_values

BASE = Path("/tmp/t28main/runs")
PRESET_SETS = ["steps=1", "data.eval_batches=1"]
TINY_2STEP_SETS = ["data.max_length=64", "model.d_model=64", "model.d_ff=128", "data.lanes=1", "data.global_batch=1",
                   "data.micro_batch=1", "data.eval_batches=1", "ckpt_every=1", "steps=2"]


def saved_config(case: str, preset: str, sets: list[str]) -> str:
    run = BASE / case
    argv = ["train", "--run-dir", str(run), "--preset", preset, "--set", "device=cpu"]
    assert main(argv + [arg for s in sets for arg in ("--set", s)]) == 0
    with Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="freeze", read_only=True) as ckpt:
        text = saved_trainer_values(ckpt)[1]["config"]
    return text.replace(str(CORPUS), "{CORPUS}")


configs = {"tiny-2step": saved_config("tiny-2step", "tiny", TINY_2STEP_SETS).replace(str(BASE / "tiny-2step"), "{RUN_DIR}")}
configs.update({p: saved_config(p, p, PRESET_SETS) for p in PRESETS})
doc = {
    "about": "trainer/config as flextrain at 782a9db saved it (tests/data/make_flextrain_saved_config.py): one step "
             "of each preset with preset_sets and device=cpu, --run-dir /tmp/t28main/runs/<preset>; tiny-2step with "
             "tiny_2step_sets and --run-dir {RUN_DIR}; {CORPUS} is flextrain's bundled corpus folder",
    "preset_sets": PRESET_SETS, "tiny_2step_sets": TINY_2STEP_SETS, "configs": configs,
}
Path(sys.argv[1]).write_text(json.dumps(doc, indent=1) + "\n")
