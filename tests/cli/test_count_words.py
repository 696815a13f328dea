"""Counts in words: one update is "1 update", in `ctl status`'s line and the replay's summary."""

from amp_tui.job.steering.control import status_text
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.timeline import timeline_lines

from support import write_run


def status(updates: int, skipped: int) -> dict:
    return {"state": "running", "step": updates + skipped, "steps": None, "dtype": "float16",
            "scale": 1024.0, "updates": updates, "skipped": skipped, "loss": 0.5}


def test_ctl_status_says_1_update_and_2_updates():
    assert "fp16, scale 1024, 1 update applied, 3 skipped, loss 0.5" in status_text(status(1, 3))
    assert "2 updates applied, 0 skipped" in status_text(status(2, 0))


def test_the_replays_summary_says_1_update(tmp_path):
    write_run(tmp_path / "session.jsonl", steps=4)   # steps 0-2 skipped, step 3 applied
    assert timeline_lines(SessionIndex(tmp_path))[-1].startswith(
        "summary: 4 steps, 1 update applied, 3 skipped in 1 run, ")
