"""bench/fast_tier_sim.py's pure formulas (issue 29, part 3): the lost work counts the save
duration, store reads share the aggregate bandwidth (read once divides them by the replicas),
and the exact renewal formula agrees with the seeded Monte Carlo, also where the first-order
closed form breaks down. Seconds, no processes."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fast_tier_sim as sim  # noqa: E402

GIB = 1 << 30


def sim_args(*argv):
    return sim.parser().parse_args(list(argv))


def test_lost_work_counts_the_save_duration():
    assert sim.lost_work(100.0, 20.0) == 70.0
    # the exact expectation tends to it when failures are rare: M - E[kept] -> tau/2 + d
    m = 1e7
    assert m - sim.expected_kept(100.0, 20.0, m) == pytest.approx(70.0, abs=0.01)
    # a save that never finishes before the failure keeps nothing more: longer d, less kept
    assert sim.expected_kept(100.0, 50.0, 1000.0) < sim.expected_kept(100.0, 0.0, 1000.0)


def test_store_reads_share_the_aggregate_bandwidth():
    fixed = sim.aggregate_bandwidth(0.12, 100000, "fixed")
    grows = sim.aggregate_bandwidth(0.12, 100000, "grows")
    assert fixed == 0.12e9 * 16384 and grows == 0.12e9 * 100000
    assert sim.store_seconds(4 * GIB, 100000, fixed) == pytest.approx(100000 * 4 * GIB / (0.12e9 * 16384))
    assert sim.store_seconds(4 * GIB, 100000, grows) == pytest.approx(4 * GIB / 0.12e9)
    with pytest.raises(ValueError, match="store 'huge'.*'fixed'.*'grows'"):
        sim.aggregate_bandwidth(0.12, 100, "huge")


def test_read_once_divides_the_store_reads_by_the_replicas():
    args = sim_args("--replicas", "8")
    t = sim.tiers(4.0, 100000, "fixed", args)
    per_rank = 100000 * 4 * GIB / (0.12e9 * 16384)
    assert t["per_rank"].recovery == pytest.approx(per_rank)
    assert t["read_once"].recovery == pytest.approx(per_rank / 8)
    assert t["per_rank"].duration == pytest.approx(per_rank / 8)  # a save writes each stored byte once
    one = sim.tiers(4.0, 100000, "fixed", sim_args("--replicas", "1"))
    assert one["read_once"] == one["per_rank"]


@pytest.mark.parametrize("fail_in_restart", [True, False])
@pytest.mark.parametrize("d_p, d_f, tau_p, tau_f", [(60.0, 10.0, 400.0, 100.0), (5.0, 80.0, 300.0, 100.0)])
def test_monte_carlo_agrees_with_the_exact_expectation(fail_in_restart, d_p, d_f, tau_p, tau_f):
    # second case: the fast save runs longer than the persistent one, so a failure often finds
    # a newer persistent step (restored from the store)
    job = sim.Job(mtbf=2000.0, restart=300.0, persistent=sim.Tier(0.5, d_p, 200.0),
                  fast=sim.Tier(0.2, d_f, 20.0), q=0.9, fail_in_restart=fail_in_restart)
    exact = sim.renewal(job, tau_p, tau_f)
    mc, err = sim.monte_carlo(job, tau_p, tau_f, cycles=20000, seed=0)
    assert err < 0.004  # the check has teeth: 4 standard errors are under 1.6 points
    assert abs(mc - exact) < 4 * err


def test_a_newer_persistent_step_is_restored():
    # the persistent save of a step finishes 75 s before the fast one: a failure in that
    # window keeps tau_f more work than the fast tier alone (m = 1), once per persistent period
    extra, prob = sim.newer_persistent(300.0, 5.0, 100.0, 80.0, 2000.0)
    window = math.exp(-5.0 / 2000) - math.exp(-80.0 / 2000)
    assert prob == pytest.approx(window / math.expm1(300.0 / 2000))
    assert extra == pytest.approx(100.0 * prob)
    assert sim.newer_persistent(300.0, 60.0, 100.0, 10.0, 2000.0) == (0.0, 0.0)  # fast finishes first
    with pytest.raises(ValueError, match="250 s is not a whole number of fast intervals"):
        sim.renewal(sim.Job(2000.0, 1.0, sim.Tier(0, 1, 1), fast=sim.Tier(0, 1, 1)), 250.0, 100.0)


def test_closed_form_breaks_where_the_issue_says_and_the_exact_one_holds():
    # issue 29: 100K GPUs, 40 GiB, restart 600 s, a store that does not grow, no replicas
    args = sim_args("--replicas", "1")
    t = sim.tiers(40.0, 100000, "fixed", args)
    job = sim.Job(sim.MTBF_16K * 16384 / 100000, 600.0, t["per_rank"], fast=t["fast"], fail_in_restart=False)
    eff, tp, tf = sim.best(job)
    mc, err = sim.monte_carlo(job, tp, tf, cycles=20000, seed=0)
    assert abs(mc - eff) < 4 * err
    assert sim.closed_form(job, tp, tf) < eff - 0.2  # first order in 1/M: off by over 20 points here
    r = sim.evaluate(job, cycles=2000)
    assert r["closed"] is None  # so the table prints "breaks"
    # where failures are rare the closed form agrees and is kept
    calm = sim.Job(1e7, 180.0, sim.Tier(0.01, 5.0, 10.0))
    assert sim.evaluate(calm, cycles=200)["closed"] == pytest.approx(sim.best(calm)[0], abs=sim.CLOSED_FORM_AGREES)


def test_bad_options_are_named(capsys):
    with pytest.raises(SystemExit):
        sim.main(["--q", "1.5"])
    assert "--q 1.5: a fraction of failures, from 0 to 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.main(["--replicas", "0"])
    assert "--replicas 0: must be at least 1" in capsys.readouterr().err
