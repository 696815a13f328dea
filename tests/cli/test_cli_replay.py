"""The replay-side CLI: replay --headless, report --as-at, train --repeat-interventions."""

import json

from amp_tui.cli import main
from amp_tui.recording.reader import read_session


def test_timeline_as_at_and_repeat(mlp_script, tmp_path, capsys):
    first = tmp_path / "first"
    assert main(["train", str(mlp_script), "--headless", "--steps", "8", "--run-dir", str(first),
                 "--at", "2:scale=1024", "--at", "4:dtype=bf16", "--at", "5:save"]) == 0
    capsys.readouterr()
    assert main(["replay", str(first), "--headless"]) == 0
    timeline = capsys.readouterr().out
    assert "step 2: intervention: loss scale 16384 → 1024 [at]" in timeline  # after 2 calibration skips
    assert "step 4: intervention: dtype fp16 → bf16 [at]" in timeline
    assert main(["report", str(first), "--as-at"]) == 0
    assert capsys.readouterr().out.strip() == "--at 2:scale=1024 --at 4:dtype=bf16 --at 5:save"
    assert main(["report", str(first), "--as-at", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == ["2:scale=1024", "4:dtype=bf16", "5:save"]

    second = tmp_path / "second"
    assert main(["train", str(mlp_script), "--headless", "--steps", "8", "--run-dir", str(second),
                 "--repeat-interventions", str(first)]) == 0
    a = [(e["step"], e["action"], e.get("after")) for e in read_session(first).events if e["kind"] == "intervention"]
    b = [(e["step"], e["action"], e.get("after")) for e in read_session(second).events if e["kind"] == "intervention"]
    assert [x[:2] for x in a] == [x[:2] for x in b]
    assert all(e["source"] == "repeat" for e in read_session(second).events if e["kind"] == "intervention")


def test_replay_errors_are_one_line(tmp_path, capsys):
    """A path that names no session is the command line's mistake (2); a session this version
    can't read is a file that can't be read (1), as a damaged one is."""
    assert main(["replay", str(tmp_path / "missing"), "--headless"]) == 2
    assert capsys.readouterr().err.strip().startswith("amp-tui: error: no session found")
    newer = tmp_path / "session.jsonl"
    newer.write_text('{"type":"header","format":"amp-tui-session","version":7}\n')
    assert main(["replay", str(newer), "--headless"]) == 1
    assert "newer amp-tui" in capsys.readouterr().err
    assert main(["train", "x.py", "--headless", "--repeat-interventions", str(tmp_path / "nope")]) == 2
