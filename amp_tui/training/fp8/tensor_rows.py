"""One GEMM's tensors cast to fp8 and fp4 (casts.py) and measured against the precision they ran
in: a row per tensor, format and scaling (docs/session-format.md, `fp8`), with the SQNR of the
GEMM's output computed from the cast operands."""

from __future__ import annotations

import math

import torch

from amp_tui.training.fp8.casts import CASTS, Cast, cast, fits, median_channel_db, sqnr_db


class Reference:
    """A tensor as its casts are measured against it, what does not depend on the cast computed
    once: in float32, as (rows, channels), each channel's energy, its nonzero values, its range
    and crest."""

    def __init__(self, x: torch.Tensor):
        self.x, self.shape = x, x.shape
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


def forward_rows(a: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """The rows of a GEMM's two operands, output = a @ b, both cast along the reduction dimension
    (a's last, b's next to last; leading dimensions batch, as matmul broadcasts them). For an
    nn.Linear, `a` is its input and `b` its weight transposed: rows `input` and `weight`."""
    a_ref, bt_ref = Reference(a), Reference(b.transpose(-1, -2))
    reference = _matmul(a_ref.flat, a.shape, bt_ref.flat, bt_ref.shape)
    rows = []
    for fmt, scaling in CASTS:
        if fits(fmt, scaling, a.shape[-1]):
            qa, qbt = cast(a_ref.flat, fmt, scaling), cast(bt_ref.flat, fmt, scaling)
            output = _rounded(sqnr_db(reference, _matmul(qa.values, a.shape, qbt.values, bt_ref.shape)))
            rows += [a_ref.row("input", qa, fmt, scaling, output), bt_ref.row("weight", qbt, fmt, scaling, output)]
    return rows


def gradient_rows(grad_output: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """The rows of a GEMM's output gradient: grad_a = grad_output @ b^T, both cast along b's last
    dimension (an nn.Linear's output features, `b` its weight transposed; the second operand in
    e4m3 beside an e5m2 gradient, as torchao's recipe has it)."""
    go_ref = Reference(grad_output)
    b_flat = b.detach().to(torch.float32).reshape(-1, b.shape[-1])
    reference = _matmul(go_ref.flat, grad_output.shape, b_flat, b.shape)
    operands: dict[tuple[str, str], torch.Tensor] = {}   # e4m3 serves both fp8 formats' rows
    rows = []
    for fmt, scaling in CASTS:
        if fits(fmt, scaling, grad_output.shape[-1]):
            qgo = cast(go_ref.flat, fmt, scaling)
            key = ("e4m3" if fmt == "e5m2" else fmt, scaling)
            if key not in operands:
                operands[key] = cast(b_flat, *key).values
            output = _rounded(sqnr_db(reference, _matmul(qgo.values, grad_output.shape, operands[key], b.shape)))
            rows.append(go_ref.row("grad_output", qgo, fmt, scaling, output))
    return rows


def _matmul(a: torch.Tensor, a_shape, bt: torch.Tensor, bt_shape) -> torch.Tensor:
    """a @ bt^T, from their flat (rows, reduction) forms, in the shapes `a_shape` and `bt_shape`
    (leading dimensions batch)."""
    if len(bt_shape) == 2:   # one matrix (a Linear's weight): a's rows flat, as they are
        return a @ bt.t()
    return a.reshape(a_shape) @ bt.reshape(bt_shape).transpose(-1, -2)


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
