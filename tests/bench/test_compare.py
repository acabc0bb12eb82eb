"""The bench pieces issues 28 and 29 added, without running a benchmark: restore's limit
(the spans of the bytes a rank's load reads, the checksum pass, the fit across state
sizes), and compare_revisions' run order, headline figures and table."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare_revisions as C  # noqa: E402
import restore  # noqa: E402


def test_the_limit_reads_a_ranks_bytes_from_its_share_on_wrapping_round_to_the_start():
    assert restore.limit_spans(0, 100, 100) == [(0, 100)]  # 2 -> 1: everything
    assert restore.limit_spans(50, 50, 100) == [(50, 100)]  # 2 -> 2, rank 1
    assert restore.limit_spans(75, 30, 100) == [(75, 100), (0, 5)]  # more than its share, past the end
    with pytest.raises(ValueError, match="101 bytes from byte 0 of 100"):
        restore.limit_spans(0, 101, 100)


def test_the_checksum_pass_hashes_every_chunk_with_the_librarys_checksum(monkeypatch):
    import flexckpt.format.checksum

    seen = []
    monkeypatch.setattr(flexckpt.format.checksum, "checksum_int", lambda v: seen.append(bytes(v)) or 0)
    restore.checksum_pass(memoryview(bytes(range(10))), 4)
    assert seen == [bytes(range(4)), bytes(range(4, 8)), bytes([8, 9])]


def test_the_fit_across_sizes_splits_a_fixed_cost_a_load_from_a_ratio_a_byte():
    # (state MiB, limit s, restore s) at two sizes: restore = 0.5 + 1.0 x limit
    fit = restore.fit_against_limit([(100.0, 0.25, 0.75), (400.0, 1.0, 1.5)])
    assert fit == (0.5, 1.0, 400.0, 800.0)  # 500 MiB over 1.25 s; 0.5 / (1.25 - 1.0) = 2 s of limit = 800 MiB
    # least squares through four sizes: r = 3.5 / 5, F = 3 - r x 2.5
    fit = restore.fit_against_limit([(10.0, 1.0, 2.0), (20.0, 2.0, 2.5), (30.0, 3.0, 3.5), (40.0, 4.0, 4.0)])
    assert fit.fixed_s == pytest.approx(1.25, abs=1e-12) and fit.ratio == pytest.approx(0.7, abs=1e-12)
    assert fit.limit_mib_s == 10.0 and fit.goal_state_mib == pytest.approx(1.25 / 0.55 * 10.0, abs=1e-9)


def test_the_fit_says_never_at_a_ratio_a_byte_over_the_goal_and_every_size_without_a_fixed_cost():
    assert restore.fit_against_limit([(1.0, 1.0, 1.5), (2.0, 2.0, 3.0)]).goal_state_mib is None  # r = 1.5
    assert restore.fit_against_limit([(1.0, 1.0, 1.25), (2.0, 2.0, 2.5)]).goal_state_mib is None  # r = 1.25: never below
    assert restore.fit_against_limit([(1.0, 1.0, 0.5), (2.0, 2.0, 1.5)]).goal_state_mib == 0.0  # F = -0.5, r = 1
    with pytest.raises(ValueError, match=r"2 state sizes with limits \[1.0, 1.0\]: a fit needs two sizes or more"):
        restore.fit_against_limit([(1.0, 1.0, 2.0), (2.0, 1.0, 3.0)])


def test_the_revisions_take_turns_their_order_flipping_each_round():
    assert C.order(3, ("before", "after")) == [(0, "before"), (0, "after"), (1, "after"), (1, "before"),
                                               (2, "before"), (2, "after")]


def test_the_headlines_are_the_save_stall_percentiles_restore_and_recovery_times():
    save = {"results": {"2": {"runs": {"flexckpt-tier": [{"p50": 0.01, "p99": 0.03}, {"p50": 0.02, "p99": 0.05},
                                                           {"p50": 0.04, "p99": 0.04}]}}}}
    assert C.headline("save_latency_tier", save) == {"flexckpt-tier save stall p50 s": 0.02,
                                                     "flexckpt-tier save stall p99 s": 0.04}
    rest = {"headline": {"restore 2->1 cold s": 0.5, "restore/limit 2->1 cold": 1.1}}
    assert C.headline("restore", rest) == {"restore 2->1 cold s": 0.5}
    fast = {"headline": {"fast recovery s": 0.2, "persistent recovery s": 2.0, "fast/limit": 1.0}}
    assert C.headline("fast_tier", fast) == {"fast recovery s": 0.2, "persistent recovery s": 2.0}


def test_the_table_flags_an_after_slower_than_before_by_more_than_five_percent():
    before = {"restore": {"warm": [1.0, 1.2, 1.1], "cold": [2.0, 2.0, 2.0]}}
    after = {"restore": {"warm": [1.2, 1.15, 1.3], "cold": [2.1, 2.0, 2.0]}}
    assert C.comparison_rows(before, after) == [
        ["restore", "warm", "1100.0 ms", "1200.0 ms", "1.091", "**no**"],
        ["restore", "cold", "2000.0 ms", "2000.0 ms", "1.000", "yes"]]
