"""The probes' figures are exactly those of a straightforward per-tensor reference: max |x| of
every output, gradient and weight, folded per layer by hand, and the underflow counts, on models
with many small modules, tied and frozen weights, empty parameters, mixed dtypes, and NaN/inf in
outputs, gradients and weights, over several probed steps (the grouped reductions are planned
once and reused, and planned again when the shapes change)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from amp_tui.core.precision import FP16_TINY
from amp_tui.training.probes import extremes
from amp_tui.training.probes.layer_probes import LayerProbe
from amp_tui.training.probes.probe_options import ProbeOptions
from amp_tui.training.step.engine import GuardedTrainer


def maxabs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max())


def widest(values: list[float]) -> float | None:
    """max, where NaN wins; None for nothing."""
    if not values:
        return None
    return math.nan if any(v != v for v in values) else max(values)


def floating(output) -> list[torch.Tensor]:
    """The first four floating, non-empty tensors of an output, as the probes take them."""
    found: list[torch.Tensor] = []

    def walk(v):
        if len(found) >= 4:
            return
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() and v.numel():
                found.append(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
    walk(output)
    return found


class Reference:
    """Per-tensor figures of one step, measured by hooks of its own and read from the parameters."""

    def __init__(self, probe: LayerProbe):
        self.modules = probe._modules
        self.layer_params = [list(m.parameters(recurse=False)) for m in self.modules]
        self.acts: dict[int, list[float]] = {}
        self.order: list[int] = []
        self.weights: list[float | None] = []
        for i, m in enumerate(self.modules):
            m.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(_m, _inputs, output):
            tensors = floating(output)
            if tensors and i not in self.acts:
                self.order.append(i)
            if tensors:
                self.acts.setdefault(i, []).extend(maxabs(t) for t in tensors)
        return hook

    def start(self):
        """Before the step: the weights its forward will use."""
        self.acts, self.order = {}, []
        self.weights = [widest([maxabs(p) for p in ps if p.numel()]) for ps in self.layer_params]

    def figures(self, scale: float | None, judged: set[int]):
        """After the step: its gradients (unscaled by then) and the underflow shares."""
        act = [widest(self.acts.get(i, [])) for i in range(len(self.modules))]
        grads, under, under_scaled = [], [], []
        for ps in self.layer_params:
            gs = [p.grad for p in ps if p.grad is not None and p.grad.numel()]
            grads.append(widest([maxabs(g) for g in gs]))
            nonzero = sum(int(torch.count_nonzero(g)) for g in gs)
            below = sum(int(torch.count_nonzero((g.abs() < FP16_TINY) & (g != 0))) for g in gs)
            below_s = sum(int(torch.count_nonzero((g.abs() < FP16_TINY / scale) & (g != 0))) for g in gs) \
                if scale else 0
            under.append(below / nonzero if nonzero else None)
            under_scaled.append(below_s / nonzero if nonzero else None)
        params = [p for ps in self.layer_params for p in ps]
        nonfinite = any(p.grad is not None and p.grad.numel() and not math.isfinite(maxabs(p.grad))
                        for p in params if id(p) in judged)
        return act, grads, under, under_scaled if scale else None, nonfinite


def same(a, b) -> bool:
    """Equal lists of figures, NaN equal to NaN, None to None."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x is y or (x is not None and y is not None and (x == y or (x != x and y != y))) for x, y in zip(a, b))


def run_and_compare(model, loss_fn, batches, *, dtype="fp32", opt_params=None, init_scale=1024.0,
                    mutate=None, unmeasured_at_first=()):
    """Every probed step's figures against the reference's. `unmeasured_at_first`: layers whose
    activation the first step may leave unmeasured (None), never mismeasure."""
    torch.manual_seed(0)
    params = list(model.parameters()) if opt_params is None else opt_params
    opt = torch.optim.SGD([p for p in params if p.requires_grad], lr=1e-3)
    # No diagnosis pass: it would run the forward again under the reference's hooks.
    trainer = GuardedTrainer(model, opt, loss_fn, dtype=dtype, init_scale=init_scale,
                             probes=ProbeOptions(every=1, underflow_every=1), diagnose=False)
    ref = Reference(trainer.probe)
    judged = {id(p) for g in opt.param_groups for p in g["params"]}
    compared = 0
    for k, batch in enumerate(batches):
        if mutate is not None:
            mutate(k, model)
        ref.start()
        result = trainer.step([batch])
        f = result.figures
        act, grads, under, under_scaled, nonfinite = ref.figures(result.scale, judged)
        if result.nonfinite == "loss":   # no backward: no gradient figures
            assert same(f.act, act) and f.order == ref.order and same(f.weight, ref.weights), k
            assert f.grad == [None] * len(f.grad) and f.underflow is None, k
            continue
        if k == 0 and unmeasured_at_first:
            act = [None if i in unmeasured_at_first and f.act[i] is None else v for i, v in enumerate(act)]
        assert same(f.act, act), (k, f.act, act)
        assert f.order == ref.order, k
        assert same(f.grad, grads), (k, f.grad, grads)
        assert same(f.weight, ref.weights), (k, f.weight, ref.weights)
        assert same(f.underflow, under), (k, f.underflow, under)
        assert same(f.underflow_scaled, under_scaled), (k, f.underflow_scaled, under_scaled)
        assert f.grads_nonfinite == nonfinite, k
        compared += 1
    trainer.close()
    return compared


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


def blocks(n=6, width=16):
    return nn.Sequential(nn.Linear(8, width), *(Block(width) for _ in range(n)), nn.Linear(width, 3))


def mse(model, batch):
    x, y = batch
    return (model(x).float() - y).pow(2).mean()


def batches(n=4, rows=5, d_in=8, d_out=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_many_small_modules(dtype):
    torch.manual_seed(0)
    assert run_and_compare(blocks(), mse, batches(), dtype=dtype) == 4


def test_large_tensors_measured_one_by_one_and_small_ones_stacked(monkeypatch):
    """The same figures whichever way a tensor is grouped, and whether a hook measures an output
    or leaves it for later."""
    from amp_tui.training.probes import layer_probes as probes

    for small in (0, 100, 1 << 14, 1 << 30):
        monkeypatch.setattr(extremes, "SMALL_NUMEL", small)
        monkeypatch.setattr(probes, "SMALL_NUMEL", small)
        torch.manual_seed(0)
        assert run_and_compare(blocks(3), mse, batches(3)) == 3


class Tied(nn.Module):
    """A head tied to its embedding (one parameter, two layers), a frozen layer, a scalar
    parameter, an empty layer, a module that runs twice and one that never runs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.mix = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.tensor(0.5))
        self.empty = nn.Linear(0, 8)
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        h = self.mix(self.mix(self.embed(idx)))
        h = self.frozen(h) * self.gain + self.empty(h[..., :0])
        return self.head(h)


def lm(model, batch):
    return nn.functional.cross_entropy(model(batch).float().reshape(-1, 11), batch.reshape(-1))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_tied_frozen_empty_scalar_and_unused_parameters(dtype):
    torch.manual_seed(0)
    model = Tied()
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 11, (3, 4), generator=g) for _ in range(3)]
    assert run_and_compare(model, lm, data, dtype=dtype) == 3


class Mixed(nn.Module):
    """Parameters of three dtypes, and outputs of two in one module."""

    def __init__(self):
        super().__init__()
        self.low = nn.Linear(8, 8).half()
        self.wide = nn.Linear(8, 8).double()
        self.two = nn.Linear(8, 3)

    def forward(self, x):
        h = self.low(x.half()).float()
        h = self.wide(h.double()).float()
        y = self.two(h)
        return y.half(), y   # two outputs of two dtypes


def test_mixed_dtypes():
    torch.manual_seed(0)
    model = Mixed()

    def loss(m, batch):
        x, y = batch
        a, b = m(x)
        return (a.float() - y).pow(2).mean() + (b - y).pow(2).mean()
    assert run_and_compare(model, loss, batches(3)) == 3


def test_nan_and_inf_in_weights_outputs_and_gradients():
    """An inf weight, then a NaN one, then a NaN input: every figure the reference gives,
    NaN and inf in the same places; non-finite gradients judged as the reference judges."""
    torch.manual_seed(0)
    model = blocks(4)

    def plant(k, m):
        with torch.no_grad():
            if k == 1:
                m[2].linear.weight[0, 0] = math.inf
            if k == 2:
                m[2].linear.weight[0, 0] = 0.0
                m[3].norm.bias[1] = math.nan
            if k == 3:
                m[3].norm.bias[1] = 0.0

    data = batches(5)
    data[4][0][0, 0] = math.nan
    run_and_compare(model, mse, data, mutate=plant)


def test_a_nonfinite_gradient_of_a_parameter_the_optimizer_does_not_hold_is_shown_not_judged():
    torch.manual_seed(0)
    model = blocks(2)
    held = [p for name, p in model.named_parameters() if not name.startswith("1.")]

    def loss(m, batch):
        return mse(m, batch) + m[1].norm.weight.abs().sqrt().sum() * 0 + (m[1].norm.bias * 0).sum()

    def poison(k, m):
        with torch.no_grad():
            m[1].norm.weight.zero_()   # d sqrt(|w|)/dw at 0: inf, then NaN times 0
    assert run_and_compare(model, loss, batches(2), opt_params=held, mutate=poison) == 2


def test_shapes_that_change_between_steps_and_a_module_that_sometimes_does_not_run():
    torch.manual_seed(0)
    model = blocks(3)

    def loss(m, batch):
        x, y = batch
        if x.shape[0] == 2:   # block 2 doesn't run: its parameters get no gradient this step
            return (m[4](m[3](m[1](m[0](x)))) - y).pow(2).mean()
        return mse(m, batch)
    data = [*batches(2, rows=5), *batches(2, rows=2, seed=1), *batches(2, rows=7, seed=2)]
    assert run_and_compare(model, loss, data) == 6


def test_probe_used_by_hand_without_end_forward():
    """begin(), a forward, a backward, record_gradients(), collect(): as a user's own loop calls
    it, the kept outputs are measured at record_gradients()."""
    torch.manual_seed(0)
    model = blocks(2)
    probe = LayerProbe(model)
    ref = Reference(probe)
    ref.start()
    probe.begin()
    x, y = batches(1)[0]
    ((model(x) - y).pow(2).mean()).backward()
    probe.record_gradients(None, underflow=True)
    figures, _ = probe.collect()
    probe.end()
    act, grads, under, _, _ = ref.figures(None, set())
    assert same(figures.act, act) and same(figures.grad, grads) and same(figures.weight, ref.weights)
    assert same(figures.underflow, under) and figures.underflow_scaled is None


def test_outputs_over_the_memory_bound_are_measured_as_they_come(monkeypatch):
    from amp_tui.training.probes import layer_probes as probes

    monkeypatch.setattr(probes, "SMALL_NUMEL", 40)           # larger outputs: measured in the hook
    monkeypatch.setattr(probes, "KEEP_TOTAL_BYTES", 500)      # a few kept ones: measured together
    torch.manual_seed(0)
    assert run_and_compare(blocks(3), mse, batches(2, rows=1) + batches(2, rows=4)) == 4


def test_more_large_outputs_than_slots(monkeypatch):
    """A module that runs many times in a forward: its outputs overflow the slots kept for
    them, and every one still counts."""
    from amp_tui.training.probes import layer_probes as probes

    monkeypatch.setattr(probes, "SMALL_NUMEL", 0)
    torch.manual_seed(0)
    lin, head = nn.Linear(8, 8), nn.Linear(8, 3)

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = lin, head

        def forward(self, x):
            for _ in range(20):
                x = torch.tanh(self.lin(x)) * 1.5
            return self.head(x)
    assert run_and_compare(Loop(), mse, batches(2)) == 2


class Twice(nn.Module):
    """A module that runs twice in a forward, its second output NaN at the step that sets `poison`."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.register_buffer("poison", torch.ones(()))

    def forward(self, x):
        h = self.lin(x)
        return self.head(h + self.lin(h * self.poison))


def test_a_nan_after_a_finite_output_of_the_same_module_wins():
    torch.manual_seed(0)
    model = Twice()

    def plant(k, m):
        m.poison.fill_(math.nan if k == 1 else 1.0)
    assert run_and_compare(model, mse, batches(3), mutate=plant) == 2


def test_a_model_cast_after_the_probe_was_made():
    """The hooks' buffers were made for float32 weights; after model.double() they are planned
    again, and the figures are the reference's."""
    torch.manual_seed(0)
    model = blocks(2, width=80)   # weights over SMALL_NUMEL: read in the hooks

    def cast(k, m):
        if k == 1:
            m.double()
    data = [(x.double(), y.double()) for x, y in batches(3)]

    def loss(m, batch):
        x, y = batch
        return (m(x.to(m[0].weight.dtype)) - y.to(m[0].weight.dtype)).pow(2).mean()
    assert run_and_compare(model, loss, data, mutate=cast) == 3


class InPlaceAfter(nn.Module):
    """Small outputs that the next op changes in place: a ReLU(inplace=True) after a Linear, and a
    residual `out += x` after another (as torchvision's blocks do)."""

    def __init__(self, width=16):
        super().__init__()
        self.first = nn.Linear(8, width)
        self.relu = nn.ReLU(inplace=True)
        self.second = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.relu(self.first(x))
        out = self.second(h)
        out += h
        return self.head(out)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_outputs_changed_in_place_after_their_module_are_measured_as_the_module_returned_them(dtype):
    """A kept small output measured after the forward would be the ReLU's or the sum's; from the
    first step on such a layer is measured in its hook (that step leaves it unmeasured)."""
    torch.manual_seed(0)
    model = InPlaceAfter()
    with torch.no_grad():
        model.first.bias.fill_(-3.0)   # most of the first layer's output is negative: the ReLU changes its max
    assert run_and_compare(model, mse, batches(n=5), dtype=dtype, unmeasured_at_first={0, 1}) == 5


def test_channels_last_weights_of_the_same_shape_are_measured_together():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(),
                          nn.Linear(16 * 4 * 4, 3)).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 16, 4, 4, generator=g).to(memory_format=torch.channels_last),
             torch.randn(2, 3, generator=g)) for _ in range(3)]
    assert run_and_compare(model, mse, data) == 3


def test_integer_parameters_are_not_measured_as_floats():
    """A quantized (integer) weight has no float range: its layer's figure comes from its float
    parameters only (-x of an int8 -128 or a uint8 would wrap around)."""
    from amp_tui.training.probes.extremes import MaxAbsPlan
    ints = torch.tensor([3, 10], dtype=torch.uint8)
    floats = torch.tensor([-2.0, 1.0])
    plan = MaxAbsPlan([ints, floats], [[0, 1]])
    with torch.no_grad():
        assert plan.fold(plan.measure([ints, floats])).tolist() == [2.0]


def test_a_layer_of_zeros_reads_plus_zero():
    from amp_tui.training.probes.extremes import MaxAbsPlan
    zeros = torch.full((5000,), -0.0)
    plan = MaxAbsPlan([zeros], [[0]])
    with torch.no_grad():
        value = plan.fold(plan.measure([zeros]))[0].item()
    assert value == 0.0 and math.copysign(1.0, value) == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_stacked_half_floats_read_as_their_magnitude_nan_and_inf_included(dtype):
    """Stacks of half floats are reduced on their bits: every special value gives what abs and
    max give (a NaN of either sign wins, -inf reads inf, -0 and subnormals keep their size)."""
    from amp_tui.training.probes.extremes import MaxAbsPlan
    tiny = torch.finfo(dtype).tiny / 4   # a subnormal
    rows = [[1.0, -2.5, 0.5], [-math.inf, 3.0, 1.0], [-0.0, -0.0, 0.0], [-tiny, tiny / 2, 0.0],
            [1.0, -math.nan, 7.0], [math.nan, -math.inf, 2.0], [-65504.0, 4.0, 1.0]]
    tensors = [torch.tensor(r, dtype=dtype) for r in rows]
    plan = MaxAbsPlan(tensors)
    assert len(plan.stacks) == 1 and not plan.singles
    with torch.no_grad():
        got = plan.measure(tensors)[:-1].tolist()
    want = [maxabs(t.float()) for t in tensors]
    assert [g != g for g in got] == [w != w for w in want]
    assert [g for g in got if g == g] == [w for w in want if w == w]
    assert math.copysign(1.0, got[2]) == 1.0
