"""Where precision broke: a diagnostic pass run only on a bad step.

Healthy steps pay nothing here. On a step with a non-finite loss or gradient the engine re-runs the
forward (and, for gradients, the scaled backward) with checks on every module, RNG forked so the
run itself is unchanged:

- forward: the first module, in the order modules *finish* their forward, whose output holds
  inf/NaN while its input was finite: the origin. A module whose input already held inf/NaN only
  passed it on (a projection after an attention's softmax made NaN in the attention's own code),
  so it is never the origin: the module around it, whose input was finite, is. When every module
  that made inf/NaN was given it, it came from outside the model (the data): no origin, and
  `input_nonfinite` says so;
- backward: the first module, in backward order, whose own parameter gradient became non-finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from amp_tui.training.compiled import clean_name, eagerly, original_module
from amp_tui.training.probes.layer_probes import _floating_tensors


@dataclass
class Diagnosis:
    forward_layer: str | None = None       # first module whose output was non-finite from a finite input
    input_nonfinite: bool | None = None    # True: the model's input already was (no origin inside it)
    backward_layer: str | None = None      # first module in backward order with a non-finite gradient
    loss_finite: bool | None = None

    def as_fields(self) -> dict:
        return {"origin": self.forward_layer, "origin_input_nonfinite": self.input_nonfinite,
                "backward_origin": self.backward_layer}


def _all_finite(value: Any) -> bool:
    found: list[torch.Tensor] = []
    _floating_tensors(value, found, limit=16)
    return all(bool(torch.isfinite(t).all()) for t in found)


def diagnose(model: torch.nn.Module, forward: Callable[[], torch.Tensor], *, scale: float | None,
             device: torch.device, backward: bool) -> Diagnosis:
    """Run `forward()` (autocast and loss_fn inside) once more, with checks everywhere.

    Compiled code runs eagerly here, and `model` is seen through torch.compile: hooks attached now
    would never run inside a compiled graph, and the names are those of the original module."""
    result = Diagnosis()
    model = original_module(model)
    names = {id(m): (clean_name(n) or type(m).__name__) for n, m in model.named_modules()}
    handles = []

    def forward_hook(module, inputs, output):
        if result.forward_layer is not None or _all_finite(output):
            return
        if _all_finite(inputs):
            result.forward_layer = names.get(id(module), type(module).__name__)
            result.input_nonfinite = False
        else:   # it only passed on what it was given; the module around it may be the origin
            result.input_nonfinite = True

    for module in model.modules():
        handles.append(module.register_forward_hook(forward_hook))
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), clean_name(name) or type(module).__name__)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), eagerly():
            with torch.enable_grad():
                loss = forward()
                result.loss_finite = bool(torch.isfinite(loss.detach()).all())
                if backward and result.loss_finite and params:
                    for p in params:
                        handles.append(p.register_hook(_grad_check(result, owner.get(id(p), "?"))))
                    scaled = loss * scale if scale is not None else loss
                    torch.autograd.grad(scaled, params, allow_unused=True)
    except Exception:  # noqa: BLE001 - a diagnosis must never break the run
        pass
    finally:
        for h in handles:
            h.remove()
    return result


def _grad_check(result: Diagnosis, name: str):
    def hook(grad):
        if result.backward_layer is None and not bool(torch.isfinite(grad).all()):
            result.backward_layer = name
        return None
    return hook
