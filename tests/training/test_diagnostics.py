"""Where precision breaks and recovering from it: origin, underflow, ladder, guards, local fp32."""

import math

import pytest
import torch
from torch import nn

from amp_tui.cli import main
from amp_tui.training.step.engine import GuardedTrainer, StepResult
from amp_tui.training.step.guards import GuardConfig, PrecisionGuard
from amp_tui.training.trace.diagnose import diagnose

from support import strict_lines

PLANTED = '''
import torch
from torch import nn

class Planted(nn.Module):
    """`hot.0` overflows fp16 inside `hot`; the LayerNorm after it brings values back to ~1."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.hot = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32))
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            self.hot[0].weight.mul_(60000.0)
    def forward(self, x):
        return self.head(torch.relu(self.hot(torch.relu(self.embed(x)) + 1.0)))

def setup():
    torch.manual_seed(0)
    model = Planted()
    xs = torch.randn(64, 16)
    ys = torch.randn(64, 1)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
            "loss_fn": lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
            "batches": [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]}
'''


def run(script, tmp_path, *flags, name="run"):
    status = main(["train", str(script), "--headless", "--run-dir", str(tmp_path / name), *flags])
    lines = strict_lines(tmp_path / name / "session.jsonl")
    return status, lines


def events(lines, kind):
    return [r for r in lines if r.get("type") == "event" and r.get("kind") == kind]


def steps(lines):
    return [r for r in lines if r.get("type") == "step"]


def test_the_planted_layer_is_named_as_the_origin(write_script, tmp_path):
    script = write_script(PLANTED)
    _, lines = run(script, tmp_path, "--steps", "3", "--probe-every", "2")
    bad = events(lines, "nonfinite")
    assert len(bad) == 3  # probed or not, every bad step is diagnosed
    for e in bad:
        assert e["where"] == "loss" and e["origin"] == "hot.0" and e["origin_input_nonfinite"] is False
        assert e["layer"] == "hot.0" and "first non-finite output: hot.0" in e["message"]


def test_input_already_nonfinite_is_reported(write_script, tmp_path):
    script = write_script('''
import torch
from torch import nn
def setup():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.ones(2, 4)
    x[0, 0] = float("nan")           # bad data, not bad precision
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "loss_fn": lambda m, b: m(b).float().mean(), "batches": [x]}
''')
    _, lines = run(script, tmp_path, "--steps", "1")
    e = events(lines, "nonfinite")[0]
    # No module of the model made the NaN: none is named as where it began.
    assert e["origin"] is None and e["layer"] is None and e["origin_input_nonfinite"] is True
    assert "the model's input was already non-finite" in e["message"]
    assert "first non-finite output" not in e["message"]


class MadeInside(nn.Module):
    """An attention-like module whose own code (not a child) makes NaN, which its last child,
    `out`, is then handed: inf - inf, in fp32, whatever the CPU's fp16."""
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.q(x) * 1e30 * 1e30   # past fp32's max: inf
        return self.out(scores - scores)   # inf - inf = NaN, handed to `out`


def test_a_module_handed_a_nonfinite_input_is_never_the_origin():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), MadeInside(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.5)   # every input of the scores non-zero: all of them overflow
    found = diagnose(model, lambda: model(torch.ones(2, 4)).sum(), scale=None, device=torch.device("cpu"),
                     backward=False)
    # `1.out` is the first module to finish with a NaN output, but it was given the NaN.
    assert found.forward_layer == "1" and found.input_nonfinite is False


def test_gradient_overflow_names_a_module_in_backward_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                             lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), dtype="fp16",
                             init_scale=2.0**40)
    result = trainer.step([(torch.randn(16, 8), torch.full((16, 1), 300.0))])
    assert result.skipped and result.nonfinite == "gradients"
    # the head's gradient is computed first in backward order and already overflows
    assert result.diagnosis.backward_layer == "2" and result.first_nonfinite_layer == "2"


def test_fp32_modules_on_the_planted_layer_removes_the_nonfinite_steps(write_script, tmp_path):
    script = write_script(PLANTED)
    _, lines = run(script, tmp_path, "--steps", "4", "--fp32-modules", "hot", "--init-scale", "256")
    assert lines[0]["fp32_modules"] == ["hot"]
    assert not events(lines, "nonfinite")
    assert all(math.isfinite(s["loss"]) for s in steps(lines))


def test_fp32_module_pattern_that_matches_nothing_exits_2(write_script, tmp_path, capsys):
    script = write_script(PLANTED)
    assert main(["train", str(script), "--headless", "--fp32-modules", "blocks.*.attn",
                 "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--fp32-modules 'blocks.*.attn' matches no module" in err and "'embed'" in err
    assert not (tmp_path / "r").exists()


def test_fp32_toggle_at_a_step_is_an_intervention(write_script, tmp_path):
    script = write_script(PLANTED)
    _, lines = run(script, tmp_path, "--steps", "4", "--at", "2:fp32=hot", "--init-scale", "256")
    e = events(lines, "intervention")[0]
    assert e["step"] == 2 and e["before"]["fp32_modules"] == [] and e["after"]["fp32_modules"] == ["hot"]
    assert [s["nonfinite"] if "nonfinite" in s else None for s in steps(lines)] == ["loss", "loss", None, None]


def test_fallback_ladder_reaches_bf16_and_goes_on_finite(write_script, tmp_path):
    script = write_script(PLANTED)
    status, lines = run(script, tmp_path, "--steps", "6", "--on-nonfinite", "fallback", "--fallback-after", "2")
    assert status == 0
    moves = [e for e in events(lines, "intervention") if e["source"] == "fallback"]
    assert len(moves) == 1
    move = moves[0]
    assert move["step"] == 2 and move["before"]["dtype"] == "float16" and move["after"]["dtype"] == "bfloat16"
    assert "2 non-finite steps in a row" in move["reason"]
    after = [s for s in steps(lines) if s["step"] >= 2]
    assert all(s["dtype"] == "bfloat16" and math.isfinite(s["loss"]) for s in after)


def test_fallback_with_rollback_restores_the_newest_good_checkpoint(write_script, tmp_path):
    script = write_script(PLANTED.replace("self.hot[0].weight.mul_(60000.0)", "pass").replace(
        "def setup():", "def setup():\n    import builtins"))
    # healthy until step 3, then an --at scale far too high makes every update overflow
    _, lines = run(script, tmp_path, "--steps", "12", "--checkpoint-every", "2", "--on-nonfinite", "fallback",
                   "--storm-window", "4", "--storm-share", "0.75", "--fallback-after", "9", "--rollback",
                   "--at", "3:scale=1e30")
    restored = events(lines, "checkpoint_restored")
    assert restored and restored[0]["source"] == "fallback" and restored[0]["checkpoint_step"] <= 3
    move = [e for e in events(lines, "intervention") if e["source"] == "fallback"][0]
    assert "skip storm" in move["reason"]


def synthetic(step, *, scale, skipped, loss=1.0, nonfinite=None, dtype="float16", layer=None):
    return StepResult(step=step, loss=loss, scale=scale, skipped=skipped, skipped_total=0, updates_applied=0,
                      dtype=dtype, micro_batches=1, nonfinite=nonfinite, first_nonfinite_layer=layer)


def test_guard_alerts_name_cause_and_fix():
    guard = PrecisionGuard(GuardConfig(alert_scale_drops=3))
    scale, alerts = 8.0, []
    for step in range(12):  # a finite loss but the scale keeps halving: the bf16-pretrained story
        alerts += guard.observe(synthetic(step, scale=scale, skipped=True, nonfinite="gradients"),
                                scale / 2, True).alerts
        scale /= 2
    reasons = [a.reason for a in alerts]
    assert "scale_drops" in reasons and "scale_below_one" in reasons and "skip_share" in reasons
    below = next(a for a in alerts if a.reason == "scale_below_one")
    assert "bf16" in below.cause and "switch to bf16" in below.fix
    assert reasons.count("scale_drops") == 1, "an alert is raised once per streak"

    guard = PrecisionGuard(GuardConfig(alert_scale_drops=1))
    alert = guard.observe(synthetic(0, scale=65536.0, skipped=True, loss=1.6e5, nonfinite="gradients"),
                          32768.0, True).alerts[0]
    assert "large loss" in alert.cause and "lower the scale" in alert.fix

    guard = PrecisionGuard(GuardConfig(alert_skip_share=0.05, alert_window=10))
    for step in range(10):
        d = guard.observe(synthetic(step, scale=1024.0, skipped=True, loss=math.inf, nonfinite="loss",
                                    layer="blocks.0.attn"), 1024.0, True)
    alert = [a for a in d.alerts] or guard.observe(synthetic(10, scale=1024.0, skipped=True), 1024.0, True).alerts
    cause, fix = guard.likely_cause(synthetic(11, scale=1024.0, skipped=True, loss=math.inf, nonfinite="loss",
                                              layer="blocks.0.attn"))
    assert "blocks.0.attn" in cause and "--fp32-modules 'blocks.0.attn'" in fix


def test_min_scale_holds_and_says_so(write_script, tmp_path):
    script = write_script(PLANTED.replace("self.hot[0].weight.mul_(60000.0)", "pass"))
    _, lines = run(script, tmp_path, "--steps", "5", "--init-scale", "1e30", "--min-scale", "4e29")
    scales = [s["scale"] for s in steps(lines)]
    assert scales[:3] == pytest.approx([1e30, 5e29, 4e29], rel=1e-6)  # fp32 scale tensor
    assert min(scales) == pytest.approx(4e29, rel=1e-6)
    binds = [e for e in events(lines, "alert") if e["reason"] == "min_scale"]
    assert len(binds) == 1 and "reached its floor (4e+29, its min_scale)" in binds[0]["message"]


def test_underflow_shares_with_and_without_the_scale():
    torch.manual_seed(0)
    model = nn.Linear(64, 1)
    # gradients around 1e-9: all below 2**-24 unscaled, none once multiplied by 65536... mostly
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                             lambda m, b: m(b).float().mean() * 1e-9, dtype="fp16", init_scale=2.0**20)
    result = trainer.step([torch.rand(32, 64) + 0.5])
    f = result.figures
    assert f.underflow[0] == pytest.approx(1.0)
    assert f.underflow_scaled[0] == pytest.approx(0.0)
    r32 = GuardedTrainer(nn.Linear(4, 1), torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.0),
                         lambda m, b: m(b).mean(), dtype="fp32", probe=True)
    assert r32.probe is not None
