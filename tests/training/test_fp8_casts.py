"""The fp8 and fp4 casts the what-if emulates (training/fp8/casts.py): the same bits as torchao's
own casts, a GEMM's output SQNR as torch._scaled_mm computes it, and exact saturation and
underflow counts on tensors with planted values."""

from __future__ import annotations

import math

import pytest
import torch

from amp_tui.training.fp8.casts import (
    CASTS,
    cast,
    cast_both_ways,
    cast_groups,
    channel_sqnr_db,
    fp8_bits,
    round_to_e2m1,
    sqnr_db,
)
from amp_tui.training.fp8.tensor_rows import forward_groups, forward_rows, gradient_groups, gradient_rows, spread_bits

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def tensors():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * 3
    outliers = torch.randn(32, 64)
    outliers[:, [5, 40]] *= 5000
    return [x, x.to(torch.bfloat16), outliers, torch.zeros(16, 32), torch.randn(4, 8, 32)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_casts_are_torchaos_bit_for_bit(fmt, scaling):
    scaling_utils = pytest.importorskip("torchao.float8.float8_scaling_utils")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import LinearMMConfig

    for x in tensors():
        extra = {} if scaling == "tensorwise" else {
            "scaling_granularity": ScalingGranularity.AXISWISE, "axiswise_dim": -1,
            "round_scales_to_power_of_2": True}
        theirs = scaling_utils.hp_tensor_to_float8_dynamic(x, FP8[fmt], LinearMMConfig(), **extra)
        bits, scale = fp8_bits(x, fmt, scaling)
        assert torch.equal(bits.view(torch.uint8), theirs._data.view(torch.uint8))
        assert torch.equal(scale, theirs._scale)
        # What the GEMM sees: the bits back in float32, over the scale.
        assert torch.equal(cast(x, fmt, scaling).values, bits.to(torch.float32) / scale)


def test_mxfp8_is_torchaos_floor_rule():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    for x in tensors():
        x = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
        scale_e8m0, data = mx.to_mx(x, torch.float8_e4m3fn, 32)
        scale = torch.exp2(scale_e8m0.view(torch.uint8).to(torch.float32) - 127).reshape(x.shape[0], -1, 1)
        theirs = (data.to(torch.float32).reshape(x.shape[0], -1, 32) * scale).reshape(x.shape)
        assert torch.equal(cast(x, "mxfp8", "block32").values, theirs)


def test_a_tensorwise_gemms_output_sqnr_is_scaled_mms():
    torch.manual_seed(1)
    x, w = torch.randn(64, 128), torch.randn(32, 128) * 0.05
    x[:, 7] *= 300
    reference = x @ w.t()
    for fmt in ("e4m3", "e5m2"):
        qx, sx = fp8_bits(x, fmt, "tensorwise")
        qw, sw = fp8_bits(w, "e4m3", "tensorwise")
        native = torch._scaled_mm(qx, qw.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(),
                                  out_dtype=torch.float32)
        emulated = cast(x, fmt, "tensorwise").values @ cast(w, "e4m3", "tensorwise").values.t()
        assert abs(sqnr_db(reference, emulated) - sqnr_db(reference, native)) < 0.1


def test_saturation_and_underflow_are_counted_exactly_on_planted_values():
    # Tensorwise, amax 448: the scale is 1. e4m3's smallest subnormal is 2^-9; at most half of it
    # (a tie, to the even zero) rounds to 0.
    x = torch.full((100,), 3.0)
    x[0] = 448.0
    x[1:8] = 2.0 ** -11     # 7 flush to zero
    x[8:11] = 2.0 ** -10    # a tie: 3 more
    x[11:14] = 2.0 ** -9    # kept
    x[14:20] = 0.0          # zeros are not underflow
    done = cast(x, "e4m3", "tensorwise")
    assert (done.underflowed, done.saturated) == (10, 0)
    # MX, floor rule: a block whose amax is 500 gets the scale 2^(8 - 8) = 1; 470 and 500 are more
    # than half a step (16) past 448 and saturate, 460 rounds to 448.
    block = torch.ones(2, 32)
    block[0, :4] = torch.tensor([500.0, 470.0, 460.0, 448.0])
    block[1, 0] = 1e-30     # far under the block's smallest value: flushed
    done = cast(block, "mxfp8", "block32")
    assert (done.saturated, done.underflowed) == (2, 1)
    assert done.values[0, :4].tolist() == [448.0, 448.0, 448.0, 448.0]
    # NVFP4: e2m1's ties round to the even value, 6 is the largest.
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -0.75, 7.5])
    assert round_to_e2m1(values).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 6.0]


def test_every_cast_keeps_the_shape_and_a_well_scaled_tensors_signal():
    torch.manual_seed(2)
    x = torch.randn(8, 4, 64)
    for fmt, scaling in CASTS:
        done = cast(x, fmt, scaling)
        assert done.values.shape == x.shape
        floor = 15 if fmt == "nvfp4" else 20
        assert sqnr_db(x, done.values) > floor, (fmt, scaling)
    assert sqnr_db(x, x) is None and channel_sqnr_db(x, x) is None
    spread = spread_bits(torch.tensor([0.0, 0.5, 8.0, 2.0, -1.0]))
    # |x|: 0.5, 1, 2, 8 (the zero is no value): median 2 (of 1 and 2, torch takes the lower: 1).
    assert spread["range_bits"] == 4.0 and spread["crest_bits"] == 3.0


def stacked_tensors():
    """Three tensors of one shape, unlike each other: wide-ranged channels, one with an inf, zeros."""
    torch.manual_seed(3)
    x = torch.randn(48, 64) * torch.logspace(-3, 3, 64)
    with_inf = torch.randn(48, 64)
    with_inf[5, 7] = math.inf
    return [x, with_inf, torch.zeros(48, 64)]


@pytest.mark.parametrize("fmt, scaling", CASTS)
def test_tensors_cast_together_are_each_cast_alone(fmt, scaling):
    tensors = stacked_tensors()
    values, saturated = cast_groups(torch.stack(tensors), fmt, scaling)
    for i, tensor in enumerate(tensors):
        alone = cast(tensor, fmt, scaling)
        assert torch.equal(values[i].nan_to_num(), alone.values.nan_to_num()), i
        assert int(saturated[i]) == alone.saturated, i


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_both_scalings_at_once_are_the_two_casts(fmt):
    tensors = stacked_tensors()
    both = cast_both_ways(torch.stack(tensors), fmt)
    for (values, saturated), scaling in zip(both, ("tensorwise", "rowwise")):
        for i, tensor in enumerate(tensors):
            alone = cast(tensor, fmt, scaling)
            assert torch.equal(values[i].nan_to_num(), alone.values.nan_to_num()), (scaling, i)
            assert int(saturated[i]) == alone.saturated, (scaling, i)


def test_gemms_measured_together_are_each_measured_alone():
    torch.manual_seed(4)
    pairs = [(torch.randn(40, 64) * (1 + 100 * (i == 1)), torch.randn(64, 32) * 0.1) for i in range(3)]
    for a, b in pairs:
        assert forward_groups([(a, b)])[0] == forward_rows(a, b)
    for (a, b), rows in zip(pairs, forward_groups(pairs)):
        assert rows == forward_rows(a, b)
    # Over SAMPLE_VALUES: each measured on its own sample of rows, together or alone.
    large = [(torch.randn(300, 64) * (1 + 50 * i), torch.randn(64, 32)) for i in range(2)]
    for (a, b), rows in zip(large, forward_groups(large)):
        assert rows == forward_rows(a, b)
    grads = [(torch.randn(40, 32), b) for _, b in pairs[:3]]
    for (go, b), rows in zip(grads, gradient_groups(grads)):
        assert rows == gradient_rows(go, b)
