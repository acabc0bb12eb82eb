"""``python3 dev.py``: a mistyped task or benchmark is refused before the environment is set
up (which installs torch on first use), with the names that work."""
from __future__ import annotations

import importlib.util
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
        "test-nodeloss, test-flextrain, test-trainers, bench or shell\n")


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
    assert [Path(a).name for a in cmd if a.endswith(".py")] == files
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
