"""No update with inf/NaN gradients is ever applied, whoever steps the optimizer.

GradScaler checks the gradients before it unscales them: once a long overflow has halved its
scale to 0 (about 166 halvings from 65536), the scaled loss is 0, the check finds nothing and the
unscale makes 0 × inf = NaN, which `scaler.step` applied to every weight. The cases here overflow
the forward far past fp16's max (x × 1e8) for as long as the scale takes to collapse, then train
on finite inputs: the weights must stay finite, the scale at or above its floor, and an alert
must say that the floor bound. The overflow is made in fp32 (the output × 1e30, squared by the
loss: inf on any CPU), so the case doesn't hang on how a CPU computes fp16."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import amp_tui
from amp_tui.recording.reader import read_session
from amp_tui.training.step.update_guard import SCALE_FLOOR

# Halvings from 65536 before the fp32 scale is 0: about 166; the overflow lasts longer.
OVERFLOWING = 200
FINITE_AFTER = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 8), torch.randn(16, 1)


def _loss(model: nn.Module, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x).float()
    if step < OVERFLOWING:
        out = out * 1e30   # squared by the loss: inf, and inf/NaN gradients at any scale
    return nn.functional.mse_loss(out, y)


def _finite(model: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def _scaled_step(monitor, scaler, opt, loss_fn, *args) -> None:
    """One monitored step of the canonical loop: `loss_fn(*args)`, the scaled backward, step, update."""
    with monitor.step() as s:
        s.loss = loss = loss_fn(*args)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _steps_and_alerts(run_dir):
    session = read_session(run_dir / "session.jsonl")
    return session.steps, [e for e in session.events if e["kind"] == "alert"]


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adamw"])
def test_a_collapsing_gradscaler_never_applies_nan_in_a_monitored_loop(tmp_path, fused):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused) if fused \
        else torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", control=False, announce=False)
    # Each failing step's op-by-op replay (which leaves the weights as they were) would make 200
    # of them the whole test's time; the weights are what is judged here.
    monitor.driver.replay_failing = False
    for step in range(OVERFLOWING + FINITE_AFTER):
        x, y = _batch(step)
        # fp32: fp16's own arithmetic is not what is judged
        _scaled_step(monitor, scaler, opt, _loss, model, step, x, y)
        assert _finite(model), f"NaN weights after step {step} (scale {scaler.get_scale():g})"
    monitor.close()
    assert scaler.get_scale() >= SCALE_FLOOR
    steps, alerts = _steps_and_alerts(tmp_path / "run")
    assert min(s["scale"] for s in steps) >= SCALE_FLOOR
    assert [a for a in alerts if a["reason"] == "min_scale"], [a["reason"] for a in alerts]
    # the finite steps after the overflow train: the scale lets some updates through
    assert any(not s["skipped"] for s in steps[OVERFLOWING:])


def test_a_gradscaler_handed_over_at_scale_0_is_raised_to_the_floor(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=0.0)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", control=False, announce=False)
    for step in range(3):
        x, y = _batch(OVERFLOWING + step)
        _scaled_step(monitor, scaler, opt, _loss, model, OVERFLOWING + step, x, y)
    monitor.close()
    assert _finite(model)
    _, alerts = _steps_and_alerts(tmp_path / "run")
    assert any(a["reason"] == "min_scale" and "came with scale 0" in a["message"] for a in alerts)


def test_the_unscaled_check_catches_what_gradscaler_misses_below_scale_1(tmp_path):
    """Held at a tiny scale (min_scale=1e-30), a finite scaled gradient unscales to inf in fp32:
    GradScaler's check, made before the unscale, passes it; amp-tui's, after it, holds it back."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e-30)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", control=False,
                              announce=False, min_scale=1e-30)
    x = torch.full((2, 4), 1e9)
    with monitor.step() as s:
        s.loss = loss = model(x).sum()
        opt.zero_grad()
        scaler.scale(loss).backward()
        with torch.no_grad():   # a finite scaled gradient that unscaling by 1e30 takes past fp32's max
            model.weight.grad.fill_(3e38)
        scaler.step(opt)
        scaler.update()
    monitor.close()
    assert _finite(model)
    steps, _ = _steps_and_alerts(tmp_path / "run")
    assert steps[0]["skipped"]
    session = read_session(tmp_path / "run" / "session.jsonl")
    [event] = [e for e in session.events if e["kind"] == "nonfinite"]
    assert event.get("held_back") is True and "held the update back" in event["message"]


def test_without_a_gradscaler_nan_gradients_are_held_back(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = amp_tui.monitor(model, opt, dtype="fp32", run_dir=tmp_path / "run", control=False, announce=False)
    for step in range(4):
        x, y = _batch(OVERFLOWING)
        if step == 1:
            y = y * math.nan
        with monitor.step() as s:
            loss = nn.functional.mse_loss(model(x), y)
            s.loss = loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert _finite(model), f"NaN weights after step {step}"
    monitor.close()
    steps, _ = _steps_and_alerts(tmp_path / "run")
    assert [s["skipped"] for s in steps] == [False, True, False, False]
    session = read_session(tmp_path / "run" / "session.jsonl")
    [event] = [e for e in session.events if e["kind"] == "nonfinite"]
    assert "amp-tui held the update back" in event["message"]


def test_a_collapsing_gradscaler_never_applies_nan_under_the_hf_trainer(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    from amp_tui.integrations.transformers import AmpTuiCallback

    from frameworks import VOCAB, TokenData, hf_trainer

    class Blowup(nn.Module):
        """A language-model-shaped module whose loss overflows while `overflowing` is set."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, 1)
            self.overflowing = True

        def forward(self, input_ids, labels=None):
            out = self.head(self.emb(input_ids)).float()
            return {"loss": ((out * 1e30 if self.overflowing else out) ** 2).mean()}

    model = Blowup()
    trainer = hf_trainer(tmp_path, steps=OVERFLOWING + FINITE_AFTER, cpu_fp16_scaler=65536.0, model=model,
                         data=TokenData(n=32))
    amp = AmpTuiCallback(trainer, run_dir=tmp_path / "run", announce=False, control=False)

    class Plan(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            amp.monitor.driver.replay_failing = False   # as above: the weights are what is judged

        def on_step_begin(self, args, state, control, **kwargs):
            model.overflowing = state.global_step < OVERFLOWING
            assert _finite(model), f"NaN weights before step {state.global_step}"

    trainer.add_callback(amp)
    trainer.add_callback(Plan())
    trainer.train()
    assert _finite(model)
    steps, alerts = _steps_and_alerts(tmp_path / "run")
    assert min(s["scale"] for s in steps) >= SCALE_FLOOR
    assert [a for a in alerts if a["reason"] == "min_scale"]
    assert any(not s["skipped"] for s in steps[OVERFLOWING:])


COLLAPSING_SCRIPT = f'''
import torch
from torch import nn

def loss_fn(model, batch):
    x, y, overflowing = batch
    loss = nn.functional.mse_loss(model(x).float(), y)
    if overflowing.item():
        # sqrt's gradient at 0 is inf: NaN gradients at any loss scale, with a finite loss
        loss = loss + torch.sqrt(model.weight.float().sum() * 0.0)
    return loss

def setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    batches = [(x, y, torch.tensor(step < {OVERFLOWING})) for step in range({OVERFLOWING + FINITE_AFTER})]
    return {{"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3),
             "loss_fn": loss_fn, "batches": batches}}
'''


def test_a_collapsing_scale_never_applies_nan_under_amp_tui_train(write_script, tmp_path):
    from support import train_run
    run = train_run(write_script(COLLAPSING_SCRIPT), tmp_path / "run", dtype="float16", control=False,
                    steps=OVERFLOWING + FINITE_AFTER, probe_every=1000000)
    # As above: each failing step's diagnosis and op replay would be the test's whole time.
    run.driver.trainer.trace_ops = run.driver.trainer.diagnose_bad_steps = False
    run.run()
    steps, alerts = _steps_and_alerts(tmp_path / "run")
    assert len(steps) == OVERFLOWING + FINITE_AFTER
    assert min(s["scale"] for s in steps) >= SCALE_FLOOR
    assert all(math.isfinite(s["loss"]) for s in steps), "an update applied NaN to the weights"
    assert [a for a in alerts if a["reason"] == "min_scale"]


def test_a_fix_applied_at_a_collapsed_scale_says_to_set_the_scale_back(tmp_path):
    from amp_tui.core.commands import parse_action
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** -20)   # where a long overflow leaves it
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", control=False, announce=False)
    for step in range(2):
        if step == 1:
            monitor.controller.submit(parse_action("fp32=0", "api"))
        x, y = _batch(OVERFLOWING)
        _scaled_step(monitor, scaler, opt, _mse, model, x, y)
    monitor.close()
    session = read_session(tmp_path / "run" / "session.jsonl")
    [fix] = [e for e in session.events if e["kind"] == "intervention" and e["action"] == "fp32"]
    assert "collapsed" in fix["message"] and "scale=65536" in fix["message"]


def test_an_applied_nonfinite_step_with_a_gradscaler_is_not_said_to_have_none():
    from amp_tui.job.records.run_records import nonfinite_message
    from amp_tui.training.step.engine import StepResult
    applied = StepResult(step=3, loss=math.nan, scale=0.0, skipped=False, skipped_total=0, updates_applied=4,
                         dtype="float16", micro_batches=1, nonfinite="loss", next_scale=0.0)
    assert "no GradScaler" not in nonfinite_message(applied)
    applied.scale = None
    assert "no GradScaler to skip it" in nonfinite_message(applied)
