"""The names of a checkpoint's folders and files: a step's folder, a save attempt's id and
every file inside the attempt's own folder (data, chunk table, values, records, markers).
Every file of a save attempt sits in the attempt's folder inside the step folder, so an
attempt never writes into a committed checkpoint's files."""
from __future__ import annotations

import re

from flexckpt.format.jsondoc import show

MANIFEST = "manifest.json"

_STEP_DIR = re.compile(r"^step-(\d{12})$")
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ATTEMPT = re.compile(r"([A-Za-z0-9_-]{1,64})\.[0-9a-f]{8}\.[0-9]{1,9}")


def step_dir(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12:
        raise ValueError(f"step must be an int in [0, 10**12), got {step!r}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id must match {_RUN_ID.pattern}, got {show(run_id)}")
    return run_id


# -- version 2: every file of a save attempt in the attempt's own folder ---------------------
GROUP = 64  # ranks per record group: a group leader gathers its group's records


def attempt_id(run_id: str, session: str, n: int) -> str:
    """``RUN.SESSION.N``: the ``n``-th save of a step by this job launch (``session``, 8 hex
    digits, drawn once per launch). Every rank counts its saves of a step the same way."""
    out = f"{run_id}.{session}.{n}"
    if not _ATTEMPT.fullmatch(out):
        raise ValueError(f"attempt id {out!r} must match {_ATTEMPT.pattern}")
    return out


def attempt_run_id(attempt: str) -> str | None:
    """The run id of an attempt folder's name, or None if the name is not an attempt's."""
    m = _ATTEMPT.fullmatch(attempt)
    return m.group(1) if m else None


def launch_of(attempt: str) -> str:
    """``RUN.SESSION`` of an attempt folder's name: one job launch."""
    return attempt.rsplit(".", 1)[0]


def data_name(attempt: str, rank: int) -> str:
    return f"{attempt}/r{rank:05d}.data"


def table_name(attempt: str, rank: int) -> str:
    return f"{attempt}/r{rank:05d}.table"


def record_name(attempt: str, rank: int) -> str:
    return f"{attempt}/rec/g{rank // GROUP:05d}/r{rank:05d}.json"


def group_name(attempt: str, group: int) -> str:
    return f"{attempt}/grp/g{group:05d}.json"


def values_name(attempt: str, rank: int) -> str:
    return f"{attempt}/r{rank:05d}.values"


def keyed_name(attempt: str) -> str:
    """The bytes values of a save, each once (written by rank 0 before the commit)."""
    return f"{attempt}/keyed.values"


def failed_name(attempt: str) -> str:
    return f"{attempt}/failed"


def committed_name(attempt: str) -> str:
    return f"{attempt}/committed"
