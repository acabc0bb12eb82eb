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
        "test-tier, test-nodeloss, test-flextrain, bench or shell\n")


@pytest.mark.parametrize("argv", [["bench"], ["bench", "restor"]])
def test_a_missing_or_unknown_benchmark_lists_the_benchmarks(dev, capsys, argv):
    assert dev.main(argv) == 2
    out = capsys.readouterr().out
    assert out.startswith("no benchmark 'restor'; usage" if len(argv) == 2 else "usage: python3 dev.py bench NAME")
    names = out.split("NAME one of ")[1].split("; see")[0].split(", ")
    assert {"restore", "save_latency", "zephon_throughput"} <= set(names)
    assert not {"harness", "peers", "fsdp2_state"} & set(names)  # helpers, not benchmarks
