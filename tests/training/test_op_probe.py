"""The values inside a module's forward (training/probes/op_probe.py): each fp16 op's largest
|output|, keyed by op and by the module whose own forward ran it; the training itself untouched."""

import math

import pytest
import torch
from torch import nn

from amp_tui.training.probes.layer_probes import LayerProbe
from amp_tui.training.probes.op_probe import OpProbe, op_key, split_key


class Scores(nn.Module):
    """Attention's shape: the product grows inside the forward; the norm after it hides it."""

    def __init__(self, gain: float):
        super().__init__()
        self.logits = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.gain = gain

    def forward(self, x):
        return self.norm(self.logits(x) * self.gain)


class RawLeaf(nn.Module):
    """A leaf of the user's own, on raw parameters: its intermediate is watched too."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(8))

    def forward(self, x):
        return torch.tanh((x @ self.weight) * 100.0)


class Net(nn.Module):
    def __init__(self, gain: float = 50.0):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = Scores(gain)
        self.raw = RawLeaf()

    def forward(self, x):
        return self.raw(self.block(self.inp(x))).sum(dim=-1) * 2.0


def _probed(model, x, dtype=torch.float16):
    probe = OpProbe(model)
    probe.begin()
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    figures = probe.collect()
    return probe, out, figures


def test_a_value_inside_a_forward_is_measured_by_op_and_module():
    torch.manual_seed(0)
    model, x = Net(gain=50.0), torch.randn(4, 8)
    _, _, figures = _probed(model, x)
    with torch.autocast("cpu", dtype=torch.float16):
        product = model.block.logits(model.inp(x)) * 50.0
    assert figures[op_key("aten.mul", "block")] == pytest.approx(product.abs().max().item(), rel=1e-3)
    # The root's own ops are the model's; a user's leaf is watched; torch.nn leaves are not (their
    # ops make the output the layer probes measure).
    assert op_key("aten.mul", "") in figures and split_key(op_key("aten.mul", "")) == ("aten.mul", "")
    assert op_key("aten.mul", "raw") in figures
    assert not any(key.endswith(" in inp") or key.endswith(" in block.logits") for key in figures)


def test_bf16_and_fp32_values_are_not_measured():
    model, x = Net(), torch.randn(4, 8)
    _, _, figures = _probed(model, x, torch.bfloat16)
    assert figures == {}   # bf16 has fp32's range
    probe = OpProbe(model)
    probe.begin()
    model(x)   # no autocast: fp32 throughout
    assert probe.collect() == {}


def test_an_overflow_inside_a_forward_is_measured_as_inf():
    model, x = Net(gain=1e5), torch.randn(4, 8) * 10
    _, _, figures = _probed(model, x)
    assert math.isinf(figures[op_key("aten.mul", "block")])


def test_the_backward_and_later_forwards_are_not_measured():
    model, x = Net(), torch.randn(4, 8)
    probe, out, _ = _probed(model, x)
    probe.begin()
    with torch.autocast("cpu", dtype=torch.float16):
        model(x)
    forward_only = len(probe.pending)
    out.float().sum().backward()
    assert len(probe.pending) == forward_only   # the mode ended with the forward
    probe.collect()
    with torch.autocast("cpu", dtype=torch.float16):
        model(x)
    assert probe.pending == []                  # collected: idle until the next begin


def test_detach_takes_every_hook_off():
    model = Net()
    probe = OpProbe(model)
    probe.begin()
    assert any(m._forward_hooks for m in model.modules())
    probe.detach()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_training_is_bit_identical_with_the_op_probe():
    """Measuring rides on the step: same outputs, same gradients, same weights after a few steps."""
    def train(with_ops: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Net(gain=20.0)
        probe = LayerProbe(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for i in range(5):
            probe.begin(ops=with_ops)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).float().pow(2).mean()
            loss.backward()
            probe.record_gradients()
            figures, _ = probe.collect()
            probe.end()
            assert (figures.ops is not None) == with_ops
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))


class Wrapper(nn.Module):
    """A framework's module (Lightning's) that holds the model and never runs a forward of its own."""

    def __init__(self):
        super().__init__()
        self.model = Net(gain=50.0)

    def training_step(self, x):
        return self.model(x)


def test_the_outermost_forward_that_runs_arms_it_when_the_root_never_runs():
    wrapper = Wrapper()
    probe = OpProbe(wrapper)
    probe.begin()
    with torch.autocast("cpu", dtype=torch.float16):
        wrapper.training_step(torch.randn(4, 8))
    assert op_key("aten.mul", "model.block") in probe.collect()


def test_another_hook_s_measures_are_no_op_of_the_module():
    """What a module's other forward hooks compute (the layer probes', a user's) runs after its
    forward: not an op of that module, nor of its parent."""
    model = Net()

    def measure(_module, _args, out) -> None:
        assert out.dtype == torch.float16
        out.abs().amax()

    model.raw.register_forward_hook(measure)   # a watched module's own hook, on its fp16 output
    _, _, figures = _probed(model, torch.randn(4, 8))
    assert not [key for key in figures if key.startswith(("aten.abs", "aten.amax"))], figures
    assert op_key("aten.mul", "block") in figures
