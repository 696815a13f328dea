"""The fp8 what-if of one step (training/fp8/whatif.py): every nn.Linear's input, weight and
output gradient cast in each format; a layer whose input carries a few massive channels, and only
that one, kept in bf16; the step left as it was; the filter it emits for torchao."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_tui.recording.fp8_file import filter_source
from amp_tui.training.fp8.whatif import fp8_whatif


class MassiveChannels(nn.Module):
    """A few channels of its input made `factor` times larger, as LLMs' massive activations are."""

    def __init__(self, width: int, channels, factor: float):
        super().__init__()
        self.register_buffer("gain", torch.ones(width))
        self.gain[list(channels)] = factor

    def forward(self, x):
        return x * self.gain


def model(factor: float = 1e4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
        MassiveChannels(64, (3, 17, 50), factor),
        nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 16))


def batch():
    torch.manual_seed(1)
    return torch.randn(128, 32), torch.randint(0, 16, (128,))


def whatif(net, scale=None, data=None):
    x, y = data or batch()
    return fp8_whatif(net, lambda: nn.functional.cross_entropy(net(x), y), dtype="bf16", scale=scale)


def rows_of(result, module, tensor):
    return {(r["format"], r["scaling"]): r for r in result["rows"] if r["module"] == module and r["tensor"] == tensor}


@pytest.mark.parametrize("factor", [1e3, 1e4])
def test_the_layer_behind_massive_channels_and_only_it_is_kept_in_bf16(factor):
    result = whatif(model(factor))
    assert set(result["verdict"]) == {"0", "2", "5", "8"}
    kept = {m for m, v in result["verdict"].items() if v != "fp8"}
    assert kept == {"5"}, result["verdict"]
    assert "input in e4m3 tensorwise" in result["verdict"]["5"]
    # Each tensor in every format that tiles it: 6 casts of 64 features; 16 outputs tile no block of
    # 32 (MX).
    assert len(rows_of(result, "5", "input")) == 6
    assert set(rows_of(result, "8", "grad_output")) == {("e4m3", "tensorwise"), ("e4m3", "rowwise"),
                                                        ("e5m2", "tensorwise"), ("e5m2", "rowwise"),
                                                        ("nvfp4", "block16")}
    # Energy-weighted, the tensor's SQNR reads well; the casts that scale finer keep more of its
    # other channels.
    row = rows_of(result, "5", "input")
    assert row[("e4m3", "tensorwise")]["sqnr_db"] > 25
    tensorwise, rowwise, mx = (row[k] for k in (("e4m3", "tensorwise"), ("e4m3", "rowwise"), ("mxfp8", "block32")))
    assert mx["underflow"] <= rowwise["underflow"] <= tensorwise["underflow"]
    if factor >= 1e4:
        assert mx["channel_sqnr_db"] >= rowwise["channel_sqnr_db"] >= tensorwise["channel_sqnr_db"]


def test_the_whatif_leaves_the_step_as_it_was_and_reads_gradients_unscaled():
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = batch()
    rng = torch.get_rng_state()
    plain, scaled = whatif(net, data=data), whatif(net, scale=1024.0, data=data)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    # The loss scale is taken off the gradients: the same casts, the same figures.
    for module in ("0", "8"):
        a, b = rows_of(plain, module, "grad_output"), rows_of(scaled, module, "grad_output")
        assert a[("e5m2", "tensorwise")]["sqnr_db"] == pytest.approx(b[("e5m2", "tensorwise")]["sqnr_db"], abs=0.05)


def test_the_emitted_filter_converts_the_fp8_ready_layers_whose_shape_fits():
    float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear
    net = model()
    result = whatif(net)
    namespace: dict = {}
    exec(compile(filter_source(result, step=0, run="test"), "fp8-filter.py", "exec"), namespace)
    float8.convert_to_float8_training(net, module_filter_fn=namespace["module_filter_fn"],
                                      config=float8.Float8LinearConfig(emulate=True))
    converted = {name for name, m in net.named_modules() if isinstance(m, Float8Linear)}
    # 8 is fp8-ready but has 16 outputs... a multiple of 16 too: all but the kept one.
    assert converted == {"0", "2", "8"}
    # And it still trains.
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nn.functional.cross_entropy(net(x), y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters() if p.requires_grad)


def test_a_layer_whose_shape_torchao_cant_run_stays_out_of_the_filter():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 24), nn.GELU(), nn.Linear(24, 16))
    x = torch.randn(8, 32)
    result = fp8_whatif(net, lambda: net(x).square().mean(), dtype="bf16")
    # 24 input features tile no block of 16 or 32: the second layer's forward casts are fp8 only.
    assert {r["format"] for r in result["rows"] if r["module"] == "2" and r["tensor"] != "grad_output"} \
        == {"e4m3", "e5m2"}
    namespace: dict = {}
    exec(filter_source(result, step=0, run="test"), namespace)
    fn = namespace["module_filter_fn"]
    assert result["verdict"]["0"] == "fp8" and not fn(net[0], "0")   # 24 x 32: not multiples of 16
    assert not fn(net[1], "1")


def test_a_filter_with_no_layer_ready_converts_none_and_says_why():
    namespace: dict = {}
    exec(filter_source({"rows": [], "verdict": {"fc": "bf16: input in e4m3 tensorwise: crest"}}, step=3,
                       run='a "quoted" run'), namespace)
    assert namespace["FP8_READY"] == set() and namespace["KEEP_BF16"] == {"fc": "input in e4m3 tensorwise: crest"}
    assert not namespace["module_filter_fn"](nn.Linear(16, 16), "fc")
