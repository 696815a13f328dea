"""The monitor driven from a framework's hooks instead of a `with` block: begin_step/end_step
record what `with monitor.step()` records, an optimizer stepped with a closure is measured on its
own step's gradients, a failure is recorded with its traceback, and a refused key says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_tui
from amp_tui.job.monitor import Monitor
from amp_tui.job.monitor_options import MonitorOptions
from amp_tui.recording.reader import read_session

from frameworks import command


def batches():
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    return [(x[i:i + 8], x[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_begin_and_end_step_record_what_a_with_block_records(tmp_path):
    runs = {}
    for way in ("with", "hooks"):
        model, opt = build()
        monitor = amp_tui.monitor(model, opt, run_dir=tmp_path / way, announce=False, probe_every=1)
        for x, y in batches() * 2:
            opt.zero_grad()
            if way == "with":
                with monitor.step() as step:
                    with monitor.autocast():
                        step.loss = loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
            else:
                monitor.begin_step()
                with monitor.autocast():
                    loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                monitor.end_step(loss)
        monitor.close()
        steps = read_session(tmp_path / way).steps
        runs[way] = [{k: s[k] for k in ("step", "loss", "updates", "layers")} for s in steps]
    assert runs["hooks"] == runs["with"] and len(runs["with"]) == 8


@pytest.mark.parametrize("says_when", [True, False])
def test_an_optimizer_stepped_with_a_closure_is_measured_on_its_own_gradients(tmp_path, says_when):
    """As Lightning steps it: the forward and backward run inside optimizer.step(closure), after
    the step's pre-hook. The first step's gradients exist only then."""
    model, opt = build()
    monitor = amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False, probe_every=1)
    expected = []
    for x, y in batches():
        monitor.begin_step()
        losses = []

        def closure(x=x, y=y, losses=losses):
            opt.zero_grad()
            with monitor.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss)
            expected.append(model[0].weight.grad.abs().max().item())
            if says_when:
                monitor.gradients_ready()   # Lightning's on_before_optimizer_step
            return loss
        opt.step(closure)
        monitor.end_step(losses[0])
    monitor.close()
    measured = [s["layers"]["grad"][0] for s in read_session(tmp_path / "run").steps]
    assert measured == pytest.approx(expected, rel=1e-2)


def test_a_failed_step_is_recorded_with_its_traceback_and_the_run_ends_in_error(tmp_path):
    model, opt = build()
    monitor = amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False, probe_every=1)
    monitor.begin_step()
    try:
        raise ValueError("the framework's step broke")
    except ValueError as exc:
        monitor.fail_step(exc)
    monitor.close()
    session = read_session(tmp_path / "run")
    error = [e for e in session.events if e["kind"] == "error"][0]
    assert "the framework's step broke" in error["message"] and "Traceback" in error["traceback"]
    assert session.end["status"] == "error"


def test_a_step_ended_without_a_loss_is_not_recorded(tmp_path):
    model, opt = build()
    monitor = amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False, probe_every=1)
    monitor.begin_step()
    monitor.end_step(None)
    (x, y), = batches()[:1]
    monitor.begin_step()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    monitor.end_step(loss)
    monitor.close()
    assert [s["step"] for s in read_session(tmp_path / "run").steps] == [0]


def test_a_refused_key_says_why(tmp_path):
    model, opt = build()
    monitor = Monitor(model, opt, MonitorOptions.of(run_dir=tmp_path / "run", announce=False, probe_every=1),
                      framework="the Trainer")
    monitor.controller.refuse("scale", "scale change refused: DeepSpeed owns the loss scale")
    answers = []
    order = command("scale=1024")
    order.on_done = answers.append
    monitor.controller.submit(order)
    monitor.begin_step()
    monitor.end_step(None)
    monitor.close()
    assert answers[0].ok is False and "DeepSpeed owns the loss scale" in answers[0].message
    [refused] = [e for e in read_session(tmp_path / "run").events if e["kind"] == "refused"]
    assert refused["command"] == "scale=1024" and "DeepSpeed" in refused["message"]
