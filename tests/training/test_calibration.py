"""GradScaler's calibration skips at the start: recorded as such, not as non-finite steps, with
no op replay and no escalation of the probes, in `amp-tui train` and in a monitored loop; a 5th
skip in a row is trouble again.

The cases decide the arithmetic with margins, on any CPU: the loss is the model's output summed
times K, so the gradient that reaches the fp16 backward is K × the scale, with one sample whose
inputs are at most 0.5. With K = 3 it overflows at 65536 and 32768 (1.5× fp16's max or more) and
fits at 16384 (0.75×): two skips. With K = 100 it fits from 512 down (0.78×): seven skips.
"""

import math

import torch
from torch import nn

import amp_tui
from amp_tui.cli import main
from amp_tui.recording.report import read_digest, summarize, summary_lines
from amp_tui.training.step.calibration import CALIBRATION_SKIPS, ScaleCalibration

from support import strict_lines

SCRIPT = '''
import torch
from torch import nn

K = {k}

def setup():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x = torch.rand(1, 8) * 0.5
    return {{"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": lambda m, b: m(b).float().sum() * K, "batches": [x]}}
'''


def train(write_script, tmp_path, k: float, steps: int = 20):
    script = write_script(SCRIPT.format(k=k))
    assert main(["train", str(script), "--headless", "--run-dir", str(tmp_path / "run"), "--steps", str(steps)]) == 0
    return strict_lines(tmp_path / "run" / "session.jsonl")


def kinds(lines, kind):
    return [r for r in lines if r.get("type") == "event" and r.get("kind") == kind]


def test_the_first_skips_are_calibration_and_nothing_escalates(write_script, tmp_path):
    lines = train(write_script, tmp_path, 3)
    steps = [r for r in lines if r["type"] == "step"]
    assert [r["skipped"] for r in steps[:3]] == [True, True, False] and not any(r["skipped"] for r in steps[2:])
    assert [r.get("calibration") for r in steps[:3]] == [True, True, None]
    assert not any("nonfinite" in r for r in steps)
    said = kinds(lines, "calibration")
    assert [(e["step"], e["scale"], e["next_scale"]) for e in said] == [(0, 65536, 32768), (1, 32768, 16384)]
    assert "GradScaler calibrating its scale" in said[0]["message"]
    assert kinds(lines, "nonfinite") == []                       # no op replay, no non-finite event
    assert [e for e in kinds(lines, "probes") if e["mode"] == "every"] == []   # no escalation
    assert not [e for e in kinds(lines, "alert") if e["reason"] in ("skip_share", "scale_drops")]
    summary = summarize(read_digest(tmp_path / "run"))
    assert (summary.skipped, summary.calibration_skips, summary.nonfinite_events) == (2, 2, 0)
    rows = dict(summary_lines(summary))
    assert rows["skipped"] == "2 (2 GradScaler calibrating its scale at the start)"


def test_a_fifth_skip_in_a_row_is_trouble_again(write_script, tmp_path):
    lines = train(write_script, tmp_path, 100)
    steps = [r for r in lines if r["type"] == "step"]
    assert [r["skipped"] for r in steps[:8]] == [True] * 7 + [False]
    assert [r["step"] for r in steps if r.get("calibration")] == list(range(CALIBRATION_SKIPS))
    bad = kinds(lines, "nonfinite")
    assert [e["step"] for e in bad] == [4, 5, 6]
    assert bad[0].get("op")                                      # the 5th is replayed op by op
    [drops] = [e for e in kinds(lines, "alert") if e["reason"] == "scale_drops"]
    assert drops["step"] == 4 and "fell 5 times in a row" in drops["message"]
    assert [e["reason"] for e in kinds(lines, "probes") if e["mode"] == "every"] == ["skip"]


def test_a_monitored_loop_shows_its_gradscalers_calibration(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.rand(1, 8) * 0.5
    monitor = amp_tui.monitor(model, optimizer, scaler=scaler, run_dir=tmp_path / "run", control=False,
                              announce=False)
    for _ in range(12):
        optimizer.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(x).float().sum() * 3
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    monitor.close()
    lines = strict_lines(tmp_path / "run" / "session.jsonl")
    assert [e["step"] for e in kinds(lines, "calibration")] == [0, 1]
    assert kinds(lines, "nonfinite") == []
    assert [e for e in kinds(lines, "probes") if e["mode"] == "every"] == []
    assert scaler.get_scale() == 16384.0 and all(math.isfinite(p.sum().item()) for p in model.parameters())


def test_calibration_ends_at_the_first_step_that_is_anything_else():
    calibration = ScaleCalibration()
    assert calibration.judge(skipped=True, gradients_only=True, scale=65536.0)
    assert not calibration.judge(skipped=False, gradients_only=False, scale=65536.0)   # an update applied
    assert not calibration.judge(skipped=True, gradients_only=True, scale=65536.0)     # over for good
    loss = ScaleCalibration()
    assert not loss.judge(skipped=True, gradients_only=False, scale=65536.0)           # a non-finite loss
    unscaled = ScaleCalibration()
    assert not unscaled.judge(skipped=True, gradients_only=True, scale=None)       # no GradScaler
    resumed = ScaleCalibration()
    resumed.end()                                                                   # a checkpoint's scale
    assert not resumed.judge(skipped=True, gradients_only=True, scale=65536.0)
    chosen = ScaleCalibration()                                                     # a start someone set above
    assert not chosen.judge(skipped=True, gradients_only=True, scale=2.0 ** 24)     # GradScaler's default
    limited = ScaleCalibration()
    assert [limited.judge(skipped=True, gradients_only=True, scale=65536.0) for _ in range(6)] == \
        [True] * CALIBRATION_SKIPS + [False, False]
