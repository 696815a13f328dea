"""Emulated fp8 and fp4 casts, as the training recipes make them, and what each cast loses.

Each cast scales the high-precision tensor into the format's range, rounds it to the format
(torch's own fp8 dtypes do the rounding), and scales it back; what is compared is the tensor the
GEMM would see, in float32.

- `e4m3`/`e5m2`, `tensorwise`: one scale, the format's max over the tensor's amax, computed as
  torchao computes it (amax in float64, clamped at 1e-12, the scale in float32). Bit for bit
  torchao's `hp_tensor_to_float8_dynamic`.
- `e4m3`/`e5m2`, `rowwise`: a scale per row along the GEMM's reduction dimension, rounded down to
  a power of two, as torchao's "rowwise" recipe does.
- `mxfp8`, `block32`: e4m3 values in blocks of 32 along the reduction dimension, each block's
  scale a power of two (e8m0) chosen by the OCP MX rule: 2^(floor(log2 amax) - 8), 8 being e4m3's
  largest exponent. A block's largest values can then exceed 448 and saturate.
- `nvfp4`, `block16`: e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6) in blocks of 16, each block's scale
  in e4m3, under one float32 scale for the tensor that brings the block scales into e4m3's range.

Saturation is counted before the cast clamps: the values more than half a step past the format's
largest, which rounding alone would not bring back to it. Underflow counts the nonzero values the
cast made zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# (format, scaling) in the order the what-if reports them
CASTS = (("e4m3", "tensorwise"), ("e4m3", "rowwise"), ("e5m2", "tensorwise"), ("e5m2", "rowwise"),
         ("mxfp8", "block32"), ("nvfp4", "block16"))
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = {"block32": 32, "block16": 16}
TORCHAO_EPS = 1e-12          # torchao's floor under an amax, so an all-zero tensor gets a finite scale
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max     # 448
E4M3_MAX_EXPONENT = 8        # 448 = 1.75 * 2^8: the OCP MX rule subtracts it from the block's exponent
E2M1_MAX = 6.0
# Half a step past each format's largest value: beyond it a value rounds to no finite one.
SATURATES_PAST = {torch.float8_e4m3fn: 448.0 + 16, torch.float8_e5m2: 57344.0 + 4096, "e2m1": E2M1_MAX + 1}


@dataclass
class Cast:
    """A tensor after a round trip through a format: `values` as the GEMM sees them (float32, the
    tensor's shape), and `saturated`, the values past the format's max before the clamp."""

    values: torch.Tensor
    saturated: int
    original: torch.Tensor   # the tensor cast, in float32

    @property
    def underflowed(self) -> int:
        """The nonzero values the cast made zero."""
        return int(((self.original != 0) & (self.values == 0)).sum())


def fits(fmt: str, scaling: str, reduction_size: int) -> bool:
    """Whether a block format can tile the reduction dimension (the kernels need whole blocks)."""
    return scaling not in BLOCK or reduction_size % BLOCK[scaling] == 0


def cast(x: torch.Tensor, fmt: str, scaling: str, dim: int = -1, *,
         tensor_amax: torch.Tensor | None = None) -> Cast:
    """`x` cast to `fmt` with `scaling` along `dim` (the GEMM's reduction dimension) and back.
    `tensor_amax`: the largest |value| of the tensor `x` is a sample of, which sets a tensorwise
    scale (and NVFP4's tensor scale); by default `x`'s own."""
    hp = x.detach()
    hp = hp if hp.dtype == torch.float32 else hp.to(torch.float32)
    moved = hp.movedim(dim, -1)
    grouped = moved.reshape(1, -1, moved.shape[-1]) if moved.dim() else moved.reshape(1, 1, 1)
    amax = None if tensor_amax is None else tensor_amax.reshape(1)
    values, saturated = cast_groups(grouped, fmt, scaling, amax)
    return Cast(values.reshape(moved.shape).movedim(-1, dim), int(saturated[0]), hp)


def cast_groups(x: torch.Tensor, fmt: str, scaling: str, amax: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Several tensors of one shape cast at once: `x` is (tensors, rows, reduction), float32, and
    each tensor `x[i]` is cast as `cast` casts it alone (its own scales; `amax[i]`, its largest
    |value|, for a sample of a larger tensor). Returns the values and, per tensor, how many
    saturated."""
    tensor_amax = (x.abs().amax((1, 2)) if amax is None else amax).reshape(-1, 1, 1)
    if scaling in BLOCK:
        return _block_cast(x, fmt, BLOCK[scaling], tensor_amax)
    dtype = FP8_DTYPES[fmt]
    if scaling == "tensorwise":
        scale = scale_for(tensor_amax, dtype, power_of_2=False)
    elif scaling == "rowwise":
        scale = scale_for(x.abs().amax(-1, keepdim=True), dtype, power_of_2=True)
    else:
        raise ValueError(f"unknown scaling {scaling!r}")
    return _scaled_cast(x, scale, dtype, finite=bool(torch.isfinite(tensor_amax).all()))


def cast_both_ways(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`cast_groups` tensorwise and rowwise in one go, the two scales side by side: one chain of
    ops for both, the same values. Returns (values, saturated) for each."""
    dtype = FP8_DTYPES[fmt]
    tensor_amax = (x.abs().amax((1, 2)) if amax is None else amax).reshape(-1, 1, 1)
    row_amax = x.abs().amax(-1, keepdim=True)
    scales = torch.stack([scale_for(tensor_amax, dtype, power_of_2=False).expand_as(row_amax),
                          scale_for(row_amax, dtype, power_of_2=True)])
    values, saturated = _scaled_cast(x.unsqueeze(0), scales, dtype, finite=bool(torch.isfinite(tensor_amax).all()),
                                     dims=(2, 3))
    return (values[0], saturated[0]), (values[1], saturated[1])


def scale_for(amax: torch.Tensor, dtype: torch.dtype, *, power_of_2: bool) -> torch.Tensor:
    """torchao's `amax_to_scale`: the format's max over the amax, in float64 then float32."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=TORCHAO_EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def _scaled_cast(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, finite: bool,
                 dims: tuple[int, ...] = (1, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.finfo(dtype).max
    scaled = hp * scale
    # A scale made from the amax puts the largest value at the format's max (or, rounded down to
    # a power of two, under it): only an inf can pass it.
    saturated = (torch.count_nonzero(scaled.abs() > SATURATES_PAST[dtype], dim=dims) if not finite
                 else torch.zeros(scaled.shape[:dims[0]], dtype=torch.int64))
    return widened(scaled.clamp(-top, top).to(dtype)) / scale, saturated


# Each fp8 format's 256 values in float32: looking the bits up is 3x faster on the CPU than
# torch's conversion, and the same values.
_WIDE: dict[torch.dtype, torch.Tensor] = {}


def widened(bits: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor in float32."""
    table = _WIDE.get(bits.dtype)
    if table is None or table.device != bits.device:
        table = _WIDE[bits.dtype] = torch.arange(256, dtype=torch.uint8, device=bits.device).view(
            bits.dtype).to(torch.float32)
    return torch.take(table, bits.view(torch.uint8).long())


def fp8_bits(x: torch.Tensor, fmt: str, scaling: str, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 tensor and its float32 scale (multiply to go into fp8), as torchao's cast makes
    them; for the exactness checks and `torch._scaled_mm`."""
    dtype = FP8_DTYPES[fmt]
    amax = x.detach().abs().max() if scaling == "tensorwise" else x.detach().abs().amax(dim=dim, keepdim=True)
    scale = scale_for(amax, dtype, power_of_2=scaling == "rowwise")
    top = torch.finfo(dtype).max
    return (x.detach().to(torch.float32) * scale).clamp(-top, top).to(dtype), scale


def _blocks(hp: torch.Tensor, size: int) -> torch.Tensor:
    if hp.shape[-1] % size:
        raise ValueError(f"a dimension of {hp.shape[-1]} is not whole blocks of {size}")
    return hp.reshape(*hp.shape[:-1], hp.shape[-1] // size, size)


def _block_cast(hp: torch.Tensor, fmt: str, size: int, tensor_amax: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensors (tensors, rows, reduction) cast in blocks of `size` along the reduction dimension;
    `tensor_amax` (tensors, 1, 1), each tensor's largest |value|."""
    blocks = _blocks(hp, size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt == "mxfp8":
        # e8m0 holds 2^-127..2^127; an all-zero block takes the smallest.
        exponent = torch.floor(torch.log2(amax.clamp(min=2.0 ** -127))) - E4M3_MAX_EXPONENT
        scale = torch.exp2(exponent.clamp(-127, 127))
        scaled = blocks / scale
        saturated = torch.count_nonzero(scaled.abs() > SATURATES_PAST[torch.float8_e4m3fn], dim=(1, 2, 3))
        values = widened(scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)) * scale
    elif fmt == "nvfp4":
        # One float32 scale for each tensor puts its largest block scale at e4m3's max (worked
        # out in float64, as a Python float would be).
        top = tensor_amax.reshape(-1, 1, 1, 1).to(torch.float64) / (E4M3_MAX * E2M1_MAX)
        tensor_scale = torch.where(top > 0, top, 1.0).to(torch.float32)
        block_scale = (amax / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        scale = block_scale * tensor_scale
        # A block whose scale rounded to 0 in e4m3 is flushed whole: none of it saturates.
        scaled = blocks / scale.masked_fill(scale == 0, math.inf)
        saturated = torch.count_nonzero(scaled.abs() > SATURATES_PAST["e2m1"], dim=(1, 2, 3))
        values = round_to_e2m1(scaled) * scale
    else:
        raise ValueError(f"{fmt!r} is not a block format")
    return values.reshape(hp.shape), saturated


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, ties to the even one as IEEE rounding does, saturating at
    6: e2m1's steps are 0.5 below 2, 1 up to 4 and 2 up to 6, and `torch.round` rounds half to
    even on each grid, which is the even mantissa."""
    x = x.clamp(-E2M1_MAX, E2M1_MAX)
    magnitude = x.abs()
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.round(x / step) * step


# ---- what a cast loses ---------------------------------------------------------------------------

def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float | None:
    """Signal-to-quantization-noise ratio in dB, as torchao's `compute_error` (None: no error)."""
    reference, approx = reference.to(torch.float32), approx.to(torch.float32)
    return db(float(torch.linalg.vector_norm(reference)), float(torch.linalg.vector_norm(reference - approx)))


def db(signal: float, noise: float) -> float | None:
    """An SQNR in dB from the norms of a signal and of its error: None when the cast is exact,
    -inf when the error is not finite or there is no signal."""
    if noise == 0:
        return None
    return 20 * math.log10(signal / noise) if signal > 0 and math.isfinite(noise) else -math.inf


def channel_sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float | None:
    """The median, over the channels (the last dimension) that carry a signal, of each channel's
    SQNR: where a few massive channels fill the tensor's energy, the tensor's SQNR reads well while
    the other channels are lost. None: most channels have no error."""
    ref = reference.to(torch.float32).reshape(-1, reference.shape[-1])
    err = ref - approx.to(torch.float32).reshape(-1, reference.shape[-1])
    return median_channel_db(ref.square().sum(0), err.square().sum(0))


def median_channel_db(signal_energy: torch.Tensor, noise_energy: torch.Tensor) -> float | None:
    """`channel_sqnr_db` from each channel's summed squares of signal and of noise. A channel of
    zeros (0/0) is no channel; an exact one (x/0) counts as infinitely good."""
    return median_db(float((signal_energy / noise_energy).nanmedian()))


def median_db(median: float) -> float | None:
    """A median of per-channel signal/noise energy ratios in dB (None: most channels exact)."""
    if math.isnan(median) or math.isinf(median):
        return None
    return 10 * math.log10(median) if median > 0 else -math.inf
