"""Signal handlers installed for a while, then the previous ones put back.

Python lets only the main thread install a handler: elsewhere (a run or a dashboard driven from
a worker thread, as tests and embedding programs do) nothing is installed and nothing restored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterable, Iterator

Handler = Callable[[int, object], object]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def install_handlers(signals: Iterable[signal.Signals], handler: Handler) -> dict:
    """Install `handler` for each of `signals` it can be installed for; the handlers it replaced,
    to hand to `restore_handlers`."""
    previous: dict = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for sig in signals:
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass   # a signal this platform or this interpreter won't let us handle
    return previous


def restore_handlers(previous: dict) -> None:
    """Put back what `install_handlers` replaced (and forget it, so a second call does nothing)."""
    for sig, handler in previous.items():
        try:
            # None: the handler was not installed from Python and can't be put back; the default is
            # the nearest thing.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        except (ValueError, OSError):
            pass   # off the main thread now: nothing can be put back from here
    previous.clear()


@contextlib.contextmanager
def handling_signals(signals: Iterable[signal.Signals], handler: Handler) -> Iterator[dict]:
    """`handler` for `signals` inside the with-block, the previous handlers again after it."""
    previous = install_handlers(signals, handler)
    try:
        yield previous
    finally:
        restore_handlers(previous)
