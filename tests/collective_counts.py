"""Counting what a save or load sends between ranks: each collective and point-to-point call, by
kind, through counters installed on torch.distributed."""
import functools
import inspect

import torch.distributed as dist


# calls that only read local state; anything else counted during a save is communication
LOCAL_QUERIES = {
    "get_rank", "get_world_size", "is_initialized", "is_available", "get_backend", "get_global_rank",
    "get_group_rank", "_get_default_group", "_get_group_size", "_rank_not_in_group",
}


# -- counting every torch.distributed call -------------------------------------------------------
_COUNTS: dict[str, int] = {}  # one a process: the wrappers are installed once, by the first call


def install_counters() -> dict:
    """Wrap every function of torch.distributed (and distributed_c10d) to count its calls;
    returns the counts from now on."""
    counts = _COUNTS
    counts.clear()
    for module in (dist, dist.distributed_c10d):
        for name, fn in list(vars(module).items()):
            if not inspect.isfunction(fn) or not fn.__module__.startswith("torch.distributed") or hasattr(fn, "_counted"):
                continue

            @functools.wraps(fn)
            def wrapper(*a, __fn=fn, __name=name, **k):
                counts[__name] = counts.get(__name, 0) + 1
                return __fn(*a, **k)

            wrapper._counted = True
            setattr(module, name, wrapper)
    return counts


def communication(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if k not in LOCAL_QUERIES and v}
