"""A failing step kept for the autopilot (`--on-nonfinite isolate`, job/steering/autopilot.py): replayed
with chosen modules in local fp32, to learn whether the step comes out finite before the run is
changed. Like the op trace, a replay leaves the weights, their `.grad`, the optimizer, the scaler
and the RNG as they were, and takes its `LocalFp32` off again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from amp_tui.training.local_fp32 import LocalFp32, named_modules
from amp_tui.training.trace.op_trace import RngSnapshot, device_type_of, replay, verdict

# Modules that hold others but are never called: local fp32 around their forward changes nothing.
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)


@dataclass
class FailedStep:
    """What a non-finite step ran on: its micro-batches, the RNG state each started from, and the
    backward as the step ran it (the loss over the micro-batches, times the scale)."""
    model: torch.nn.Module
    forward_of: Callable[[Any], Any]
    batches: Sequence[Any]
    rngs: Sequence[RngSnapshot | None]
    backward: bool
    scale: float | None
    dtype: str
    device: torch.device

    def replay_with_fp32(self, names: Sequence[str]) -> tuple[bool, str, str | None]:
        """Replay every micro-batch with `names` in fp32: (finite, what the replay said, the module
        of the forward op that still made inf or NaN, if one did). Finite means no op made inf or
        NaN and the loss (and the gradients, with the backward) are."""
        switch = LocalFp32(self.model, device_type_of(self.model, self.device))
        try:
            for name in names:
                switch.add(name)
            message = "nothing to replay"
            for batch, rng in zip(self.batches, self.rngs):
                outcome = verdict(replay(self.model, functools.partial(self.forward_of, batch),
                                         backward=self.backward, scale=self.scale, dtype=self.dtype,
                                         device=self.device, rng=rng))
                message = outcome.message
                if outcome.op is not None or not outcome.step_finite:
                    forward = outcome.op is not None and outcome.op_phase == "forward"
                    return False, message, outcome.op_module if forward and outcome.op_module else None
            return bool(self.batches), message, None
        finally:
            for name in names:
                switch.remove(name)

def widening(model: torch.nn.Module, module: str) -> list[str]:
    """`module`, then each enclosing module up to (not including) the root, leaving out the
    containers that are never called: blocks.3.attn, blocks.3 (blocks is a ModuleList)."""
    modules = named_modules(model)
    chain, parts = [], module.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules and not isinstance(modules[name], CONTAINERS):
            chain.append(name)
        parts.pop()
    return chain
