"""``python3 dev.py``: a mistyped task or benchmark is refused before the environment is set
up (which installs torch on first use), with the names that work."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def dev(monkeypatch):
    spec = importlib.util.spec_from_file_location("dev_tasks_under_test", ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def no_set_up():
        raise AssertionError("the environment was set up for a task that cannot run")

    monkeypatch.setattr(module, "ensure_env", no_set_up)
    return module


def test_an_unknown_task_is_refused_before_the_set_up(dev, capsys):
    assert dev.main(["tset"]) == 2
    assert capsys.readouterr().out.startswith(
        "unknown task 'tset'; expected demo, demo-checkpoint, test, test-torchtitan, test-tierkill, test-kill, "
        "test-nodeloss, test-flextrain, test-trainers, test-wheel, bench or shell\n")


@pytest.mark.parametrize("argv", [["bench"], ["bench", "restor"]])
def test_a_missing_or_unknown_benchmark_lists_the_benchmarks(dev, capsys, argv):
    assert dev.main(argv) == 2
    out = capsys.readouterr().out
    assert out.startswith("no benchmark 'restor'; usage" if len(argv) == 2 else "usage: python3 dev.py bench NAME")
    names = out.split("NAME one of ")[1].split("; see")[0].split(", ")
    assert {"restore", "save_latency", "zephon_throughput"} <= set(names)
    assert not {"harness", "peers", "fsdp2_state"} & set(names)  # helpers, not benchmarks


# the launches kept out of the default suite: each dev.py task must set the very variable its
# tests' skip reads and run their file, or it passes with them skipped
@pytest.mark.parametrize("task,files,variables", [
    ("test-nodeloss", ["test_flextrain_nodeloss.py"], ["FLEXTRAIN_NODELOSS"]),
    ("test-flextrain", ["test_flextrain_resume.py", "test_flextrain_nodeloss.py"],
     ["FLEXTRAIN_MATRIX", "FLEXTRAIN_NODELOSS"]),
    ("test-trainers", ["test_hf_trainer.py"], ["FLEXCKPT_TRAINERS_MATRIX"]),
])
def test_an_opt_in_task_sets_what_its_tests_read_and_runs_their_files(dev, monkeypatch, task, files, variables):
    ran = []
    monkeypatch.setattr(dev, "ensure_env", lambda: Path("py"))
    monkeypatch.setattr(dev.subprocess, "call", lambda cmd, cwd, env: ran.append((cmd, env)) or 0)
    for name in ("FLEXTRAIN_MATRIX", "FLEXTRAIN_NODELOSS", "FLEXCKPT_TRAINERS_MATRIX"):
        monkeypatch.delenv(name, raising=False)
    assert dev.main([task]) == 0
    (cmd, env), = ran
    assert [Path(a).relative_to(ROOT / "tests").as_posix() for a in cmd if a.endswith(".py")] == files
    assert {v: env.get(v) for v in variables} == dict.fromkeys(variables, "1")
    for f in files:  # read by a skip of that file (the other variables are some other task's)
        source = (ROOT / "tests" / f).read_text()
        assert any(f'os.environ.get("{v}")' in source for v in variables), (f, variables)


def test_the_kill_task_runs_every_chosen_point_and_100_random_times(dev, monkeypatch):
    ran = []
    monkeypatch.setattr(dev, "ensure_env", lambda: Path("py"))
    monkeypatch.setattr(dev.subprocess, "call", lambda cmd, cwd, env: ran.append(cmd) or 0)
    assert dev.main(["test-kill"]) == 0 and dev.main(["test-kill", "--random", "7"]) == 0
    assert [cmd[1:] for cmd in ran] == [[str(ROOT / "tests" / "kill_trials.py"), "--chosen", "--random", "100"],
                                         [str(ROOT / "tests" / "kill_trials.py"), "--chosen", "--random", "7"]]


class FakeRun:
    """Answers test-wheel's commands as a working wheel would, except where told to fail."""

    def __init__(self, version, fail=None):
        self.version, self.fail, self.calls, self.example = version, fail, [], None

    def __call__(self, cmd, cwd, capture_output, text):
        self.calls.append((cmd, Path(cwd)))
        if "wheel" in cmd and "-w" in cmd:  # the build leaves a wheel where the install looks
            dist = Path(cmd[cmd.index("-w") + 1])
            dist.mkdir(parents=True, exist_ok=True)
            (dist / f"flexckpt-{self.version}-py3-none-any.whl").touch()
        script = " ".join(cmd)
        if cmd[-1].endswith("fsdp2_quickstart.py"):
            self.example = Path(cmd[-1]).read_text()
        out = next((line for key, line in [
            ("__version__", self.version), ("import flexckpt_torchtitan", "imported"),
            ("--nproc-per-node 1", "rank 0 of 1: resumed at 10, saved step 20"),
            ("--nproc-per-node 2", "rank 0 of 2: resumed at 0, saved step 10"),
            ("flextrain train", "flextrain: 3 steps on 1 rank, ...")] if key in script), "")
        if self.fail and self.fail in script:
            return subprocess.CompletedProcess(cmd, 1, "", "boom")
        return subprocess.CompletedProcess(cmd, 0, out + "\n", "")


@pytest.fixture
def wheel_dev(dev, monkeypatch, tmp_path):
    monkeypatch.setattr(dev.venv, "create", lambda path, with_pip: None)  # no real venv: seconds, not minutes
    monkeypatch.setattr(dev.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    return dev, version


def test_the_wheel_task_sets_up_no_dev_venv(dev, monkeypatch):
    ran = []
    monkeypatch.setattr(dev, "test_wheel", lambda: ran.append("test_wheel") or 0)
    assert dev.main(["test-wheel"]) == 0 and ran == ["test_wheel"]  # the fixture's ensure_env was not called


def test_the_wheel_task_installs_the_cpu_torch_first_then_the_wheel_and_runs_outside_the_repository(
        wheel_dev, tmp_path, capsys):
    dev, version = wheel_dev
    run = FakeRun(version)
    assert dev.test_wheel(run) == 0
    cmds = [" ".join(cmd) for cmd, _ in run.calls]
    build, torch_first, wheel = cmds[:3]
    assert build.endswith(f"-m pip wheel -q --no-deps {ROOT} -w {tmp_path / 'dist'}")
    assert torch_first.endswith("-m pip install -q torch==2.13.0")
    assert wheel.endswith(f"-m pip install -q {tmp_path / 'dist'}/flexckpt-{version}-py3-none-any.whl"
                          + "[torchtitan]" * (sys.version_info >= (3, 11)))
    assert cmds[3].endswith("bin/flextrain train --preset tiny --run-dir X --set steps=3")
    assert {cwd for _, cwd in run.calls} == {tmp_path / "outside"} and ROOT not in tmp_path.parents
    assert cmds[-2].endswith(f"-m torch.distributed.run --nproc-per-node 2 {tmp_path / 'outside' / 'fsdp2_quickstart.py'}")
    assert cmds[-1].endswith(f"-m torch.distributed.run --nproc-per-node 1 {tmp_path / 'outside' / 'fsdp2_quickstart.py'}")
    readme_example = (ROOT / "demos" / "fsdp2_quickstart.py").read_text()  # checkpointing in tmp instead
    assert "file:///tmp/flexckpt-quickstart" in readme_example
    assert run.example == readme_example.replace("file:///tmp/flexckpt-quickstart", (tmp_path / "checkpoints").as_uri())
    assert "in all: the wheel works outside the repository" in capsys.readouterr().out
    assert not tmp_path.exists()  # removed after a success


@pytest.mark.parametrize("fail,expect", [("--preset tiny", "flextrain train --preset tiny failed (exit 1"),
                                         ("print(flexckpt.__version__)", "__version__ failed (exit 1")])
def test_the_wheel_task_fails_on_the_first_step_that_fails(wheel_dev, capsys, fail, expect):
    dev, version = wheel_dev
    run = FakeRun(version, fail)
    assert dev.test_wheel(run) == 1
    assert expect in capsys.readouterr().out
    assert fail in " ".join(run.calls[-1][0])  # nothing ran after it


def test_the_wheel_task_fails_when_the_installed_version_is_not_pyprojects(wheel_dev, capsys):
    dev, version = wheel_dev
    assert dev.test_wheel(FakeRun("0.0.0")) == 1
    assert f"__version__ failed (exit 0, last line '0.0.0', expected '{version}')" in capsys.readouterr().out
