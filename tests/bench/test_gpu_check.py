"""bench/gpu_check.py without a GPU: it skips cleanly, its runner keeps each part's rows
and times a part out on its own, and the parts that can run on the CPU do, at small sizes."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check  # noqa: E402

CPU = torch.device("cpu")


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_each_part_has_its_own_timeout_and_rows_land_as_they_come(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "TIMEOUTS", {"fast": 20, "slow": 1})
    child = ("import json, os, time, sys; open(os.environ['OUT'] + '/gpu_check.jsonl', 'a').write("
             "json.dumps({'part': sys.argv[1], 'what': 'x', 'value': 1}) + '\\n'); time.sleep(float(sys.argv[2]))")
    waits = {"fast": "0", "slow": "30"}

    def runner(name, timeout, out):
        return gpu_check.run_part(name, timeout, out, argv=[sys.executable, "-c", child, name, waits[name]])

    assert gpu_check.run_all(["fast", "slow"], tmp_path, runner) == 1
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert [(r["part"], r["what"], r["value"]) for r in rows] == [
        ("fast", "x", 1), ("fast", "status", "done"), ("slow", "x", 1), ("slow", "status", "timed out after 1 s")]
    assert "| slow | status | timed out after 1 s |" in (tmp_path / "gpu_check.md").read_text()


def test_the_default_timeouts_fit_in_four_minutes():
    assert set(gpu_check.TIMEOUTS) == set(gpu_check.PARTS) and sum(gpu_check.TIMEOUTS.values()) < 240


@pytest.mark.parametrize("part", ["roundtrip", "mxfp8"])
def test_the_cpu_runnable_parts_pass_on_the_cpu(part):
    rows = list(gpu_check.PARTS[part](CPU, small=True))
    assert rows and all(r["ok"] for r in rows), rows


def test_the_fanout_part_checks_the_device_wire_and_says_when_it_needs_two_gpus():
    rows = list(gpu_check.PARTS["fanout"](CPU, small=True))
    assert rows[0]["ok"] is True and rows[0]["value"] == "bit-exact"
    assert rows[1]["ok"] is None and "needs 2+" in rows[1]["value"] and len(rows) == 2
