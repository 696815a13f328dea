"""The forecasts under the defaults (`probe_every="auto"`): a value growing inside a module's
forward is forecast by op and module, well ahead and about when it comes; the probes narrow as it
nears; a harmless growth skip is a forecast made on the probe before the growth, never an alert.

Judged on the forecasts' own claims (the lead before the overflow the run itself recorded, the
step it named), not on whether a given CPU's fp16 arithmetic overflows at one step or the next."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # the acceptance cases live with the benchmark that reuses them
    sys.path.insert(0, str(ROOT))

import amp_tui  # noqa: E402
from amp_tui.recording.reader import read_session  # noqa: E402
from bench.forecast_cases import GROWTH_INTERVAL, scaled_run  # noqa: E402

from support import install_made_up_clock  # noqa: E402


class GrowingInside(nn.Module):
    """`self.logits(h) * gain` before a LayerNorm: the shape of attention scores computed inside
    the attention's forward. Neither module's output grows; the product does, 3% a step."""

    def __init__(self):
        super().__init__()
        self.logits = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.gain = 1.0

    def forward(self, h):
        return self.norm(self.logits(h) * self.gain)


def growing_inside_loop(run_dir, steps=600, rate=1.03):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), GrowingInside(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=run_dir, announce=False, control=False)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for i in range(steps):
        model[1].gain = rate ** i
        opt.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    monitor.close()
    return read_session(run_dir)


def test_a_value_growing_inside_a_forward_is_forecast_by_op_and_module(tmp_path, monkeypatch):
    # The probes fall by a made-up clock (a step of 10 ms, a probe 2 ms more), not the machine's load.
    install_made_up_clock(monkeypatch, 0.010, 0.002)
    session = growing_inside_loop(tmp_path / "run")
    assert session.header["probe_every"] == "auto"
    overflow = next(e["step"] for e in session.events if e["kind"] == "nonfinite")
    (alert,) = [e for e in session.events if e["kind"] == "alert" and e.get("reason") == "forecast_layer"]
    said = alert["forecast"]
    assert (said["layer"], said["op"], said["figure"]) == ("1", "aten.mul", "act")
    assert "aten.mul in 1" in alert["message"] and "--fp32-modules '1'" in alert["fix"]
    left = overflow - alert["step"]
    assert left >= 50, (alert["step"], overflow)                       # seen well ahead ...
    assert abs(said["at_step"] - overflow) <= 0.3 * left, (said, overflow)   # ... and about when
    # The probes narrowed as it neared, each narrowing said.
    trends = [e for e in session.events if e["kind"] == "probes" and e["reason"] == "trend"]
    assert trends and trends[0]["step"] < overflow and trends[0]["mode"] == "auto"
    probed = [r["step"] for r in session.steps if "layers" in r and r["step"] < overflow]
    gaps = [b - a for a, b in zip(probed, probed[1:])]
    assert gaps[-1] < gaps[len(gaps) // 2]


def test_a_harmless_growth_skip_is_forecast_on_the_probe_before_it_and_raises_no_alert(tmp_path):
    """A gradient near half of fp16's max times the scale (bench/forecast_cases.py): each growth
    overflows once. With the default schedule the step before each growth is probed, and the skip
    is a forecast event."""
    scaled_run(tmp_path / "run", init_scale=1024.0, steps=3 * GROWTH_INTERVAL, probe_every="auto")
    session = read_session(tmp_path / "run")
    skipped = [r["step"] for r in session.steps if r["skipped"]]
    forecasts = [e for e in session.events if e["kind"] == "forecast" and e["reason"] == "forecast_scale"]
    assert skipped and forecasts
    assert not [e for e in session.events if e["kind"] == "alert" and str(e.get("reason")).startswith("forecast")]
    steps = {r["step"]: r for r in session.steps}
    for skip in skipped:
        (said,) = [f for f in forecasts if f["forecast"]["growth_step"] == skip]
        assert said["step"] < skip and said["severity"] == "info"
        assert "layers" in steps[skip - 2]   # the probe before the growth measured it
    assert any(e["kind"] == "probes" and e["reason"] == "growth" for e in session.events)
