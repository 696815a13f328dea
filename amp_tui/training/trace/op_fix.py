"""The remedy for a traced op, tried on the very step that broke.

Two remedies, in the order a user would reach for them: the op's module in fp32 (autocast off
around it, its inputs cast to float32: `LocalFp32`, what `--fp32-modules` does), then the whole
step in bf16 (fp32's exponent range, so no loss scale either). Each is replayed with the step's
RNG and traced; it is verified when no op makes inf or NaN any more and the loss and gradients
are finite. Like the trace, a trial leaves the weights, their `.grad`, the optimizer and the
scaler as they were, and takes its `LocalFp32` off again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from amp_tui.core.precision import canonical
from amp_tui.training.local_fp32 import LocalFp32
from amp_tui.training.trace.op_trace import Backward, OpTrace, RngSnapshot, device_type_of, replay, verdict


@dataclass
class FixResult:
    fix: str | None = None            # the flag that fixes the step, e.g. --fp32-modules 'blocks.3.attn'
    fix_verified: bool = False
    tried: list[dict] = field(default_factory=list)   # each remedy: {"fix", "verified", "message"}

    def as_fields(self) -> dict:
        return {"fix": self.fix, "fix_verified": self.fix_verified, "fixes_tried": self.tried}


def _rescaled(backward: Backward, factor: float) -> Backward:
    """Gradients given for the outputs carry the step's scale: the same gradients under another."""
    if isinstance(backward, bool) or factor == 1.0:
        return backward
    if isinstance(backward, torch.Tensor):
        return backward.float() * factor
    return [g.float() * factor for g in backward]


def try_fixes(model: torch.nn.Module, forward: Callable[[], Any], trace: OpTrace, *,
              backward: Backward = True, scale: float | None = None, dtype: str | torch.dtype = "fp16",
              device: torch.device | str | None = None, rng: RngSnapshot | None = None) -> FixResult:
    """Replay the step with each remedy for `trace`'s op in turn; the first that makes the step
    finite is the fix (`fix_verified` true). Without one, `fix` is the first remedy that applies,
    unverified (None when none applies). The arguments are `trace_step`'s."""
    current = canonical(str(dtype).removeprefix("torch."))
    remedies: list[tuple[str, Callable[[], OpTrace]]] = []
    module = trace.op_module
    if module:   # the root ("") or outside the model (None): no module to switch

        def local_fp32() -> OpTrace:
            switch = LocalFp32(model, device_type_of(model, device))
            switch.add(module)
            try:
                return _replayed(model, forward, backward, scale, current, device, rng)
            finally:
                switch.remove(module)

        remedies.append((f"--fp32-modules '{module}'", local_fp32))
    if current == "float16":

        def bf16() -> OpTrace:
            rescaled = _rescaled(backward, 1.0 / scale if scale else 1.0)
            return _replayed(model, forward, rescaled, None, "bfloat16", device, rng)

        remedies.append(("--dtype bf16", bf16))
    result = FixResult()
    for flag, trial in remedies:
        outcome = trial()
        verified = outcome.op is None and outcome.step_finite
        result.tried.append({"fix": flag, "verified": verified, "message": outcome.message})
        if verified:
            result.fix, result.fix_verified = flag, True
            return result
    if remedies:
        result.fix = remedies[0][0]
    return result


def _replayed(model, forward, backward, scale, dtype, device, rng) -> OpTrace:
    return verdict(replay(model, forward, backward=backward, scale=scale, dtype=dtype, device=device, rng=rng))
