"""A real full disk: `amp-tui train --headless` with its run dir on a tiny tmpfs.

Nothing is injected: the run writes until the kernel answers ENOSPC, once while saving a
checkpoint and once while appending to the session. The tmpfs is mounted in a private mount
namespace (`unshare --mount`, as root or in a user namespace), so nothing outside the test sees
it; the run dir is copied out before the namespace, and the tmpfs with it, goes away. Skipped,
with the reason, where mounting is not permitted (many containers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from amp_tui.recording.reader import read_session
from amp_tui.training.checkpoint import list_checkpoints

from support import REPO, restorable

pytestmark = pytest.mark.slow

# About 109 KB a checkpoint (Adam: weights and two moments).
SCRIPT = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    xs = torch.randn(64, 64)
    batches = [(xs[i:i + 16], xs[i:i + 16].sum(1, keepdim=True)) for i in range(0, 64, 16)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3),
            "loss_fn": loss_fn, "batches": batches}
'''

# Runs in the namespace: mount, train until the disk is full, copy the run dir out.
IN_NAMESPACE = '''
mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 90
out=$3
shift 3
"$@" > "$out/stdout" 2> "$out/stderr"
echo $? > "$out/status"
cp -a "$MNT_RUN" "$out/run"
'''


def _private_mount_prefix() -> tuple[list[str] | None, str]:
    """A command prefix under which `mount -t tmpfs` works and is seen by nothing else, or None
    and why not. A probe that does not answer is no reason to skip (a loaded machine is slow, not
    unable to mount): it fails the tests, after a deadline only a hang reaches."""
    if not sys.platform.startswith("linux"):
        return None, "a tmpfs mount needs Linux"
    unshare = shutil.which("unshare")
    if unshare is None:
        return None, "no unshare command (util-linux)"
    why = ""
    for prefix in ([unshare, "--mount", "--propagation", "private"],
                   [unshare, "--mount", "--propagation", "private", "--map-root-user"]):
        with tempfile.TemporaryDirectory() as folder:
            try:
                probe = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                        folder], capture_output=True, text=True, timeout=300)
            except OSError as exc:
                why = str(exc)
                continue
            if probe.returncode == 0:
                return prefix, ""
            why = probe.stderr.strip() or f"exit status {probe.returncode}"
    return None, f"cannot mount a tmpfs in a private mount namespace here ({why})"


@pytest.fixture(scope="module")
def private_mount():
    prefix, why = _private_mount_prefix()
    if prefix is None:
        pytest.skip(why)
    return prefix


def train_on_a_full_disk(prefix, tmp_path, size: str, *options: str, script: Path | None = None,
                         steps: int = 1000):
    """Run the real CLI headless with its run dir on a tmpfs of `size`; return (status, stdout,
    stderr, the run dir as it was on the tmpfs, the script)."""
    if script is None:
        script = tmp_path / "train_script.py"
        script.write_text(SCRIPT, encoding="utf-8")
    mount_point, out = tmp_path / "tmpfs", tmp_path / "out"
    mount_point.mkdir()
    out.mkdir()
    command = [sys.executable, "-m", "amp_tui", "train", str(script), "--headless", "--device",
               "cpu", "--run-dir", str(mount_point / "run"), "--init-scale", "256",
               "--steps", str(steps), *options]
    done = subprocess.run([*prefix, "sh", "-c", IN_NAMESPACE, "sh", size, str(mount_point),
                           str(out), *command], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "MNT_RUN": str(mount_point / "run")})
    assert done.returncode == 0, f"the namespace script failed: {done.stderr}"
    status = int((out / "status").read_text())
    return (status, (out / "stdout").read_text(), (out / "stderr").read_text(), out / "run",
            script)


def assert_nothing_lost(run_dir: Path, script: Path, *, newest_step: int):
    session = read_session(run_dir)
    steps = [r["step"] for r in session.steps]
    assert steps == list(range(len(steps))) and steps      # every flushed step, in order
    assert session.skipped_lines <= 1                      # at most a torn last line
    found = list_checkpoints(run_dir / "checkpoints")
    assert found and found[0].step == newest_step
    assert restorable(found[0].path, script).step == newest_step   # digests and shapes check out
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []                                 # no partial checkpoint left behind
    return session


def test_a_checkpoint_that_does_not_fit_stops_headless_and_keeps_the_previous_one(
        private_mount, tmp_path):
    # 400 KB: three checkpoints fit, the fourth (at step 20) does not
    status, out, err, run_dir, script = train_on_a_full_disk(
        private_mount, tmp_path, "400k", "--checkpoint-every", "5")
    assert status == 1, (out, err)
    assert "No space left on device" in out and "Traceback" not in err
    session = assert_nothing_lost(run_dir, script, newest_step=15)
    errors = [e for e in session.events if e["kind"] == "error"]
    assert [e["during"] for e in errors] == ["save"] and "No space left" in errors[0]["message"]
    assert errors[0]["step"] == 20 and len(session.steps) == 20   # it stopped right there
    assert session.end is not None and session.end["exit_status"] == 1


def test_a_session_that_does_not_fit_stops_headless_and_keeps_what_was_flushed(
        private_mount, tmp_path):
    # 160 KB: one checkpoint at step 3, then the session grows until the disk is full
    status, out, err, run_dir, script = train_on_a_full_disk(
        private_mount, tmp_path, "160k", "--at", "3:save")
    assert status == 1, (out, err)
    # Mid-run ("could not append to") or at the last flush, as the machine's speed has it:
    # either way the full disk and the file are named.
    text = " ".join(out.split())
    assert "No space left on device" in text and "session.jsonl" in text
    assert "could not append to" in text or "could not be written" in text
    assert "Traceback" not in err
    session = assert_nothing_lost(run_dir, script, newest_step=3)
    assert len(session.steps) > 20
    assert session.end is None        # the end record could not be written either


# Runs in the namespace: a session on a tmpfs that fills up, then gets room again.
WRITER_ON_A_FILLING_DISK = '''
import json, os, sys
from amp_tui.recording.writer import SessionWriter
folder, out = sys.argv[1], sys.argv[2]
writer = SessionWriter(os.path.join(folder, "session.jsonl"), {"layers": []})
record = lambda i: {"type": "event", "step": i, "kind": "x", "message": "m" * 1000}
writer.write(record(0))
with open(os.path.join(folder, "filler"), "wb", buffering=0) as filler:   # take every free byte
    try:
        while True:
            filler.write(b"f" * 4096)
    except OSError:
        pass
failures = []
for i in range(1, 21):
    try:
        writer.write(record(i))
    except OSError as exc:
        failures.append(exc.strerror)
pending = writer.pending_bytes
os.remove(os.path.join(folder, "filler"))                  # space is freed
writer.write(record(21))
writer.close({"step": 22})
json.dump({"failures": failures, "pending": pending}, open(os.path.join(out, "result.json"), "w"))
os.system(f"cp {folder}/session.jsonl {out}/")
'''


def test_a_session_on_a_full_disk_keeps_every_record_for_when_space_is_freed(private_mount, tmp_path):
    """Real ENOSPC from the kernel: the writes refused while the disk is full stay pending, and
    once a file is deleted they reach the session whole and in order, with no torn line."""
    mount_point, out = tmp_path / "tmpfs", tmp_path / "out"
    mount_point.mkdir()
    out.mkdir()
    code = f'mount -t tmpfs -o size=64k tmpfs "$1" || exit 90; "{sys.executable}" -c "$2" "$1" "$3"'
    done = subprocess.run([*private_mount, "sh", "-c", code, "sh", str(mount_point),
                           WRITER_ON_A_FILLING_DISK, str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["failures"] and set(result["failures"]) == {"No space left on device"}
    assert result["pending"] > 0
    s = read_session(out / "session.jsonl")
    assert [e["step"] for e in s.events] == list(range(22)) and s.skipped_lines == 0
    assert s.end == {"type": "end", "step": 22}


def test_a_disk_that_fills_before_the_end_record_exits_1_and_counts_what_was_lost(
        private_mount, tmp_path):
    """A tmpfs too small for the whole recording (12 KiB): wherever the disk fills, before the
    end or at the last flush (that depends on the machine's speed), the run says the disk is
    full, names the file, counts the records it could not write and exits 1; what is on disk is
    whole lines, every step in order."""
    status, out, err, run_dir, _ = train_on_a_full_disk(
        private_mount, tmp_path, "12k", script=REPO / "demos" / "healthy.py", steps=40)
    text = " ".join(out.split())        # Rich folds long lines at the terminal's width
    assert status == 1, (out, err)
    assert "Traceback" not in err
    assert "No space left on device" in text and "session.jsonl" in text
    session = read_session(run_dir)
    recorded = [r["step"] for r in session.steps]
    assert recorded == list(range(len(recorded))) and session.skipped_lines == 0   # none torn
    assert session.end is None
    ran = int(re.search(r"\(the run, after (\d+) steps\)", text).group(1))
    lost = int(re.search(r"(\d+) step records?", text).group(1))
    assert ran > len(recorded) and lost == ran - len(recorded)      # counted, not silently gone
    assert "the end record could not be written" in text
    assert f"steps {len(recorded)} recorded of {ran}" in text


# Runs in the namespace: the dashboard (Pilot) on a run whose tmpfs a filler file takes over
# after the header; the end record can't be written until the filler is deleted.
DASHBOARD_ON_A_FILLING_DISK = '''
import asyncio, json, os, sys
sys.path.insert(0, sys.argv[3])
from support import build_live, toasts, until
from amp_tui.ui.app import create_app
folder, out, _, script = sys.argv[1:5]
# every step record waits for the end: the last flush (probes every 10 steps: the adaptive
# schedule's events would be written at once, on the full disk, before the end)
run, source = build_live(script, os.path.join(folder, "run"), steps=30, init_scale=256.0, flush_interval=3600.0,
                         probe_every=10)
filler_path = os.path.join(folder, "filler")

def fill(record):
    if record.get("type") == "step" and record["step"] == 5:
        with open(filler_path, "wb", buffering=0) as filler:    # take every free byte
            try:
                while True:
                    filler.write(b"f" * 4096)
            except OSError:
                pass
run.observers.append(fill)

async def main():
    app = create_app(source)
    result = {}
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await until(pilot, lambda: source.snapshot().state == "paused", "the pause", timeout=60)
        await until(pilot, lambda: "No space left on device" in toasts(app), "the notice")
        result["paused_at"] = run.step
        result["pending"] = run.controller.pending_records()
        os.remove(filler_path)                                   # space is freed
        await pilot.press("space")
        await until(pilot, lambda: not source.alive, "the run to end", timeout=60)
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    result["exit_status"] = run.exit_status
    result["unwritten"] = run.unwritten
    json.dump(result, open(os.path.join(out, "result.json"), "w"))
    os.system(f"cp {folder}/run/session.jsonl {out}/")

asyncio.run(main())
'''


def test_the_dashboard_on_a_disk_full_at_the_end_pauses_and_writes_everything_once_freed(
        private_mount, tmp_path):
    mount_point, out = tmp_path / "tmpfs", tmp_path / "out"
    mount_point.mkdir()
    out.mkdir()
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    code = (f'mount -t tmpfs -o size=256k tmpfs "$1" || exit 90; '
            f'"{sys.executable}" -c "$2" "$1" "$3" "$4" "$5"')
    done = subprocess.run([*private_mount, "sh", "-c", code, "sh", str(mount_point),
                           DASHBOARD_ON_A_FILLING_DISK, str(out), str(REPO / "tests"), str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["paused_at"] == 30                     # trained every step, then held
    assert result["pending"]["step"] > 0 and result["pending"]["end"] == 1
    assert result["unwritten"] == {} and result["exit_status"] == 0
    session = read_session(out / "session.jsonl")
    assert [r["step"] for r in session.steps] == list(range(30)) and session.skipped_lines == 0
    assert session.end is not None and session.end["status"] == "finished"
