"""The guarded step: skip detection, ordering, probes, precision switches, syncs."""

import copy
import math

import pytest
import torch
from torch import nn

from amp_tui.training.probes.probe_options import ProbeOptions
from amp_tui.training.step.engine import GuardedTrainer, LossError, PrecisionRefused


def mlp(width=16, depth=3):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def regression_batch(width=16, target=1.0):
    x = torch.randn(32, width)
    return x, torch.full((32, 1), target)


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("flavour", ["plain", "foreach", "fused"])
def test_overflow_skips_update_for_every_optimizer_flavour(flavour):
    # A fused optimizer is stepped even on overflow: the skip must be judged by the scale.
    kwargs = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[flavour]
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **kwargs)
    trainer = GuardedTrainer(model, opt, mse, dtype="fp16", init_scale=2.0**40)
    before = params_of(model)
    result = trainer.step([regression_batch(target=300.0)])
    assert result.skipped and result.nonfinite == "gradients"
    assert result.scale == 2.0**40 and trainer.scale == 2.0**39
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b), "an overflowing step must not change the weights"
    assert opt.state == {} or all(
        torch.count_nonzero(s["exp_avg"]) == 0 for s in opt.state.values() if "exp_avg" in s)
    # with a sane scale it trains
    trainer.set_scale(1.0)
    result = trainer.step([regression_batch(target=300.0)])
    assert not result.skipped and result.updates_applied == 1 and result.skipped_total == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_scheduler_steps_only_when_the_update_is_applied():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = GuardedTrainer(model, opt, mse, dtype="fp16", init_scale=2.0**40, scheduler=sched)
    trainer.step([regression_batch(target=300.0)])   # skipped
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    trainer.set_scale(1.0)
    trainer.step([regression_batch(target=300.0)])   # applied
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_accumulate_unscales_clips_and_steps_once():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {"step": 0}
    original = opt.step

    def counting_step(*a, **k):
        calls["step"] += 1
        return original(*a, **k)
    opt.step = counting_step
    trainer = GuardedTrainer(model, opt, mse, dtype="fp16", init_scale=256.0, max_grad_norm=0.5)
    scaler = trainer.scaler
    unscales = {"n": 0}
    real_unscale = scaler.unscale_

    def counting_unscale(o):
        unscales["n"] += 1
        return real_unscale(o)
    scaler.unscale_ = counting_unscale
    result = trainer.step([regression_batch(), regression_batch(), regression_batch()])
    assert result.micro_batches == 3
    assert calls["step"] == 1 and unscales["n"] == 1
    assert result.grad_norm is not None and result.grad_norm > 0


def test_accumulated_gradients_equal_one_big_batch():
    torch.manual_seed(1)
    a, b = regression_batch(), regression_batch()
    whole = (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
    m1, m2 = mlp(), mlp()
    m2.load_state_dict(m1.state_dict())
    t1 = GuardedTrainer(m1, torch.optim.SGD(m1.parameters(), lr=0.1), mse, dtype="fp32")
    t2 = GuardedTrainer(m2, torch.optim.SGD(m2.parameters(), lr=0.1), mse, dtype="fp32")
    t1.step([a, b])
    t2.step([whole])
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_nonfinite_loss_skips_backward_and_names_the_first_overflowing_layer():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[1].weight.fill_(3000.0)  # 8 inputs * ~1 * 3000 * ... -> past 65504 in fp16
        model[0].weight.fill_(10.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = GuardedTrainer(model, opt, lambda m, b: m(b).float().pow(2).mean(), dtype="fp16")
    before = params_of(model)
    result = trainer.step([torch.ones(4, 8)])
    assert result.nonfinite == "loss" and result.skipped
    assert not math.isfinite(result.loss)
    assert result.first_nonfinite_layer == "1"
    assert all(p.grad is None for p in model.parameters()), "no backward on a non-finite loss"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert result.scale == 65536.0 and trainer.scale == 65536.0  # forward overflow: scale untouched
    # bf16 has fp32's range: the same model is finite
    trainer.set_dtype("bf16")
    assert trainer.step([torch.ones(4, 8)]).nonfinite is None


def traced_loss(events: list, nan_at: set[int] = frozenset()):
    """mse that logs each call ("loss") and each backward through it ("backward"); the loss of
    the calls in `nan_at` (0-based) is NaN."""
    def loss_fn(model, batch):
        index = events.count("loss")
        events.append("loss")
        loss = mse(model, batch)
        if index in nan_at:
            loss = loss * float("nan")
        loss.register_hook(lambda grad: events.append("backward"))
        return loss
    return loss_fn


def agreed_check(events: list, answers: list[bool]):
    """An agree_finite standing in for the ranks': logs when the check starts and when its
    answer is asked for, and answers from `answers` in turn."""
    def agree_finite(value):
        events.append("check")

        def finite_everywhere():
            events.append("answer")
            return answers.pop(0)
        return finite_everywhere
    return agree_finite


def test_a_nonfinite_loss_of_one_process_runs_no_backward():
    events = []
    model = mlp()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), traced_loss(events, {0}),
                             dtype="fp16")
    result = trainer.step([regression_batch()])
    assert result.nonfinite == "loss" and result.skipped
    assert events[0] == "loss" and "backward" not in events


def test_a_loss_check_of_several_ranks_is_answered_after_the_backward_and_a_no_discards_it():
    """Another rank's loss was not finite: this rank's own loss is, its backward ran while the
    check went round, and the answer throws the gradients away. Nothing of the scaler, the
    weights or the optimizer moves, and the probes' figures are there as for any non-finite loss."""
    events = []
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = GuardedTrainer(model, opt, traced_loss(events), dtype="fp16", init_scale=256.0)
    answers = [False, True]
    trainer.agree_finite = agreed_check(events, answers)
    before, scaler_before = params_of(model), dict(trainer.scaler.state_dict())
    result = trainer.step([regression_batch()])
    assert events == ["loss", "check", "backward", "answer", "loss"]   # then the diagnosis's forward
    assert math.isfinite(result.loss)
    assert result.nonfinite == "loss" and result.skipped and result.skipped_total == 1
    assert result.updates_applied == 0 and result.figures is not None
    assert result.scale == 256.0 and result.next_scale == 256.0 and trainer.scale == 256.0
    assert trainer.scaler.state_dict() == scaler_before
    assert all(p.grad is None for p in model.parameters()), "the gradients are discarded"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state == {}
    # The next step, agreed finite, trains as usual with the same scaler.
    result = trainer.step([regression_batch()])
    assert not result.skipped and result.updates_applied == 1 and not answers
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_loss_check_that_fails_in_the_first_micro_batch_skips_the_others():
    """Every rank learns the answer after the same micro-batch's backward, and none runs the
    step's remaining micro-batches."""
    events = []
    model = mlp()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), traced_loss(events),
                             dtype="fp16")
    trainer.agree_finite = agreed_check(events, [False])
    before = params_of(model)
    result = trainer.step([regression_batch(), regression_batch()])
    # then the diagnosis's forward; no op trace: this rank's loss was finite, another rank's was not
    assert events == ["loss", "check", "backward", "answer", "loss"]
    assert result.nonfinite == "loss" and result.skipped and result.micro_batches == 2
    assert result.op_trace is None
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_nonfinite_loss_of_this_rank_still_runs_its_backward():
    """The other ranks run their backward (with DDP's all-reduce in it) before they learn the
    answer: this rank must too, whatever its own loss."""
    events = []
    model = mlp()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), traced_loss(events, {0}),
                             dtype="bf16")
    trainer.agree_finite = agreed_check(events, [False])
    result = trainer.step([regression_batch()])
    # then the diagnosis's forward, and the op trace's: this rank saw the value, it replays it
    assert events == ["loss", "check", "backward", "answer", "loss", "loss"]
    assert result.nonfinite == "loss" and not math.isfinite(result.loss) and result.skipped
    assert result.op_trace is not None
    assert all(p.grad is None for p in model.parameters())


def test_unprobed_bad_step_is_diagnosed_with_a_second_pass():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e4)
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             lambda m, b: m(b).float().mean(), dtype="fp16", probes=ProbeOptions(every=10))
    trainer.step([torch.ones(4, 8)])  # step 0 is probed
    result = trainer.step([torch.ones(4, 8)])
    assert result.figures is None and result.first_nonfinite_layer == "0"


def test_nonfinite_gradient_without_scaler_is_not_applied():
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # d/dw sqrt(|w|) at w = 0 is infinite while the loss is finite.
    trainer = GuardedTrainer(model, opt, lambda m, b: m.weight.abs().sqrt().sum() + m(b).mean(),
                             dtype="bf16")
    before = params_of(model)
    result = trainer.step([torch.ones(2, 4)])
    assert math.isfinite(result.loss)
    assert result.skipped and result.nonfinite == "gradients" and result.first_nonfinite_layer == "Linear"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("poisoned", ["float32", "float16"])
def test_nonfinite_gradient_of_an_unprobed_step_is_not_applied(poisoned):
    """Unprobed bf16/fp32 steps check the gradients with GradScaler's fused check, one call per
    dtype: an inf in either dtype's gradients skips the update and leaves every gradient as it was."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[1].half()
    with torch.no_grad():
        model[0 if poisoned == "float32" else 1].weight[0].zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, b):
        w = m[0].weight if poisoned == "float32" else m[1].weight
        return w[0].abs().sqrt().sum().float() + m[1](m[0](b).half()).float().mean()
    reference = copy.deepcopy(model)
    loss_fn(reference, torch.ones(2, 4)).backward()
    trainer = GuardedTrainer(model, opt, loss_fn, dtype="fp32", probe=False, diagnose=False)
    before = params_of(model)
    result = trainer.step([torch.ones(2, 4)])
    assert math.isfinite(result.loss) and result.skipped and result.nonfinite == "gradients"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad():
        model[0 if poisoned == "float32" else 1].weight[0].fill_(1.0)
    assert not trainer.step([torch.ones(2, 4)]).skipped


def test_nonfinite_gradient_of_a_parameter_no_module_owns_is_not_applied():
    """The probes judge their own gradients on the host; a parameter the optimizer steps outside
    the model still gets the device-side check."""
    model = nn.Linear(4, 1)
    loose = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), loose], lr=0.1)
    trainer = GuardedTrainer(model, opt, lambda m, b: loose.abs().sqrt().sum() + m(b).mean(), dtype="fp32")
    before = params_of(model)
    result = trainer.step([torch.ones(2, 4)])
    assert math.isfinite(result.loss) and result.skipped and result.nonfinite == "gradients"
    assert not result.figures.grads_nonfinite  # the model's own gradients are fine
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_probe_hooks_stay_on_only_while_steps_are_probed():
    model = mlp(depth=2)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, dtype="fp32",
                             probes=ProbeOptions(every=3))
    hooked = lambda: [bool(m._forward_hooks) for m in linears]  # noqa: E731
    trainer.step([regression_batch()])  # step 0 probed, step 1 is not: hooks off
    assert not any(hooked())
    trainer.step([regression_batch()])
    trainer.step([regression_batch()])
    assert not any(hooked())
    every = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, dtype="fp32")
    first = every.step([regression_batch()])
    assert all(hooked())  # every step probed: attached once, kept
    model(torch.randn(2, 16))  # a forward outside a step is not measured, and does not disturb
    second = every.step([regression_batch()])
    assert second.figures.order == first.figures.order == list(range(len(linears)))
    assert all(v is not None and math.isfinite(v) for v in second.figures.act)
    every.close()
    assert not any(hooked())


def test_failed_step_takes_the_probe_hooks_off():
    model = mlp(depth=2)
    calls = []

    def loss_fn(m, batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return mse(m, batch)
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn, dtype="fp32")
    trainer.step([regression_batch()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.step([regression_batch()])
    assert not any(m._forward_hooks for m in model.modules())


def test_probe_figures_match_a_manual_measurement():
    torch.manual_seed(3)
    model = mlp(width=12, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0 leaves grads and weights to compare
    outputs = {}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        module.register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o.detach().abs().max()))
    trainer = GuardedTrainer(model, opt, mse, dtype="fp32")
    result = trainer.step([regression_batch(width=12)])
    assert trainer.layer_names == [n for n, _ in linears]
    f = result.figures
    for i, (name, module) in enumerate(linears):
        grad = max(module.weight.grad.abs().max().item(), module.bias.grad.abs().max().item())
        weight = max(module.weight.abs().max().item(), module.bias.abs().max().item())
        assert f.act[i] == pytest.approx(outputs[name].item())
        assert f.grad[i] == pytest.approx(grad)
        assert f.weight[i] == pytest.approx(weight)
    assert f.order == list(range(len(linears)))


def test_gradient_figures_are_unscaled():
    torch.manual_seed(4)
    m1, m2 = mlp(), mlp()
    m2.load_state_dict(m1.state_dict())
    batch = regression_batch()
    r32 = GuardedTrainer(m1, torch.optim.SGD(m1.parameters(), lr=0), mse, dtype="fp32").step([batch])
    r16 = GuardedTrainer(m2, torch.optim.SGD(m2.parameters(), lr=0), mse, dtype="fp16",
                         init_scale=1024.0).step([batch])
    for a, b in zip(r32.figures.grad, r16.figures.grad):
        assert b == pytest.approx(a, rel=0.05)


def test_one_host_transfer_per_probed_step(monkeypatch):
    """Figures come to the host in one transfer, never one sync per tensor.

    Only syncs made by amp-tui's own code count: the optimizer and GradScaler make their own."""
    import sys
    model = mlp(depth=6)
    trainer = GuardedTrainer(model, torch.optim.Adam(model.parameters()), mse, dtype="fp16", init_scale=256.0)
    trainer.step([regression_batch()])
    counts = {"tolist": 0, "item": 0, "float": 0}
    for name, attr in (("tolist", "tolist"), ("item", "item"), ("float", "__float__")):
        real = getattr(torch.Tensor, attr)

        def counted(self, *a, _real=real, _name=name, **k):
            if "amp_tui" in sys._getframe(1).f_code.co_filename:
                counts[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, attr, counted)
    trainer.step([regression_batch()])
    # one sync for the finite-loss check, one for every figure and the scale
    assert counts == {"tolist": 1, "item": 0, "float": 1}


def test_dtype_round_trip_carries_the_fp16_scale():
    model = mlp()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, dtype="fp16",
                             init_scale=2.0**40)
    trainer.step([regression_batch(target=300.0)])  # overflow: 2^40 -> 2^39
    change = trainer.set_dtype("bf16")
    assert change["before"]["scale"] == 2.0**39 and change["after"]["scale"] is None
    assert trainer.scaler is None and trainer.step([regression_batch()]).scale is None
    trainer.set_dtype("fp32")
    trainer.set_dtype("fp16")
    assert trainer.scale == 2.0**39, "fp16 re-entered at the last fp16 scale"
    # halving in bf16 lowers the scale fp16 starts from next time
    trainer.set_dtype("bf16")
    change = trainer.set_scale("half")
    assert change["after"]["init_scale"] == 2.0**38
    trainer.set_dtype("fp16")
    assert trainer.scale == 2.0**38


def test_one_scaler_per_run_not_per_step():
    model = mlp()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, dtype="fp16")
    scaler = trainer.scaler
    for _ in range(3):
        trainer.step([regression_batch()])
    assert trainer.scaler is scaler


def test_bad_values_are_refused():
    model = mlp()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, dtype="fp16")
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(PrecisionRefused):
            trainer.set_scale(bad)
    with pytest.raises(ValueError):
        trainer.set_dtype("int8")
    with pytest.raises(LossError, match="shape"):
        GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                       lambda m, b: m(b[0]), dtype="fp32").step([regression_batch()])


def test_unsupported_bf16_is_refused(monkeypatch):
    from amp_tui.training.step import precision_state
    monkeypatch.setattr(precision_state, "unsupported_reason",
                        lambda device, dtype: "bf16 is not supported here" if dtype == "bfloat16" else None)
    model = mlp()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, dtype="fp16")
    with pytest.raises(PrecisionRefused, match="not supported"):
        trainer.set_dtype("bf16")
    assert trainer.dtype == "float16" and trainer.scaler is not None


def test_a_step_the_boundary_took_off_the_schedule_runs_its_forward_without_the_probes_hooks():
    """The hooks stay on after a probed step whose next step is probed too; when the boundary then
    changes the schedule (`probe=auto`, or several ranks' agreed spacing), the step runs unprobed,
    and its forward without the hooks (each a call per module)."""
    torch.manual_seed(0)
    model = mlp()
    hooked = []

    def watched(m, batch):
        hooked.append(any(module._forward_hooks for module in m.modules()))
        return mse(m, batch)

    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), watched, dtype="fp32",
                             probes=ProbeOptions(every="auto"))
    trainer.probe_schedule.set_mode("every")
    for _ in range(4):
        trainer.step([regression_batch()])
    trainer.probe_schedule.set_mode("auto")   # a boundary: step 4 is not (no unprobed step measured yet)
    result = trainer.step([regression_batch()])
    assert result.figures is None and hooked == [True] * 4 + [False]
