"""A step GuardedTrainer found non-finite, replayed under the op tracer with the RNG state its
micro-batches started from: the first aten op that made inf or NaN, and the remedy tried on it;
and a step X-rayed or cast to fp8 on request (`step_ahead`), before it runs, from the state it starts from.

The replay runs only on a failing step (or on request). It leaves the weights, their `.grad`, the
optimizer, the scaler and the RNG as they were (training/trace/op_trace.py), so the run goes on exactly as without it;
whatever the replay itself raises is caught and said in `op_trace_error`, never raised.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from amp_tui.core.precision import canonical
from amp_tui.training.trace.op_fix import try_fixes
from amp_tui.training.trace.op_trace import RngSnapshot, trace_step

# The fields a found op adds to the non-finite event (with the fix's), `op_message` always.
OP_FIELDS = ("op", "op_module", "op_phase", "op_inputs", "op_output_dtype", "op_kind")


def trace_failing_step(model: torch.nn.Module, forward_of: Callable[[Any], Any], batches: Sequence[Any],
                       rngs: Sequence[RngSnapshot | None], *, scale: float | None, dtype: str,
                       device: torch.device, backward: bool = True) -> dict:
    """Replay `batches` one by one (forward, then with `backward` the backward from the loss times
    `scale`) until one shows the op that made inf or NaN; then replay that batch with each remedy,
    the backward included (a remedy is verified on the whole step).

    Returns the event's fields: the op's (`OP_FIELDS`, `op_message`) and the fix's (`fix`,
    `fix_verified`, `fixes_tried`); only `op_message` when no op was found; `op_trace_error`
    when the replay failed."""
    try:
        trace, forward, rng = None, None, None
        for batch, rng in zip(batches, rngs):
            forward = functools.partial(forward_of, batch)
            trace = trace_step(model, forward, backward=backward, scale=scale, dtype=dtype, device=device, rng=rng)
            if trace.op is not None:
                break
        if trace is None:
            return {"op_trace_error": "no micro-batch to replay"}
        if trace.op is None:
            return {"op_message": trace.message}
        fields = {k: v for k, v in trace.as_fields().items() if k in OP_FIELDS}
        fields["op_message"] = trace.message
        if canonical(dtype) != "float32":   # in fp32 there is no lower precision to leave
            fix = try_fixes(model, forward, trace, scale=scale, dtype=dtype, device=device, rng=rng)
            fields.update(fix.as_fields())
        return fields
    except Exception as exc:  # noqa: BLE001 - a diagnosis must never stop the run
        return {"op_trace_error": f"{type(exc).__name__}: {exc}"}


def step_ahead(replay: Callable[..., dict], model: torch.nn.Module, forward: Callable[[], Any], rng: RngSnapshot,
               *, scale: float | None, dtype: str, device: torch.device) -> dict:
    """A step about to run, replayed on request from the RNG state it starts from: `replay` is
    op_xray.xray (the X-ray) or fp8/whatif.fp8_whatif (the fp8 what-if). Its dict, or
    {"error": ...} when the replay failed (never raised: the step still runs)."""
    try:
        return replay(model, forward, scale=scale, dtype=dtype, device=device, rng=rng)
    except Exception as exc:  # noqa: BLE001 - a replay on request must never stop the run
        return {"error": f"{type(exc).__name__}: {exc}"}
