"""What the framework callbacks share: importing the framework (or saying which package to
install), the monitor's options they take, and saying plainly what a framework left out."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from amp_tui.job.monitor import Monitor

# amp_tui.monitor's options that a callback passes on; the model, the optimizer, the scaler and
# the scheduler are the framework's.
DEFAULTS = {"run_dir": None, "probe_every": 1, "underflow_every": 10, "checkpoint_every": None,
            "control": True, "announce": True, "tensorboard_dir": None}


def require(module: str, *, package: str, extra: str, needed_by: str) -> ModuleType:
    """`module`, imported; when it is not installed, an ImportError naming what to pip install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != module.partition(".")[0]:
            raise   # the framework is there and one of its own imports failed: its message says it
        raise ImportError(f"{needed_by} needs {package}, which is not installed: pip install "
                          f"'amp-tui[{extra}]' (or pip install {package})") from None


def options(dtype: str | None, framework: str, setting: str, given: dict) -> dict:
    """The monitor's options for a callback (`given` checked against amp_tui.monitor's)."""
    if dtype is not None:
        raise TypeError(f"dtype= is {framework}'s choice here: set it with {setting}. The dashboard's d "
                        "switches it while the run goes on")
    return {**DEFAULTS, **given}


def warn(monitor: Monitor, reason: str, message: str, *, cause: str, fix: str) -> None:
    """One line on stderr now, and an alert in the recording (the dashboard shows it too)."""
    print(f"amp-tui: {message}", file=sys.stderr, flush=True)
    monitor.event("alert", f"{message}. Likely cause: {cause}. Fix: {fix}", reason=reason, cause=cause, fix=fix)


def loss_tensor(value):
    """The loss a framework's hook hands over: a tensor, or a mapping's "loss" (None: none)."""
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value.get("loss")
    return value


def refuse_engine_keys(monitor: Monitor, engine: str) -> None:
    """An engine such as DeepSpeed scales the loss inside its own optimizer step and fixes the
    dtype: the keys that would change them are refused, and the run says so once."""
    monitor.refuse("scale", f"scale change refused: {engine} owns the loss scale (its engine scales "
                   "inside its own optimizer step, with no torch GradScaler amp-tui can set)")
    monitor.refuse("dtype", f"dtype change refused: {engine} fixes the dtype in its engine")
    warn(monitor, "scale_keys_off", f"{engine} owns this run's loss scale: the scale keys (s, S) "
         "and d are off", cause=f"{engine} scales the loss inside its own optimizer step",
         fix=f"set the loss scale in {engine}'s configuration")
