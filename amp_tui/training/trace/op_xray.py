"""X-ray of a healthy step: the autocast policy made visible, op by op.

The same tracer as `trace_step`, on a step that works: for each module, the ops that ran, the
dtype each ran in (what autocast chose: matmuls in the low dtype, the ops on its float32 list in
float32, the rest in their inputs' dtype), the largest input and output magnitudes, and how many
bits of headroom each op's output has left before its dtype's largest finite value
(log2(max_dtype / max|out|)). The ops with the least headroom come first in `closest`: the ones
that overflow first when the activations, or the loss scale in the backward, grow.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from amp_tui.training.trace.op_trace import Backward, RngSnapshot, json_number, replay


def headroom_bits(max_out: float, dtype: str) -> float | None:
    """Bits between max |out| and the dtype's largest finite value (None: no headroom to speak
    of, the output being all zeros, or not finite, or not of a float dtype)."""
    if not (math.isfinite(max_out) and max_out > 0):
        return None
    return math.log2(torch.finfo(getattr(torch, dtype)).max / max_out)


def _max(values: list[float], start: float) -> float:
    out = start
    for v in values:
        if math.isnan(v) or math.isnan(out):
            return math.nan
        out = max(out, v)
    return out


def xray(model: torch.nn.Module, forward: Callable[[], Any], *, backward: Backward = True,
         scale: float | None = None, dtype: str | torch.dtype | None = "fp16",
         device: torch.device | str | None = None, rng: RngSnapshot | None = None,
         closest: int = 10) -> dict:
    """Trace one step (arguments as `trace_step`'s) and return, JSON-safe:

    - "modules": [{"module", "ops": [{"op", "phase", "dtype", "count", "max_in", "max_out",
      "headroom_bits"}]}] in the order the modules first ran ("" = the root's own forward,
      None = outside the model: the loss function);
    - "closest": the `closest` ops with the least headroom, least first, each with its module;
    - "dtype", "scale", "ops_traced", "step_finite"."""
    result = replay(model, forward, backward=backward, scale=scale, dtype=dtype, device=device, rng=rng,
                    stop_at_origin=False)
    rows: dict[tuple, dict] = {}
    for record in result.records:
        key = (record.module, record.op, record.phase, record.out_dtypes[0])
        row = rows.get(key)
        if row is None:
            row = rows[key] = {"module": record.module, "op": record.op, "phase": record.phase,
                               "dtype": record.out_dtypes[0], "count": 0, "max_in": 0.0, "max_out": 0.0}
        row["count"] += 1
        row["max_in"] = _max(record.in_max, row["max_in"])
        row["max_out"] = _max(record.out_max, row["max_out"])
    modules: dict[Any, list[dict]] = {}
    for row in rows.values():
        row["headroom_bits"] = headroom_bits(row["max_out"], row["dtype"])
        modules.setdefault(row["module"], []).append(row)
    # An fp8 cast's output fills its format by design (its scale is the format's max over the amax):
    # listed with its module, never ranked as close to overflowing.
    ranked = sorted((r for r in rows.values()
                     if r["headroom_bits"] is not None and not r["dtype"].startswith("float8")),
                    key=lambda r: r["headroom_bits"])
    return {
        "dtype": result.dtype or "float32",
        "scale": scale,
        "ops_traced": len(result.records),
        "step_finite": result.step_finite,
        "modules": [{"module": name, "ops": [_json_row(r, with_module=False) for r in ops]}
                    for name, ops in modules.items()],
        "closest": [_json_row(r, with_module=True) for r in ranked[:closest]],
    }


def _json_row(row: dict, *, with_module: bool) -> dict:
    out = {k: v for k, v in row.items() if with_module or k != "module"}
    out["max_in"] = json_number(row["max_in"])
    out["max_out"] = json_number(row["max_out"])
    if row["headroom_bits"] is not None:
        out["headroom_bits"] = round(row["headroom_bits"], 2)
    return out
