"""What the integration packages (``flexckpt_lightning``, ``flexckpt_accelerate``,
``flexckpt_hf``, ``flexckpt_torchtitan``) share: their frameworks are extras (``pip install
'flexckpt[lightning]'``), so one imported without its framework stops in one line naming
the extra; and the ``Checkpointer`` options they pass on are checked when the integration
is made, not at its first save, hours into a run."""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from flexckpt.checkpointer import Checkpointer


def require(package: str, framework: str, extra: str, note: str = "") -> None:
    """Import ``framework`` for ``package``, or raise ``ModuleNotFoundError`` naming the fix."""
    try:
        importlib.import_module(framework)
    except ModuleNotFoundError as e:
        if e.name != framework:  # the framework is there but broken: its own error says how
            raise
        raise ModuleNotFoundError(f"{package} needs {framework}, which is not installed: "
                                  f"pip install 'flexckpt[{extra}]'{note}", name=framework) from None


def check_options(options: dict[str, Any], where: str) -> None:
    """Raise ``TypeError`` naming the first of ``options`` that ``Checkpointer`` does not take."""
    known = [p for p in inspect.signature(Checkpointer).parameters if p != "url"]
    for key in options:
        if key not in known:
            raise TypeError(f"{where}: {key!r} is not a Checkpointer option; it takes {', '.join(known)}")
