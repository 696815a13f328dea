"""The failing step replayed op by op: which aten op first made inf or NaN, in which module and
phase; the remedy tried on the same step; the X-ray of a healthy step. Small models on the CPU,
in fp16 (CPU autocast runs float16), each with one planted fault."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_tui.training.trace.op_fix import try_fixes
from amp_tui.training.trace.op_trace import replay, restore_rng_snapshot, rng_snapshot, trace_step
from amp_tui.training.trace.op_xray import xray

D = 16
SCALE = 65536.0


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)   # scaled after the product: that overflows first
        return self.o(scores.softmax(-1) @ v)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.norm(x + self.attn(x))


class TinyTransformer(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def transformer_step(plant: float = 1.0):
    """The model and the step's forward: q and k of the second block grown by `plant`."""
    model = TinyTransformer()
    with torch.no_grad():
        model.blocks[1].attn.q.weight.mul_(plant)
        model.blocks[1].attn.k.weight.mul_(plant)
    x, y = torch.randn(2, 8, D), torch.randint(0, 4, (2, 8))
    return model, lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def test_attention_scores_overflow_in_the_forward_and_the_module_in_fp32_fixes_it():
    model, forward = transformer_step(plant=200.0)
    trace = trace_step(model, forward, scale=SCALE, dtype="fp16")
    assert (trace.op, trace.op_module, trace.op_phase, trace.op_kind) == \
        ("aten.bmm", "blocks.1.attn", "forward", "overflow")
    assert trace.op_output_dtype == "float16"
    assert [i["dtype"] for i in trace.op_inputs] == ["float16", "float16"]
    assert all(100 < i["max"] < 65504 for i in trace.op_inputs)   # q and k large, each still in range
    big = [f"{i['max']:.0f}" for i in trace.op_inputs]
    assert trace.message == (f"aten.bmm in blocks.1.attn (forward, float16 inputs up to {big[0]} and {big[1]}) "
                             "overflowed float16 (max 65504)")
    assert not trace.step_finite
    json.dumps(trace.as_fields())

    fixed = try_fixes(model, forward, trace, scale=SCALE, dtype="fp16")
    assert (fixed.fix, fixed.fix_verified) == ("--fp32-modules 'blocks.1.attn'", True)
    assert fixed.tried == [{"fix": "--fp32-modules 'blocks.1.attn'", "verified": True,
                            "message": "no op made a non-finite value in the replay"}]
    json.dumps(fixed.as_fields())
    assert type(model.blocks[1].attn).forward is Attention.forward and "forward" not in vars(model.blocks[1].attn)


class MseHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, h, target):
        return F.mse_loss(self.proj(h), target)


class Regressor(nn.Module):
    """Returns its own loss, as models with a loss output do."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(D, D)
        self.head = MseHead()

    def forward(self, x, target):
        return self.head(torch.relu(self.body(x)), target)


def test_a_large_loss_times_the_scale_overflows_in_the_backward_of_the_head():
    model = Regressor()
    x, target = torch.randn(4, D), torch.full((4, D), 316.0)
    forward = lambda: model(x, target)   # noqa: E731
    with torch.autocast("cpu", dtype=torch.float16):
        assert 5e4 < forward().item() < 2e5   # ~1e5: finite, and finite in fp16 too
    trace = trace_step(model, forward, scale=SCALE, dtype="fp16")
    assert (trace.op, trace.op_module, trace.op_phase, trace.op_kind) == \
        ("aten._to_copy", "head", "backward", "overflow")
    assert trace.op_inputs[0]["dtype"] == "float32" and trace.op_output_dtype == "float16"
    # Without the scale the same backward stays finite: the scale is what overflowed.
    assert trace_step(model, forward, scale=1.0, dtype="fp16").op is None

    fixed = try_fixes(model, forward, trace, scale=SCALE, dtype="fp16")
    assert [t["verified"] for t in fixed.tried] == [False, True]   # head in fp32 still hands fp16 back
    assert (fixed.fix, fixed.fix_verified) == ("--dtype bf16", True)


def test_gradients_kept_from_the_step_replay_its_backward_from_the_model_outputs():
    """A monitored loop keeps the inputs and the gradient that reached the outputs; the loss
    itself (outside the model) is not replayed."""
    model = nn.Sequential()
    model.add_module("body", nn.Linear(D, D))
    model.add_module("head", nn.Linear(D, D))
    with torch.no_grad():
        model.head.weight.fill_(5.0)
    x = torch.randn(4, D)
    kept = []
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    out.register_hook(kept.append)
    (out.float().mean() * SCALE).backward()
    assert torch.isfinite(kept[0]).all() and not torch.isfinite(model.body.weight.grad).all()

    trace = trace_step(model, lambda: model(x), backward=kept, scale=SCALE, dtype="fp16")
    assert (trace.op, trace.op_module, trace.op_phase) == ("aten.mm", "head", "backward")
    assert try_fixes(model, lambda: model(x), trace, backward=kept, scale=SCALE, dtype="fp16").fix == "--dtype bf16"


class ZeroOverZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        zero = x - x
        return grad * zero / zero


class Gate(nn.Module):
    def forward(self, x):
        return ZeroOverZero.apply(x)


class ExpAtTheRoot(nn.Module):
    """exp in the root's own forward, of 80 (e^80 ~ 5.5e34, which fp32 holds); its backward's
    product with a gradient of 1e6 passes fp32's max. fp32 throughout: no CPU's fp16 involved."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.bias.fill_(80.0)

    def forward(self, x):
        return torch.exp(self.lin(x))


def test_an_op_in_the_backward_of_the_roots_own_forward_is_said_to_be_in_the_backward():
    model, x = ExpAtTheRoot(), torch.ones(2, 4)
    trace = trace_step(model, lambda: model(x), backward=torch.full((2, 4), 1e6), dtype=None)
    assert (trace.op, trace.op_module, trace.op_phase) == ("aten.mul", "", "backward")
    assert trace.message.startswith("aten.mul in the backward of the model's own forward (float32 inputs")
    assert "own forward (backward" not in trace.message   # not forward and backward at once


def test_zero_over_zero_in_a_custom_backward():
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(D, D))
    model.add_module("gate", Gate())
    model.add_module("out", nn.Linear(D, 1))
    x = torch.randn(4, D)
    trace = trace_step(model, lambda: model(x).float().mean(), scale=1024.0, dtype="fp16")
    assert (trace.op, trace.op_module, trace.op_phase, trace.op_kind) == ("aten.div", "gate", "backward", "nan")
    assert [i["max"] for i in trace.op_inputs] == [0.0, 0.0]
    assert trace.message == "aten.div in gate (backward, float16 inputs up to 0 and 0) made NaN from finite inputs"


class LogFeatures(nn.Module):
    def forward(self, x):
        return torch.log(x - 10.0)


def test_log_of_a_negative_number_in_the_forward():
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(D, D))
    model.add_module("features", LogFeatures())
    x = torch.randn(4, D)
    trace = trace_step(model, lambda: model(x).float().mean(), scale=SCALE, dtype="fp16")
    assert (trace.op, trace.op_module, trace.op_phase, trace.op_kind) == ("aten.log", "features", "forward", "nan")
    assert trace.message.endswith("made NaN from finite inputs")


def test_an_overflow_hidden_behind_tanh_is_found_though_loss_and_gradients_stay_finite():
    model = nn.Sequential()
    model.add_module("wide", nn.Linear(D, D))
    model.add_module("squash", nn.Tanh())
    model.add_module("out", nn.Linear(D, 1))
    with torch.no_grad():
        model.wide.weight.fill_(2000.0)
    x = torch.rand(4, D) + 2.0   # every row sums to > 32: 2000 times that passes 65504
    trace = trace_step(model, lambda: model(x).float().mean(), scale=1024.0, dtype="fp16")
    assert trace.step_finite   # the loss and every gradient: nothing for a finite check to see
    assert (trace.op, trace.op_module, trace.op_phase, trace.op_output_dtype) == \
        ("aten.addmm", "wide", "forward", "float16")
    fixed = try_fixes(model, lambda: model(x).float().mean(), trace, scale=1024.0, dtype="fp16")
    assert (fixed.fix, fixed.fix_verified) == ("--fp32-modules 'wide'", True)


def test_a_compiled_model_is_traced_eagerly_on_its_original_module():
    model, _ = transformer_step(plant=200.0)
    compiled = torch.compile(model)
    x, y = torch.randn(2, 8, D), torch.randint(0, 4, (2, 8))
    forward = lambda: F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())   # noqa: E731
    trace = trace_step(compiled, forward, scale=SCALE, dtype="fp16")
    assert (trace.op, trace.op_module) == ("aten.bmm", "blocks.1.attn")
    fixed = try_fixes(compiled, forward, trace, scale=SCALE, dtype="fp16")
    assert (fixed.fix, fixed.fix_verified) == ("--fp32-modules 'blocks.1.attn'", True)
    names = [m["module"] for m in xray(compiled, forward, scale=SCALE, dtype="fp16")["modules"]]
    assert "blocks.1.attn" in names and not any("_orig_mod" in (n or "") for n in names)


# From torch.autocast's op reference ("CPU Ops that can autocast to float16/bfloat16" and "to
# float32"), the ops these models run. softmax, log_softmax and layer_norm are on CUDA's float32
# list only: on the CPU they run in their input's dtype, float16 after a matmul.
CPU_LOW_PRECISION = {"aten.mm", "aten.addmm", "aten.bmm"}


def test_the_xray_of_a_healthy_fp16_step_shows_the_cpu_autocast_policy():
    model, forward = transformer_step()
    found = xray(model, forward, scale=SCALE, dtype="fp16")
    json.dumps(found, allow_nan=False)
    assert found["step_finite"] and found["dtype"] == "float16"
    rows = [dict(op, module=m["module"]) for m in found["modules"] for op in m["ops"]]
    dtypes: dict[tuple, set] = {}
    for row in rows:
        dtypes.setdefault((row["op"], row["phase"]), set()).add(row["dtype"])
    assert {r["op"] for r in rows if r["phase"] == "forward"} >= {"aten.addmm", "aten.bmm"}
    for row in rows:
        if row["op"] in CPU_LOW_PRECISION:   # forward and backward: the gradients come back in fp16
            assert row["dtype"] == "float16", row
    assert dtypes[("aten.nll_loss_forward", "forward")] == {"float32"}
    assert dtypes[("aten._log_softmax", "forward")] == {"float32"}   # inside cross_entropy, cast first
    attn = {r["op"]: r for r in rows if r["module"] == "blocks.0.attn" and r["phase"] == "forward"}
    assert attn["aten._softmax"]["dtype"] == "float16" and attn["aten.bmm"]["count"] == 2
    norm = {r["op"]: r for r in rows if r["module"] == "blocks.0.norm" and r["phase"] == "forward"}
    assert norm["aten.native_layer_norm"]["dtype"] == "float16"
    assert [m["module"] for m in found["modules"]][:2] == ["embed", "blocks.0.attn.q"]
    # In the backward each of q, k and v gets its own weight gradient (they share their input).
    for name in ("q", "k", "v"):
        ops = {r["op"]: r for r in rows if r["module"] == f"blocks.0.attn.{name}" and r["phase"] == "backward"}
        assert ops["aten.mm"]["count"] == 2, name

    closest = found["closest"]
    assert closest and [c["headroom_bits"] for c in closest] == sorted(c["headroom_bits"] for c in closest)
    first = closest[0]
    limit = torch.finfo(getattr(torch, first["dtype"])).max
    assert first["headroom_bits"] == pytest.approx(math.log2(limit / first["max_out"]), abs=0.01)


def test_the_replay_leaves_weights_grads_buffers_and_rng_as_they_were():
    model, forward = transformer_step(plant=200.0)
    model.add_module("bn", nn.BatchNorm1d(4))
    plain_forward = forward
    forward = lambda: plain_forward() + model.bn(torch.randn(8, 4)).mean()   # noqa: E731
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p) if i % 2 else None
    before = [(p.detach().clone(), p.grad, None if p.grad is None else p.grad.clone()) for p in params]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()

    trace = trace_step(model, forward, scale=SCALE, dtype="fp16")
    try_fixes(model, forward, trace, scale=SCALE, dtype="fp16")
    xray(model, forward, scale=SCALE, dtype="fp16")

    for p, (weight, grad, grad_values) in zip(params, before):
        assert torch.equal(p.detach(), weight) and p.grad is grad
        assert grad is None or torch.equal(grad, grad_values)
    assert all(torch.equal(b, kept) for b, kept in zip(model.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_rng_snapshot_replays_the_same_dropout():
    model = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5))
    x = torch.randn(4, D)
    snapshot = rng_snapshot()
    step_output = model(x)
    seen = []
    trace_step(model, lambda: seen.append(model(x)) or seen[-1].sum(), rng=snapshot)
    assert torch.equal(seen[0], step_output)
    restore_rng_snapshot(snapshot)
    assert torch.equal(model(x), step_output)


class CausalMix(nn.Module):
    def forward(self, x):
        scores = x @ x.transpose(-2, -1)
        future = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(-1) @ x


@pytest.mark.parametrize("plant", [None, 5000.0])
def test_a_mask_of_minus_inf_is_passed_over_for_the_overflow_after_it(plant):
    model = nn.Sequential()
    model.add_module("mix", CausalMix())
    model.add_module("out", nn.Linear(D, D))
    if plant:
        with torch.no_grad():
            model.out.weight.fill_(plant)
    x = torch.rand(2, 8, D) + 1.0
    trace = trace_step(model, lambda: model(x).float().mean(), scale=1.0, dtype="fp16")
    if plant:
        assert (trace.op, trace.op_module, trace.op_phase) == ("aten.addmm", "out", "forward")
    else:
        assert trace.op is None and trace.step_finite


def test_memory_not_yet_written_is_no_op_of_the_model_and_forward_only_runs_no_backward():
    # Dropout's mask starts as empty memory, which may hold anything (NaN too) until filled.
    model = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5), nn.Linear(D, 1))
    x = torch.randn(4, D)
    backwards = []

    def forward():
        out = model(x).sum()
        out.register_hook(lambda grad: backwards.append(grad))
        return out
    result = replay(model, forward, backward=False, dtype="fp16")
    assert not backwards
    assert not {r.op for r in result.records} & {"aten.empty_like", "aten.empty"}
    assert any(r.op.startswith("aten.bernoulli") or r.op == "aten.native_dropout" for r in result.records)
