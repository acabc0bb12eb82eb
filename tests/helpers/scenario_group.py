"""Several multi-process scenarios in one launch: each spawned rank imports torch and joins
the group once (about 3 s of CPU a process), then runs the scenarios in order. A scenario
that raises on a rank fails the launch at once with its name, the rank and its traceback
(the other ranks are killed: they could be waiting in a collective the failed rank left)."""
from __future__ import annotations

from typing import Any, Callable

from flexshard.spawn import run_workers

Scenario = tuple[str, Callable[..., Any], tuple]  # name, fn(rank, world, *args), args


class ScenarioError(RuntimeError):
    """A scenario raised on a rank; the cause is the rank's own exception."""


def _run_scenarios(rank: int, world: int, scenarios: list[Scenario]) -> dict[str, Any]:
    out = {}
    for name, fn, args in scenarios:
        try:
            out[name] = fn(rank, world, *args)
        except BaseException as exc:  # noqa: BLE001 - named, then re-raised with the cause
            raise ScenarioError(f"scenario {name!r} failed on rank {rank} of {world}: {exc!r}") from exc
    return out


def run_scenarios(world: int, scenarios: list[Scenario], timeout: float) -> dict[str, list[Any]]:
    """``{name: [result of rank 0, rank 1, ...]}`` of every scenario, run in one launch of
    ``world`` ranks in the order given."""
    names = [name for name, _fn, _args in scenarios]
    if len(set(names)) != len(names):
        raise ValueError(f"scenario names must differ, got {names}")
    ranks = run_workers(_run_scenarios, world, scenarios, timeout=timeout)
    return {name: [r[name] for r in ranks] for name in names}
