"""No update with non-finite gradients is applied: the loss scale's floor, and the check of the
unscaled gradients where GradScaler's own check can't be trusted.

GradScaler checks the gradients for inf/NaN *before* it unscales them. That is right while the
scale is at least 1, but not below:
- at scale 0 (about 166 halvings from 65536 in fp32) the scaled loss is 0, every gradient 0, the
  check finds nothing, and the unscale makes 0 × inf = NaN, which `scaler.step` applies;
- at a tiny scale, 1/scale is huge and a finite scaled gradient can unscale to inf.
So the scale is never let below a floor (`SCALE_FLOOR` unless the run sets its own), and while it
is below 1 the unscaled gradients are checked once more; an inf/NaN found there is put into
GradScaler's own found-inf, so that it skips the update and backs off as for any overflow.

Without a GradScaler nothing skips for the loop: amp-tui checks the gradients before the
optimizer steps and, where they hold inf/NaN, takes them away (`drop_gradients`), which every
torch optimizer reads as "no update for this parameter".
"""

from __future__ import annotations

import math

import torch

# SCALE_FLOOR is fp16's smallest subnormal: below it a gradient of 1 scaled by the loss scale is
# 0 in fp16, so no scale under it can train anything, and 1/scale is still far from fp32's max.
# It lives in core: the read side shows the floor in force too.
from amp_tui.core.precision import SCALE_FLOOR


def scale_floor(min_scale: float | None) -> float:
    """The floor in force: the run's own (`--min-scale`, `min_scale=`), else `SCALE_FLOOR`."""
    return SCALE_FLOOR if min_scale is None else float(min_scale)


def unscale_untrusted(scale: float | None) -> bool:
    """GradScaler's check before unscaling misses what the unscale itself makes at this scale."""
    return scale is not None and not (math.isfinite(scale) and scale >= 1.0)


def nonfinite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 on the device when any gradient holds inf/NaN, without leaving the device.

    GradScaler's own fused check, one call per dtype and device, with an inverse scale of 1
    (which leaves every gradient as it is): on the CPU a third of an aminmax per gradient and a
    stack, on CUDA one kernel launch."""
    found = torch.zeros((), device=device)   # 0-d, as GradScaler's (a DTensor op replicates it as it is)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.is_sparse:
            g = g.coalesce()._values()   # as GradScaler.unscale_ reads a sparse gradient
        groups.setdefault((g.device, g.dtype), []).append(g)
    with torch.no_grad():
        for (where, _), tensors in groups.items():
            flag = found if where == found.device else torch.zeros((), device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, torch.ones((), device=where))
            if flag is not found:
                found = torch.maximum(found, flag.to(found.device))
    return found


def gradients_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def mark_unscaled_nonfinite(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                            device: torch.device) -> torch.Tensor:
    """After `scaler.unscale_(optimizer)`: the unscaled gradients checked, and an inf/NaN among
    them added to GradScaler's found-inf for `optimizer`, so that its `step` skips the update (a
    fused optimizer reads the same flag) and its `update` backs off. Returns the flag (device)."""
    flag = nonfinite_flag(gradients_of(optimizer), device)
    per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    for where, found in per_device.items():
        per_device[where] = torch.maximum(found, flag.to(found.device, found.dtype))
    if not per_device:
        per_device[device] = flag.to(torch.float32)
    return flag


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """No update this step: a parameter without a gradient is one every torch optimizer leaves
    as it is (its state too)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
