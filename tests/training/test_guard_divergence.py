"""A loss that grows whatever the precision is a diverging model: the alert must not blame the
loss scale, nor fp16's range in a run that has no fp16 in it."""

import math

from amp_tui.cli import main
from amp_tui.recording.reader import read_session
from amp_tui.training.step.engine import StepResult
from amp_tui.training.step.guards import GuardConfig, PrecisionGuard

# SGD with a step far too large for this regression: the loss grows in every dtype.
DIVERGING_SCRIPT = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs = torch.randn(256, 8)
    ys = xs.sum(1, keepdim=True)
    batches = [(xs[i:i + 32], ys[i:i + 32]) for i in range(0, 256, 32)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches}
'''


def result(step, loss, *, dtype="float16", scale=65536.0, skipped=True, nonfinite="gradients"):
    return StepResult(step=step, loss=loss, scale=scale if dtype == "float16" else None,
                      skipped=skipped, skipped_total=0, updates_applied=0, dtype=dtype,
                      micro_batches=1, nonfinite=nonfinite)


def alerts_of(guard, results):
    out = []
    for r in results:
        out += guard.observe(r, (r.scale / 2) if r.scale else None, True).alerts
    return out


def test_a_growing_loss_in_fp16_is_called_divergence_not_a_large_loss_times_the_scale():
    guard = PrecisionGuard(GuardConfig(alert_scale_drops=8))
    losses = [2.0 * 1.6 ** i for i in range(8)]          # 2 ... 53: a loss of 21 at step 5
    scale, results = 65536.0, []
    for i, loss in enumerate(losses):
        results.append(result(i, loss, scale=scale))
        scale /= 2
    alert = next(a for a in alerts_of(guard, results) if a.reason == "scale_drops")
    assert "diverges" in alert.cause and "fp16" in alert.cause
    assert "scale" not in alert.fix and "--init-scale" not in alert.fix
    assert "learning rate" in alert.fix


def test_a_level_loss_with_a_falling_scale_still_blames_the_scale():
    guard = PrecisionGuard(GuardConfig(alert_scale_drops=5))
    scale, results = 65536.0, []
    for i in range(8):
        results.append(result(i, 1.6e5 * (1 + 0.1 * (-1) ** i), scale=scale))  # skipped: level
        scale /= 2
    alert = next(a for a in alerts_of(guard, results) if a.reason == "scale_drops")
    assert "large loss" in alert.cause and "--init-scale" in alert.fix


def test_a_loss_that_grows_only_in_fp16_is_a_precision_problem():
    guard = PrecisionGuard(GuardConfig(alert_skip_share=0.25, alert_window=10))
    steady = [result(i, 1.0 + 0.05 * (i % 3), dtype="bfloat16", skipped=False, nonfinite=None)
              for i in range(12)]
    alerts_of(guard, steady)                              # bf16 trains fine
    growing = [result(12 + i, 2.0 * 1.6 ** i) for i in range(12)]
    alert = next(a for a in alerts_of(guard, growing) if a.reason == "skip_share")
    assert "diverges" not in alert.cause


def test_no_scaler_no_scale_blamed_and_no_fp16_range_in_fp32():
    guard = PrecisionGuard(GuardConfig(alert_skip_share=0.25, alert_window=10))
    results = [result(i, math.inf, dtype="float32", nonfinite="loss") for i in range(12)]
    alert = next(a for a in alerts_of(guard, results) if a.reason == "skip_share")
    assert "fp16" not in alert.cause and "scale" not in alert.fix
    assert "not a precision problem" in alert.cause


def run_alerts(script, tmp_path, dtype):
    run_dir = tmp_path / dtype
    main(["train", str(script), "--headless", "--steps", "30", "--dtype", dtype, "--run-dir", str(run_dir)])
    # The forecasts say what comes next (the scale's next growth, a layer's steps left), not
    # what caused a divergence: only the guards' alerts are judged here.
    return [e for e in read_session(run_dir).events if e["kind"] == "alert"
            and not e["reason"].startswith("forecast_")]


def test_a_model_that_diverges_in_fp16_and_fp32_gets_no_loss_scale_advice(write_script, tmp_path):
    script = write_script(DIVERGING_SCRIPT.replace("LR", "0.6"))
    for dtype in ("fp16", "fp32"):
        alerts = run_alerts(script, tmp_path, dtype)
        assert alerts, f"the diverging model raised no alert in {dtype}"
        for alert in alerts:
            assert "--init-scale" not in alert["fix"] and "large loss" not in alert["cause"], alert
            assert "diverges" in alert["cause"], alert
            if dtype == "fp32":
                assert "fp16" not in alert["message"], alert
