"""The integrations' frameworks are extras (``pip install 'flexckpt[lightning]'``): an
integration package imported without its framework stops in one line naming the extra."""
from __future__ import annotations

import importlib


def require(package: str, framework: str, extra: str, note: str = "") -> None:
    """Import ``framework`` for ``package``, or raise ``ModuleNotFoundError`` naming the fix."""
    try:
        importlib.import_module(framework)
    except ModuleNotFoundError as e:
        if e.name != framework:  # the framework is there but broken: its own error says how
            raise
        raise ModuleNotFoundError(f"{package} needs {framework}, which is not installed: "
                                  f"pip install 'flexckpt[{extra}]'{note}", name=framework) from None
