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
from dataclasses import dataclass, field

import torch

from amp_tui.training.fp8.casts import CASTS, Cast, cast, fits, median_channel_db, sqnr_db
from amp_tui.training.local_fp32 import named_modules
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


@dataclass
class _Seen:
    """One Linear's tensors of the step (its first call in it)."""
    module: torch.nn.Module | None = None   # until its output's gradient came
    low: torch.dtype | None = None          # the autocast dtype its forward ran in
    calls: int = 0
    rows: list[dict] = field(default_factory=list)


class LinearCapture:
    """Hooks on every nn.Linear of the model: the first call's input and weight as its GEMM sees
    them, and the gradient that reaches its output, measured as they come (and let go)."""

    def __init__(self, model: torch.nn.Module, device_type: str, scale: float | None):
        self.device_type = device_type
        self.unscale = 1.0 / scale if scale else 1.0
        self.seen: dict[str, _Seen] = {}
        self.shapes: dict[str, list[int]] = {}
        self._handles = []
        for name, module in named_modules(model).items():
            if isinstance(module, torch.nn.Linear):
                self.shapes[name] = list(module.weight.shape)
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            seen = self.seen.setdefault(name, _Seen())
            seen.calls += 1
            if seen.calls > 1 or not args or not isinstance(args[0], torch.Tensor):
                return
            low = torch.get_autocast_dtype(self.device_type) if torch.is_autocast_enabled(self.device_type) else None
            seen.low = low
            with torch.no_grad(), torch.autocast(self.device_type, enabled=False):
                seen.rows += forward_rows(_as_run(args[0], low), _as_run(module.weight, low))
            if isinstance(output, torch.Tensor) and output.requires_grad:
                seen.module = module
                output.register_hook(self._grad_hook(name))
        return hook

    def _grad_hook(self, name: str):
        def hook(grad):
            seen = self.seen[name]
            if seen.module is not None:
                with torch.no_grad(), torch.autocast(self.device_type, enabled=False):
                    seen.rows += gradient_rows(_unscaled(grad, self.unscale), _as_run(seen.module.weight, seen.low))
                seen.module = None
        return hook


def _unscaled(grad: torch.Tensor, unscale: float) -> torch.Tensor:
    return grad.detach() * unscale if unscale != 1 else grad.detach()


def _as_run(tensor: torch.Tensor, low: torch.dtype | None) -> torch.Tensor:
    """A tensor as the layer's GEMM took it: cast to the autocast dtype where one was in force."""
    tensor = tensor.detach()
    return tensor.to(low) if low is not None and tensor.is_floating_point() else tensor


class Reference:
    """A tensor as its casts are measured against it, what does not depend on the cast computed
    once: in float32, as (rows, channels), each channel's energy, its nonzero values, its range
    and crest."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.flat = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
        self.channel_signal = self.flat.square().sum(0)
        self.signal = math.sqrt(float(self.channel_signal.sum()))
        self.nonzero = int(torch.count_nonzero(self.flat))
        self.spread = spread_bits(self.flat)

    def row(self, tensor: str, done: Cast, fmt: str, scaling: str, output_sqnr: float | None) -> dict:
        values = done.values.reshape(self.flat.shape)
        channel_noise = (values - self.flat).square().sum(0)
        noise = math.sqrt(float(channel_noise.sum()))
        # A cast keeps zeros zero: the zeros it adds are the values it flushed.
        underflowed = self.nonzero - int(torch.count_nonzero(values))
        return {"tensor": tensor, "format": fmt, "scaling": scaling,
                "sqnr_db": _rounded(_db(self.signal, noise)),
                "channel_sqnr_db": _rounded(median_channel_db(self.channel_signal, channel_noise)),
                "underflow": underflowed / self.nonzero if self.nonzero else 0.0,
                "saturation": done.saturated / self.flat.numel() if self.flat.numel() else 0.0,
                **self.spread, "output_sqnr_db": output_sqnr}


def _db(signal: float, noise: float) -> float | None:
    if noise == 0:
        return None
    return 20 * math.log10(signal / noise) if signal > 0 and math.isfinite(noise) else -math.inf


def forward_rows(x: torch.Tensor, weight: torch.Tensor) -> list[dict]:
    """The rows of a layer's input and weight: output = input @ weight.T, both cast along the
    input features."""
    x_ref, w_ref = Reference(x), Reference(weight)
    x, weight = x_ref.flat, w_ref.flat
    reference = x @ weight.t()
    rows = []
    for fmt, scaling in CASTS:
        if fits(fmt, scaling, x.shape[-1]):
            qx, qw = cast(x, fmt, scaling), cast(weight, fmt, scaling)
            output = _rounded(sqnr_db(reference, qx.values @ qw.values.t()))
            rows += [x_ref.row("input", qx, fmt, scaling, output), w_ref.row("weight", qw, fmt, scaling, output)]
    return rows


def gradient_rows(grad_output: torch.Tensor, weight: torch.Tensor) -> list[dict]:
    """The rows of a layer's output gradient: grad_input = grad_output @ weight, both cast along
    the output features (the weight in e4m3 beside an e5m2 gradient, as torchao's recipe has it)."""
    go_ref = Reference(grad_output)
    go, weight = go_ref.flat, weight.detach().to(torch.float32)
    reference = go @ weight
    weights: dict[tuple[str, str], torch.Tensor] = {}   # e4m3 serves both fp8 formats' rows
    rows = []
    for fmt, scaling in CASTS:
        if fits(fmt, scaling, go.shape[-1]):
            qgo = cast(go, fmt, scaling)
            key = ("e4m3" if fmt == "e5m2" else fmt, scaling)
            if key not in weights:
                weights[key] = cast(weight, *key, dim=0).values
            output = _rounded(sqnr_db(reference, qgo.values @ weights[key]))
            rows.append(go_ref.row("grad_output", qgo, fmt, scaling, output))
    return rows


CREST_SAMPLE = 4096   # the values whose median stands for a tensor's typical one


def spread_bits(x: torch.Tensor) -> dict:
    """How a tensor's magnitudes spread, over its finite nonzero values: `range_bits`,
    log2(max |x| / min |x|), and `crest_bits`, log2(max |x| / median |x|): how far below its largest
    value its typical one sits. The median is of an evenly strided sample of at most CREST_SAMPLE
    values (a full median costs 40x more on the CPU)."""
    magnitude = x.detach().abs().to(torch.float32).flatten()
    live = torch.isfinite(magnitude) & (magnitude > 0)
    top = float(torch.where(live, magnitude, 0.0).max()) if magnitude.numel() else 0.0
    if top == 0:
        return {"range_bits": None, "crest_bits": None}
    bottom = float(torch.where(live, magnitude, math.inf).min())
    sample = magnitude[::max(1, magnitude.numel() // CREST_SAMPLE)]
    sample = sample[torch.isfinite(sample) & (sample > 0)]
    crest = math.log2(top / float(sample.median())) if sample.numel() else None
    return {"range_bits": _rounded(math.log2(top / bottom)), "crest_bits": _rounded(crest)}


def _rounded(value: float | None) -> float | None:
    if value is None:
        return None
    return round(value, 2) if math.isfinite(value) else (-999.0 if value < 0 else 999.0)


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
    try:
        with replaying(model, device_type, rng):
            with torch.autocast(device_type, dtype=low, enabled=low is not None):
                output = forward()
            roots, grad_outputs = backward_roots(output, backward, scale)
            if backward is not False and roots and params:
                torch.autograd.grad(roots, params, grad_outputs=grad_outputs, allow_unused=True)
    finally:
        capture.close()
    rows, verdict = [], {}
    for name, seen in capture.seen.items():
        rows += [{"module": name, **row} for row in seen.rows]
        if seen.rows:
            verdict[name] = judge(seen.rows)
    return {"dtype": str(low).replace("torch.", "") if low is not None else "float32", "scale": scale,
            "recipe": {tensor: f"{fmt} {scaling}" for tensor, (fmt, scaling) in RECIPE.items()},
            "rows": rows, "verdict": verdict,
            "modules": {name: {"shape": capture.shapes[name], "calls": seen.calls}
                        for name, seen in capture.seen.items()},
            "seconds": round(time.perf_counter() - started, 4)}
