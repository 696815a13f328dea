"""The per-layer probes on awkward modules: several outputs of mixed dtypes, a module that runs
twice in one forward, parameters without gradients or without elements."""

import math

import pytest
import torch
from torch import nn

from amp_tui.training.probes.layer_probes import LayerProbe
from amp_tui.training.step.engine import GuardedTrainer


class TwoOutputs(nn.Module):
    """Returns a half and a float tensor: the two land in different buffers."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = x @ self.weight
        return y.half() * 3, y * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.two = TwoOutputs()
        self.shared = nn.Linear(4, 4)      # runs twice per forward
        self.frozen = nn.Linear(4, 4)      # no gradient: requires_grad off
        self.frozen.requires_grad_(False)
        self.empty = nn.Linear(0, 4)       # parameters without elements (weight is 4x0)
        self.unused = nn.Linear(4, 4)      # never runs

    def forward(self, x):
        h, f = self.two(x)
        z = self.shared(self.shared(h.float() + f))
        return self.frozen(z) + self.empty(x[:, :0])


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_awkward_modules_are_measured_as_by_hand():
    torch.manual_seed(0)
    net = Net()
    seen = {}

    def remember(name):
        def hook(_m, _i, out):
            outs = out if isinstance(out, tuple) else (out,)
            value = max(o.detach().float().abs().max().item() for o in outs if o.numel())
            seen[name] = max(seen.get(name, 0.0), value)
        return hook
    for name in ("two", "shared", "frozen", "empty"):
        getattr(net, name).register_forward_hook(remember(name))
    x = torch.randn(8, 4)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.0)
    trainer = GuardedTrainer(net, opt, lambda m, b: m(b).pow(2).mean(), dtype="fp32")
    names = trainer.layer_names
    result = trainer.step([x])
    f = result.figures
    for name in ("two", "shared", "frozen"):
        assert f.act[names.index(name)] == pytest.approx(seen[name], rel=1e-3)
    assert f.act[names.index("empty")] == pytest.approx(seen["empty"])  # its bias alone
    assert f.act[names.index("unused")] is None
    # Run order, each module once, though `shared` ran twice.
    assert [names[i] for i in f.order] == ["two", "shared", "frozen", "empty"]
    assert f.grad[names.index("frozen")] is None and f.grad[names.index("unused")] is None
    assert f.grad[names.index("shared")] == pytest.approx(
        max(net.shared.weight.grad.abs().max().item(), net.shared.bias.grad.abs().max().item()))
    # Weights are measured whether or not the module ran; the empty weight leaves its bias.
    for name in ("unused", "frozen", "shared"):
        m = getattr(net, name)
        assert f.weight[names.index(name)] == pytest.approx(
            max(m.weight.abs().max().item(), m.bias.abs().max().item()))
    assert f.weight[names.index("empty")] == pytest.approx(net.empty.bias.abs().max().item())


def test_outputs_of_two_dtypes_in_one_module_are_both_counted():
    """The module's figure is the larger of its outputs, whichever buffer each landed in."""
    torch.manual_seed(1)
    module = TwoOutputs()
    probe = LayerProbe(module)
    probe.begin()
    x = torch.randn(3, 4)
    half, full = module(x)
    figures, _ = probe.collect()
    probe.end()
    expected = max(half.float().abs().max().item(), full.abs().max().item())
    assert figures.act[0] == pytest.approx(expected)
    # and a NaN in the second output marks the layer non-finite
    probe.begin()
    module.weight.data[0, 0] = math.inf
    module(x)
    figures, _ = probe.collect()
    probe.end()
    assert not math.isfinite(figures.act[0])


def test_a_second_call_widens_the_figure_and_nan_wins():
    lin = nn.Linear(2, 2)
    probe = LayerProbe(lin)
    probe.begin()
    lin(torch.ones(1, 2))
    lin(torch.full((1, 2), 1e3))
    figures, _ = probe.collect()
    assert figures.act[0] == pytest.approx(lin(torch.full((1, 2), 1e3)).abs().max().item())
    probe.begin()
    lin(torch.full((1, 2), math.nan))
    lin(torch.ones(1, 2))
    figures, _ = probe.collect()
    probe.end()
    assert math.isnan(figures.act[0])
