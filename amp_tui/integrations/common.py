"""What the framework callbacks share: importing the framework (or saying which package to
install), the monitor's options they take, and saying plainly what a framework left out."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from types import ModuleType

from amp_tui.job.monitor import Monitor
from amp_tui.job.monitor_options import MonitorOptions


def require(module: str, *, package: str, extra: str, needed_by: str) -> ModuleType:
    """`module`, imported; when it is not installed, an ImportError naming what to pip install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != module.partition(".")[0]:
            raise   # the framework is there and one of its own imports failed: its message says it
        raise ImportError(f"{needed_by} needs {package}, which is not installed: pip install "
                          f"'amp-tui[{extra}]' (or pip install {package})") from None


def options(dtype: str | None, framework: str, setting: str, given: dict) -> MonitorOptions:
    """The monitor's options a callback passes on (`given`: amp_tui.monitor's, but for the model,
    the optimizer, the scaler and the scheduler, which are the framework's; a test keeps the
    callbacks' signatures equal to the monitor's), checked now, not at the first step. `dtype` is
    refused: the framework sets it (`with_dtype`, once training begins)."""
    if dtype is not None:
        raise TypeError(f"dtype= is {framework}'s choice here: set it with {setting}. The dashboard's d "
                        "switches it while the run goes on")
    return MonitorOptions.of(**given)


def with_dtype(options: MonitorOptions, dtype: str | None) -> MonitorOptions:
    """The options, with the dtype the framework has in force."""
    return dataclasses.replace(options, dtype=dtype)


def warn(monitor: Monitor, reason: str, message: str, *, cause: str, fix: str) -> None:
    """One line on stderr now, and an alert in the recording (the dashboard shows it too)."""
    print(f"amp-tui: {message}", file=sys.stderr, flush=True)
    monitor.controller.alert(reason, message, cause=cause, fix=fix)


def loss_tensor(value):
    """The loss a framework's hook hands over: a tensor, or a mapping's "loss" (None: none)."""
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value.get("loss")
    return value


def refuse_engine_keys(monitor: Monitor, engine: str) -> None:
    """An engine such as DeepSpeed scales the loss inside its own optimizer step, fixes the dtype
    and holds the optimizer's state in its own (partitioned) form: the keys that would change or
    save them are refused, and the run says so once."""
    monitor.controller.refuse("scale", f"scale change refused: {engine} owns the loss scale (its engine scales "
                   "inside its own optimizer step, with no torch GradScaler amp-tui can set)")
    monitor.controller.refuse("dtype", f"dtype change refused: {engine} fixes the dtype in its engine")
    monitor.controller.refuse("fp32", f"fp32 for a module refused: {engine} fixes the dtype in its engine")
    for action in ("save", "restore"):
        monitor.controller.refuse(action, f"checkpoint {action} refused: {engine} keeps the optimizer state in its "
                       "own form, which amp-tui's checkpoints can't restore; use the framework's own "
                       "checkpointing")
    warn(monitor, "scale_keys_off", f"{engine} owns this run's loss scale: the scale keys (s, S), "
         "d and the checkpoint keys (c, r) are off", cause=f"{engine} scales the loss inside its own optimizer step",
         fix=f"set the loss scale in {engine}'s configuration")
