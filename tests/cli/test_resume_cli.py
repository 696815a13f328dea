"""--resume after a kill -9: what --steps means, what is said on screen, and one count of the
updates applied in the report and the end record."""

import json
import shutil
import signal
import subprocess
import sys

import pytest

from amp_tui.cli import main
from amp_tui.recording.reader import read_session
from amp_tui.training.checkpoint import list_checkpoints

# Kills itself with SIGKILL in the loss_fn call of step DIE_AT (`-- DIE_AT`; the pre-flight's
# forward is step 0's own), as `kill -9` would: wherever the run was, nothing after it is written.
SELF_KILLING_SCRIPT = '''
import os
import signal
import torch
from torch import nn

def setup(ctx):
    torch.manual_seed(0)
    die_at = int(ctx.argv[0]) if ctx.argv else None
    calls = [0]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    def loss_fn(m, b):
        if calls[0] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1
        return nn.functional.mse_loss(m(b[0]), b[1])
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3),
            "loss_fn": loss_fn, "batches": [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]}
'''


@pytest.fixture(scope="module")
def killed_template(tmp_path_factory):
    """Checkpoints at steps 4, 8 and 12; an intervention at 14 puts steps up to 13 on disk; then
    kill -9 in step 15: the recording goes past its newest checkpoint, as after a real crash."""
    folder = tmp_path_factory.mktemp("killed")
    script = folder / "train_script.py"
    script.write_text(SELF_KILLING_SCRIPT, encoding="utf-8")
    run_dir = folder / "run"
    proc = subprocess.run([sys.executable, "-m", "amp_tui", "train", str(script), "--headless",
                           "--run-dir", str(run_dir), "--checkpoint-every", "4", "--init-scale", "256",
                           "--at", "14:scale=half", "--", "15"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    s = read_session(run_dir)
    assert s.end is None and max(r["step"] for r in s.steps) >= 13
    assert [c.step for c in list_checkpoints(run_dir / "checkpoints")] == [12, 8, 4]
    return script, run_dir


@pytest.fixture
def killed_run(killed_template, tmp_path):
    """A copy of the killed run of its own for each test."""
    script, template = killed_template
    run_dir = tmp_path / "run"
    shutil.copytree(template, run_dir, ignore=shutil.ignore_patterns("control.*"))
    return script, run_dir


def resume(script, run_dir, *extra):
    return main(["train", str(script), "--headless", "--resume", str(run_dir), *extra])


def report_json(run_dir, capsys):
    capsys.readouterr()
    assert main(["report", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_steps_on_a_resume_counts_more_steps_and_says_so(killed_run, capsys):
    script, run_dir = killed_run
    last = max(r["step"] for r in read_session(run_dir).steps)
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    capsys.readouterr()
    assert resume(script, run_dir, "--steps", "4") == 0
    out = capsys.readouterr().out
    s = read_session(run_dir)
    assert [r["step"] for r in s.steps][-4:] == list(range(last + 1, last + 5))
    assert max(r["step"] for r in s.steps) == last + 4, "--steps 4 ran four more steps"
    resumed = [e for e in s.events if e["kind"] == "resumed"][-1]
    assert resumed["steps"] == 4 and resumed["until_step"] == last + 5
    assert resumed["checkpoint_step"] == newest.step
    assert resumed["rolled_back"] == last + 1 - newest.step
    # on screen: where it goes on, what --steps means here, and what was rolled back
    assert f"--steps 4 runs steps {last + 1}-{last + 4}" in out, out
    assert f"the {last + 1 - newest.step} recorded steps after it are rolled back" in out
    assert s.end["status"] == "finished" and s.end["step"] == last + 5


def test_report_and_end_record_count_the_same_updates_after_a_resume(killed_run, capsys):
    script, run_dir = killed_run
    assert resume(script, run_dir, "--steps", "4") == 0
    s = read_session(run_dir)
    data = report_json(run_dir, capsys)
    assert data["updates_applied"] == s.end["updates"]
    assert data["skipped"] == s.end["skipped_total"]
    resumed = [e for e in s.events if e["kind"] == "resumed"][-1]
    assert data["rolled_back"] == resumed["rolled_back"] > 0
    assert data["steps"] == len(s.steps) == data["updates_applied"] + data["skipped"] + data["rolled_back"]
    assert s.steps[-1]["updates"] == s.end["updates"]


def test_a_damaged_newest_checkpoint_is_named_with_its_reason(killed_run, capsys):
    script, run_dir = killed_run
    files = [c.path for c in list_checkpoints(run_dir / "checkpoints")]
    refused, unreadable = files[0], files[1]
    refused.write_bytes(refused.read_bytes()[:-100])   # torn tail: the header still reads
    unreadable.write_bytes(b"\x00\x01")                # not even a header
    capsys.readouterr()
    assert resume(script, run_dir, "--steps", "1") == 0
    out = capsys.readouterr().out
    for path in (refused, unreadable):
        line = next((text for text in out.splitlines() if "skipped" in text and path.name in text), None)
        assert line is not None and "warning" in line, out
    resumed = [e for e in read_session(run_dir).events if e["kind"] == "resumed"][-1]
    assert resumed["checkpoint_step"] == list_checkpoints(run_dir / "checkpoints")[0].step
    named = {entry["path"] for entry in resumed["skipped_checkpoints"]}
    assert named == {f"checkpoints/{refused.name}", f"checkpoints/{unreadable.name}"}
    assert all(entry["reason"] for entry in resumed["skipped_checkpoints"])


def test_a_restore_mid_run_brings_back_the_checkpoints_counts(mlp_script, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", str(mlp_script), "--headless", "--steps", "12", "--run-dir", str(run_dir),
                 "--at", "4:save", "--at", "10:restore=latest"]) == 0
    s = read_session(run_dir)
    assert s.steps[10]["updates"] + s.steps[10]["skipped_total"] == 5  # 4 from the checkpoint, then step 10
    data = report_json(run_dir, capsys)
    assert data["updates_applied"] == s.end["updates"] and data["skipped"] == s.end["skipped_total"]
    assert data["rolled_back"] == 6 and data["steps"] == 12
