"""`amp-tui run -- COMMAND` on the frameworks, headless: `python train_hf.py`, `accelerate launch
train.py` and `python train_lightning.py` record where amp-tui says with no change to the script
but its callback line (the monitor, in Accelerate's own loop); and the demos' overflow is fixed
by the dashboard's d, sent over the control socket as the dashboard sends it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amp_tui.core.jsonsafe import read_float
from amp_tui.job.steering.control import send
from amp_tui.recording.format import SessionFormatError
from amp_tui.recording.reader import read_session

from frameworks import ACCELERATE_SCRIPT, HF_SCRIPT, LIGHTNING_SCRIPT
from support import DEMOS, wait_for

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def amp_tui_run(tmp_path, *command: str, steps: int):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "amp_tui", "run", "--headless", "--run-dir", str(run_dir), "--",
                           *command], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "STEPS": str(steps)})
    return done, run_dir


@pytest.mark.parametrize("name, script, launcher", [
    ("train_hf.py", HF_SCRIPT, [sys.executable]),
    ("train.py", ACCELERATE_SCRIPT, [ACCELERATE, "launch", "--cpu", "--num_processes", "1",
                                     "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no"]),
    ("train_lightning.py", LIGHTNING_SCRIPT, [sys.executable]),
])
def test_amp_tui_run_records_a_framework_script_with_only_its_callback_line(write_script, tmp_path, name, script,
                                                                            launcher):
    path = write_script(script, name)
    done, run_dir = amp_tui_run(tmp_path, *launcher, str(path), steps=6)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    session = read_session(run_dir)
    assert len(session.steps) == 6 and session.end["status"] == "finished"
    assert {s["dtype"] for s in session.steps} == {"bfloat16"}
    assert "trained 6 steps" in (run_dir / "output.log").read_text() or "bf16 6 steps" in done.stdout


def steps_of(run_dir: Path) -> list[dict]:
    try:
        return read_session(run_dir).steps
    except (SessionFormatError, OSError):
        return []


@pytest.mark.parametrize("demo, flags, origin", [
    ("hf_trainer.py", ["--batch-size", "4"], "transformer.h.0.mlp.c_fc"),
    ("lightning_module.py", ["--batch-size", "16"], "amplifier"),
])
def test_a_demos_fp16_overflow_is_fixed_by_d_from_the_dashboard(tmp_path, demo, flags, origin):
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "amp_tui", "run", "--headless", "--run-dir", str(run_dir), "--",
                            sys.executable, str(DEMOS / demo), *flags], cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: len(steps_of(run_dir)) >= 2, 180), "the demo recorded no steps"
        assert all(s["skipped"] and s["nonfinite"] for s in steps_of(run_dir))
        assert send(run_dir, "dtype=bf16")["ok"]            # what d sends
        switched = [e["step"] for e in read_session(run_dir).events if e.get("action") == "dtype"][0]
        assert wait_for(lambda: len(steps_of(run_dir)) >= switched + 4, 180)
        assert send(run_dir, "stop")["ok"]
        assert job.wait(120) == 0
    finally:
        if job.poll() is None:
            job.kill()
    session = read_session(run_dir)
    after = session.steps[switched:]
    assert all(s["dtype"] == "bfloat16" and math.isfinite(read_float(s["loss"])) for s in after)
    assert [e for e in session.events if e["kind"] == "nonfinite"][0]["layer"] == origin
    assert session.end["status"] == "stopped"
