"""The optional dependencies of the exporters, and the one-line error that names their extra."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(Exception):
    """An exporter's optional dependency is not installed; the message says what to install."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import `module`, or raise MissingExtra naming `pip install 'amp-tui[extra]'`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module
        raise MissingExtra(f"{purpose} needs {missing.split('.')[0]}, which is not installed: "
                           f"pip install 'amp-tui[{extra}]'") from None
