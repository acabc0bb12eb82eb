"""Start training runs as processes (one process, or torchrun with ``world`` ranks) and read
their logs: what the demo, the experiments and the benchmarks share."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    """One torch thread per rank; this checkout's sources first."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONUNBUFFERED="1")


def train_command(world: int, run_dir: Path, sets: list[str], module: str = "flextrain",
                  preset: str = "tiny") -> list[str]:
    args = ["train", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    if preset != "tiny":
        args += ["--preset", preset]
    if world == 1:
        return [sys.executable, "-m", module, *args]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc-per-node={world}", "-m", module, *args]


def train(world: int, run_dir: Path, sets: list[str], timeout: float = 1800, module: str = "flextrain",
          preset: str = "tiny") -> str:
    """Run to the end; returns stderr; raises with its tail on failure."""
    out = subprocess.run(train_command(world, run_dir, sets, module, preset), env=env(), capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"training at D={world} in {run_dir} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stderr


def train_until_signal(world: int, run_dir: Path, sets: list[str], after_steps: int, timeout: float = 600,
                       preset: str = "tiny") -> int:
    """Start a run, send SIGTERM to its launcher once ``after_steps`` steps are logged, wait;
    returns the launcher's exit code."""
    proc = subprocess.Popen(train_command(world, run_dir, sets, preset=preset), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        log = run_dir / "metrics.jsonl"
        while not (log.exists() and len(log.read_text().splitlines()) >= after_steps):
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before step {after_steps}:\n{proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {after_steps} steps within {timeout} s")
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        return proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def metrics(run_dir: Path) -> dict[int, dict]:
    """``metrics.jsonl`` by step (a resumed run's line wins over an older one)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r for r in rows}


def copy_run_at(src: Path, dst: Path, step: int) -> Path:
    """A copy of a run folder as it was at ``step``: later checkpoints and log lines removed."""
    shutil.copytree(src, dst)
    for d in (dst / "ckpt").iterdir():
        if d.name.startswith("step-") and int(d.name[5:]) > step:
            shutil.rmtree(d)
    rows = [r for r in (dst / "metrics.jsonl").read_text().splitlines() if r and json.loads(r)["step"] <= step]
    (dst / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return dst
