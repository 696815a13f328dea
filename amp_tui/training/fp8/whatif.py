"""Can this model train in fp8? One step's matmul tensors, cast to fp8 and fp4 as the recipes cast
them (casts.py), measured against the precision they ran in, and a verdict per layer.

The unit is `nn.Linear`, the layer torchao's `convert_to_float8_training` converts. For each, on
one step replayed from the state it started in (the replay leaves the weights, their `.grad`, the
RNG and the buffers as they were), the what-if takes the three tensors of its GEMMs as they
reach them (under autocast: cast to the autocast dtype, as a float8 layer takes them):

- `input` and `weight`: output = input @ weight.T, reduced along the input features;
- `grad_output`: grad_input = grad_output @ weight, reduced along the output features; taken
  without the loss scale, which the dynamic casts would scale away.

Each is cast in every format and scaling that tiles it (casts.CASTS) and reported as rows
(docs/session-format.md). `output_sqnr_db` is the GEMM's output computed from the cast operands:
the layer's output for `input` and `weight` rows, the gradient of its input for `grad_output`
rows (the weight there in e4m3 for an e5m2 gradient, as torchao's tensorwise recipe does).

The verdict judges the recipe `convert_to_float8_training` uses by default (tensorwise: input
and weight in e4m3, grad_output in e5m2). A layer is fp8-ready when each tensor holds SQNR >= 20 dB
(torchao's own test threshold) and its channels do too (the median of the
per-channel SQNR: energy-weighted, the tensor's SQNR hides channels a few massive ones drown),
little saturates, and its typical value sits where the format still has its precision (the crest,
below).
"""

from __future__ import annotations

import math
import time

import torch

from amp_tui.training.fp8.capture import LinearCapture, MatmulCapture
from amp_tui.training.trace.op_trace import (
    Backward,
    RngSnapshot,
    autocast_dtype_for,
    backward_roots,
    device_type_of,
    replaying,
)

RECIPE = {"input": ("e4m3", "tensorwise"), "weight": ("e4m3", "tensorwise"),
          "grad_output": ("e5m2", "tensorwise")}
READY_SQNR_DB = 20.0     # torchao's tests hold its fp8 casts and GEMMs to this
MAX_SATURATION = 1e-3    # of the values
MAX_UNDERFLOW = 0.5      # of the nonzero values: more than half of the tensor gone
# Bits from a format's largest value down to its smallest normal one; below it, precision thins
# out to nothing. A tensorwise cast puts the tensor's largest value at the top, so its typical
# (median) value sits `crest` bits lower, and the bulk of a distribution spreads about 6 bits
# under its median (a Gaussian's 1% quantile: log2(0.67 / 0.0125)).
NORMAL_RANGE_BITS = {"e4m3": math.log2(448 / 2 ** -6), "e5m2": math.log2(57344 / 2 ** -14)}
BULK_SPREAD_BITS = 6.0


def crest_limit(fmt: str) -> float:
    return NORMAL_RANGE_BITS[fmt] - BULK_SPREAD_BITS


def judge(rows: list[dict]) -> str:
    """A layer's verdict from its rows: "fp8", or "bf16: <why>" (the first reasons found)."""
    reasons = []
    for tensor, (fmt, scaling) in RECIPE.items():
        row = next((r for r in rows if r["tensor"] == tensor and r["format"] == fmt and r["scaling"] == scaling),
                   None)
        if row is None:
            continue
        where = f"{tensor} in {fmt} {scaling}"
        # The output's SQNR is reported, not judged: a GEMM whose terms cancel loses it in any
        # format, and torchao's threshold is for the tensors cast.
        for key, words in (("sqnr_db", "SQNR"), ("channel_sqnr_db", "median channel SQNR")):
            if row[key] is not None and row[key] < READY_SQNR_DB:
                reasons.append(f"{where}: {words} {row[key]:.1f} dB < {READY_SQNR_DB:g}")
        if row["crest_bits"] is not None and row["crest_bits"] > crest_limit(fmt):
            reasons.append(f"{where}: its typical value sits {row['crest_bits']:.1f} bits under its largest "
                           f"(> {crest_limit(fmt):.1f}), so {row['underflow']:.1%} of it flushes to zero "
                           f"and more loses precision (SQNR {row['sqnr_db']:.1f} dB, weighted by a few "
                           "large values)")
        elif row["underflow"] > MAX_UNDERFLOW:
            reasons.append(f"{where}: {row['underflow']:.0%} of its nonzero values flush to zero")
        if row["saturation"] > MAX_SATURATION:
            reasons.append(f"{where}: {row['saturation']:.2%} of its values saturate")
    return "fp8" if not reasons else "bf16: " + "; ".join(reasons[:2])


def fp8_whatif(model: torch.nn.Module, forward, *, backward: Backward = True, scale: float | None = None,
               dtype: str | torch.dtype | None = "bf16", device: torch.device | str | None = None,
               rng: RngSnapshot | None = None) -> dict:
    """One step's forward (and backward: `backward` as `op_trace.replay` takes it) run once more
    with every nn.Linear's tensors measured in fp8 and fp4. Returns, JSON-safe: "rows" (one per
    module, tensor, format and scaling), "verdict" ({module: "fp8" | "bf16: why"}), "modules"
    ({module: {"shape": [out, in], "calls"}}), "dtype", "scale", "recipe", and "seconds" (what the
    what-if took, the replay and the casts)."""
    started = time.perf_counter()
    device_type = device_type_of(model, device)
    low = autocast_dtype_for(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    capture = LinearCapture(model, device_type, scale)
    matmuls = MatmulCapture(model, device_type, scale)
    try:
        with replaying(model, device_type, rng):
            with torch.autocast(device_type, dtype=low, enabled=low is not None), matmuls:
                output = forward()
            roots, grad_outputs = backward_roots(output, backward, scale)
            if backward is not False and roots and params:
                torch.autograd.grad(roots, params, grad_outputs=grad_outputs, allow_unused=True)
        capture.flush()
    finally:
        capture.close()
        matmuls.close()
    rows, verdict, op_verdict = [], {}, {}
    for name, seen in capture.seen.items():
        rows += [{"module": name, **row} for row in seen.rows]
        if seen.rows:
            verdict[name] = judge(seen.rows)
    for key, seen in matmuls.seen.items():
        module, op = matmuls.where[key]
        rows += [{"module": module, "op": op, **row} for row in seen.rows]
        op_verdict[key] = judge(seen.rows)
    return {"dtype": str(low).replace("torch.", "") if low is not None else "float32", "scale": scale,
            "recipe": {tensor: f"{fmt} {scaling}" for tensor, (fmt, scaling) in RECIPE.items()},
            "rows": rows, "verdict": verdict, "op_verdict": op_verdict,
            "modules": {name: {"shape": capture.shapes[name], "calls": seen.calls}
                        for name, seen in capture.seen.items()},
            "ops": {key: {"module": matmuls.where[key][0], "op": matmuls.where[key][1],
                          "shapes": matmuls.shapes[key]} for key in matmuls.seen},
            "seconds": round(time.perf_counter() - started, 4)}
