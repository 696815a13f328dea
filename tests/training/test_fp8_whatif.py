"""The fp8 what-if of one step (training/fp8/whatif.py): every nn.Linear's input, weight and
output gradient cast in each format; a layer whose input carries a few massive channels, and only
that one, kept in bf16; the step left as it was; the filter it emits for torchao."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_tui.recording.fp8_file import filter_source
from amp_tui.training.fp8.whatif import fp8_whatif

from support import outlier_model


def model(factor: float = 1e4) -> nn.Module:
    return outlier_model(factor)


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


class Attention(nn.Module):
    """Attention written out, as most model code has it: its two matmuls are no nn.Linear's."""

    def __init__(self, width: int, heads: int, fused: bool = False, outlier: float = 1.0):
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.heads, self.fused = heads, fused
        self.register_buffer("gain", torch.ones(width // heads))
        self.gain[[1, 5]] = outlier   # a few channels of q, as grow in attention without qk-norm

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        q = q * self.gain
        if self.fused:
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class TinyLM(nn.Module):
    """An embedding, one attention block, and a head tied to the embedding through F.linear."""

    def __init__(self, fused=False, outlier=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 64)
        self.attn = Attention(64, 4, fused, outlier)

    def forward(self, ids):
        return nn.functional.linear(self.attn(self.embed(ids)), self.embed.weight)


def lm_whatif(net):
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (4, 32))
    return fp8_whatif(net, lambda: nn.functional.cross_entropy(net(ids).flatten(0, 1), ids.flatten()), dtype="bf16")


def test_matmuls_outside_linear_are_measured_with_their_gradients():
    result = lm_whatif(TinyLM())
    assert set(result["verdict"]) == {"attn.qkv", "attn.out"}   # the Linear layers, as before
    assert set(result["op_verdict"]) == {"attn:matmul#0", "attn:matmul#1", "linear#0"}
    assert result["ops"]["attn:matmul#0"]["shapes"] == [[4, 4, 32, 16], [4, 4, 16, 32]]
    ops = {(r["module"], r["op"], r["tensor"]) for r in result["rows"] if "op" in r}
    for module, op in (("attn", "matmul#0"), ("attn", "matmul#1"), ("", "linear#0")):
        assert {(module, op, t) for t in ("input", "weight", "grad_output")} <= ops
    assert all(v == "fp8" for v in result["op_verdict"].values()), result["op_verdict"]


def test_the_scores_matmul_behind_outlier_query_channels_is_kept_in_bf16():
    result = lm_whatif(TinyLM(outlier=3e3))
    assert result["op_verdict"]["attn:matmul#0"].startswith("bf16: input in e4m3 tensorwise")
    # The scores they blow up make the softmax one-hot: most weights flush to zero in the next matmul.
    assert "flushes to zero" in result["op_verdict"]["attn:matmul#1"]


def test_scaled_dot_product_attention_is_measured_from_its_q_k_and_v():
    fused, written = lm_whatif(TinyLM(fused=True)), lm_whatif(TinyLM())
    assert {"attn:sdpa.scores#0", "attn:sdpa.values#0"} <= set(fused["op_verdict"])

    def tensorwise(result, op, tensor):
        return next(r for r in result["rows"] if r.get("op") == op and r["tensor"] == tensor
                    and r["format"] == "e4m3" and r["scaling"] == "tensorwise")

    # The same GEMMs as the attention written out: q (after its gain) and k, then the weights and v.
    for fused_op, op in (("sdpa.scores#0", "matmul#0"), ("sdpa.values#0", "matmul#1")):
        for tensor in ("input", "weight"):
            a, b = tensorwise(fused, fused_op, tensor), tensorwise(written, op, tensor)
            assert a["sqnr_db"] == pytest.approx(b["sqnr_db"], abs=0.3), (fused_op, tensor)
            assert a["output_sqnr_db"] == pytest.approx(b["output_sqnr_db"], abs=0.3), (fused_op, tensor)
    assert not any(r["tensor"] == "grad_output" for r in fused["rows"] if r.get("op", "").startswith("sdpa"))


def test_gpt2_from_a_small_config_its_conv1d_and_its_attention():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=4, n_embd=64, vocab_size=128,
                                                               n_positions=64))
    ids = torch.randint(0, 128, (2, 32))
    result = fp8_whatif(net, lambda: net(input_ids=ids, labels=ids).loss, dtype="bf16")
    ops = set(result["op_verdict"])
    # GPT-2's projections are Conv1D (an addmm), none an nn.Linear but the head.
    assert set(result["verdict"]) == {"lm_head"}
    assert {f"transformer.h.0.{m}:addmm#0" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")} <= ops
    attention = {k for k in ops if k.startswith("transformer.h.0.attn:")}
    assert attention in ({"transformer.h.0.attn:sdpa.scores#0", "transformer.h.0.attn:sdpa.values#0"},
                         {"transformer.h.0.attn:matmul#0", "transformer.h.0.attn:matmul#1"}), attention
    grads = {r["op"] for r in result["rows"] if r.get("op") and r["tensor"] == "grad_output"}
    assert "addmm#0" in grads
