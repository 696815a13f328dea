"""What the monitor is handed, checked and unwrapped: the user's model, optimizer, GradScaler and
scheduler (a message that says what to change where one is not what it should be), the torch
optimizer inside a framework's wrapper, and what GradScaler and a step's arguments tell the hooks."""

from __future__ import annotations

import torch

from amp_tui.training.local_fp32 import named_modules


class MonitorError(RuntimeError):
    """The monitor was used in a way it can't follow; the message says what to change."""


def check_objects(model, optimizer, scaler, scheduler) -> None:
    if not isinstance(model, torch.nn.Module):
        raise MonitorError(f"amp_tui.monitor(model, ...): model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MonitorError(f"amp_tui.monitor(model, optimizer, ...): optimizer is a {type(optimizer).__name__}, "
                           "not a torch.optim.Optimizer")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise MonitorError(f"scaler= is a {type(scaler).__name__}, not a torch.amp.GradScaler")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise MonitorError(f"scheduler= is a {type(scheduler).__name__} with no step() method")


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper that steps it (Accelerate's AcceleratedOptimizer keeps
    it as `.optimizer`): the one whose step hooks fire and which GradScaler is handed."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise MonitorError("amp_tui.monitor(model, ...): the model has no parameters to watch")


def example_names(model: torch.nn.Module) -> list[str]:
    names = [name for name in named_modules(model) if name]
    return [repr(name) for name in names[:3]] + (["..."] if len(names) > 3 else [])


def closure_given(args: tuple, kwargs: dict) -> bool:
    """Whether `optimizer.step(...)` was handed a closure. A step pre-hook's `args` start with the
    optimizer itself (`step` is a method): the closure, when positional, comes second."""
    return (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None


def found_inf(per_device: dict, device: torch.device) -> torch.Tensor | None:
    """GradScaler's found-inf for one optimizer, on `device` and summed over the devices it
    came from (one, mostly)."""
    values = [v.to(device) for v in per_device.values()]
    if not values:
        return None
    return values[0] if len(values) == 1 else sum(values)
