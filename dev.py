#!/usr/bin/env python3
"""Project tasks that set themselves up: a local virtual environment in .venv, reused when
it is up to date. Needs nothing but Python 3.10+.

    python3 dev.py demo            # the main job: train, stop, resume at D=1 and D=4 (flextrain)
    python3 dev.py demo-checkpoint # the checkpoint-only demo (flexckpt: save at 2, load at 1 and 4)
    python3 dev.py test [args]     # the whole test suite (extra args go to pytest)
    python3 dev.py test-torchtitan # torchtitan's trainer with flexckpt and zephon: the full matrix
    python3 dev.py test-tierkill [--random N] # SIGKILL during fast-tier copies: every chosen point + N random (60)
    python3 dev.py test-kill [--random N] # SIGKILL during saves: every chosen storage call + N random times (100)
    python3 dev.py test-nodeloss   # flextrain, 12 lanes, 4 nodes: loses a node, resumes on 3 and 2 ranks (fast tier)
    python3 dev.py test-flextrain  # flextrain's launch matrix: the resume tests, SIGTERM to 2-rank torchrun, node loss
    python3 dev.py test-trainers   # the trainer integrations' opt-in runs: the HF Trainer on 2 processes (~1 min)
    python3 dev.py test-wheel      # build the wheel, install it in a fresh venv (CPU torch first), use it outside the repo
    python3 dev.py bench NAME ...  # a benchmark from bench/ (see bench/README.md)
    python3 dev.py shell CMD ...   # run CMD inside the environment
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
# The CPU build lies on these machines' disk; a bare "torch" would download a CUDA build.
TORCH = "torch==2.13.0"
EXTRAS = "test,bench"
TASKS = ("demo", "demo-checkpoint", "test", "test-torchtitan", "test-tierkill", "test-kill", "test-nodeloss",
         "test-flextrain", "test-trainers", "test-wheel", "bench", "shell")


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _wanted_stamp() -> str:
    h = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt", "dev.py"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def _pip(py: Path, *args: str) -> None:
    cmd = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def ensure_env() -> Path:
    py = _venv_python()
    stamp = VENV / ".flexckpt-installed"
    wanted = _wanted_stamp()
    if py.exists() and stamp.exists() and stamp.read_text() == wanted:
        return py
    if not py.exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    constraints = str(ROOT / "constraints.txt")
    _pip(py, TORCH)  # first, alone: the CPU build from the local disk
    _pip(py, "-c", constraints, "-e", f".[{EXTRAS}]")
    stamp.write_text(wanted)
    return py


def test_wheel(run=subprocess.run) -> int:
    """Use the project as a user would: build the wheel, install it in a fresh venv (the CPU
    torch first, then the wheel with its [torchtitan] extra, without constraints.txt), and
    outside the repository train three steps of flextrain's tiny preset on the bundled
    corpora, print the version, import flexckpt_torchtitan (Python >= 3.11, as torchtitan) and
    run the README's FSDP2 example at world 2, then again at world 1, which resumes it. Needs
    nothing from .venv."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    tmp = Path(tempfile.mkdtemp(prefix="flexckpt-wheel-"))
    env_dir, dist, outside = tmp / "venv", tmp / "dist", tmp / "outside"
    outside.mkdir()
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    py = str(bin_dir / ("python.exe" if os.name == "nt" else "python"))
    example = outside / "fsdp2_quickstart.py"  # the README's, checkpointing into tmp
    example.write_text((ROOT / "demos" / "fsdp2_quickstart.py").read_text().replace(
        "file:///tmp/flexckpt-quickstart", (tmp / "checkpoints").as_uri()))
    titan = sys.version_info >= (3, 11)
    steps = [  # (what, command, what its last line of output must hold)
        ("build the wheel", [py, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(dist)], ""),
        ("install the CPU torch", [py, "-m", "pip", "install", "-q", TORCH], ""),
        ("install the wheel" + " [torchtitan]" * titan, [py, "-m", "pip", "install", "-q", "WHEEL"], ""),
        ("flextrain train --preset tiny", [str(bin_dir / "flextrain"), "train", "--preset", "tiny",
                                           "--run-dir", "X", "--set", "steps=3"], "flextrain: 3 steps on 1 rank"),
        ("__version__", [py, "-c", "import flexckpt, flexshard, zephon_state; print(flexckpt.__version__)"], version),
        *[("import flexckpt_torchtitan", [py, "-c", "import flexckpt_torchtitan; print('imported')"], "imported")]
        * titan,
        ("FSDP2 example at world 2", [py, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(example)],
         "saved step 10"),
        ("FSDP2 example resumed at world 1", [py, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                              str(example)], "resumed at 10, saved step 20"),
    ]
    print(f"testing the wheel of flexckpt {version} in {tmp}", flush=True)
    start = time.monotonic()
    venv.create(env_dir, with_pip=True)
    timings = [("create the venv", time.monotonic() - start)]
    for name, cmd, expect in steps:
        if cmd[-1] == "WHEEL":
            cmd[-1] = str(next(dist.glob("flexckpt-*.whl"))) + "[torchtitan]" * titan
        start = time.monotonic()
        print(f"+ {name}: {' '.join(cmd)}", flush=True)
        out = run(cmd, cwd=outside, capture_output=True, text=True)
        timings.append((name, time.monotonic() - start))
        last = (out.stdout.strip().splitlines() or [""])[-1]
        if out.returncode != 0 or expect not in last:
            print(out.stdout[-3000:], out.stderr[-3000:], f"test-wheel: {name} failed (exit {out.returncode}, "
                  f"last line {last!r}, expected {expect!r}); the venv is kept in {tmp}", sep="\n")
            return 1
        if last:
            print(f"  {last}", flush=True)
    for name, seconds in timings:
        print(f"{seconds:8.1f} s  {name}")
    print(f"{sum(s for _, s in timings):8.1f} s  in all: the wheel works outside the repository")
    shutil.rmtree(tmp)
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    task, rest = argv[0], argv[1:]
    if task not in TASKS:  # before the set-up: a typo must not install anything
        print(f"unknown task {task!r}; expected {', '.join(TASKS[:-1])} or {TASKS[-1]}\n{__doc__}")
        return 2
    if task == "bench" and not (rest and (ROOT / "bench" / f"{rest[0]}.py").is_file()):
        names = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if "__main__" in p.read_text())  # not helpers
        got = f"no benchmark {rest[0]!r}; " if rest else ""
        print(f"{got}usage: python3 dev.py bench NAME [args], NAME one of {', '.join(names)}; see bench/README.md")
        return 2
    if task == "test-wheel":  # its own fresh venv, not .venv
        return test_wheel()
    py = str(ensure_env())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if task == "demo":
        cmd = [py, "-m", "flextrain.demo", *rest]
    elif task == "demo-checkpoint":
        cmd = [py, str(ROOT / "demos" / "checkpoint_demo.py"), *rest]
    elif task == "test":
        cmd = [py, "-m", "pytest", *rest]
    elif task == "test-torchtitan":
        cmd = [py, str(ROOT / "tests" / "torchtitan_matrix.py"), *rest]
    elif task == "test-tierkill":
        cmd = [py, str(ROOT / "tests" / "tier_kill_trials.py"), "--chosen", *(rest or ["--random", "60"])]
    elif task == "test-kill":
        cmd = [py, str(ROOT / "tests" / "kill_trials.py"), "--chosen", *(rest or ["--random", "100"])]
    elif task == "test-nodeloss":
        env["FLEXTRAIN_NODELOSS"] = "1"
        cmd = [py, "-m", "pytest", str(ROOT / "tests" / "test_flextrain_nodeloss.py"), "-q", "-s", *rest]
    elif task == "test-flextrain":
        env.update(FLEXTRAIN_MATRIX="1", FLEXTRAIN_NODELOSS="1")
        files = ("test_flextrain_resume.py", "test_flextrain_nodeloss.py")
        cmd = [py, "-m", "pytest", *(str(ROOT / "tests" / f) for f in files), "-q", *rest]
    elif task == "test-trainers":
        env["FLEXCKPT_TRAINERS_MATRIX"] = "1"
        cmd = [py, "-m", "pytest", str(ROOT / "tests" / "test_hf_trainer.py"), "-q", *rest]
    elif task == "bench":
        cmd = [py, str(ROOT / "bench" / f"{rest[0]}.py"), *rest[1:]]
    elif task == "shell":
        cmd = [py, *rest] if rest and rest[0].endswith(".py") else rest or [py]
        cmd = [str(VENV / "bin" / cmd[0]) if (VENV / "bin" / cmd[0]).exists() else cmd[0], *cmd[1:]]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
