"""`amp-tui ls`: runs in several folders or a glob, and a word about --run-dir when none show."""

import pytest

from amp_tui.cli import main


@pytest.fixture
def two_places(mlp_script, tmp_path):
    """One run in exp/a, one in exp/b (made with --run-dir), none under ./runs."""
    for name in ("a", "b"):
        assert main(["train", str(mlp_script), "--headless", "--steps", "1",
                     "--run-dir", str(tmp_path / "exp" / name / f"run-{name}")]) == 0
    return tmp_path / "exp"


def listed(capsys) -> str:
    return capsys.readouterr().out


def test_ls_lists_every_folder_named(two_places, capsys):
    capsys.readouterr()
    assert main(["ls", str(two_places / "a"), str(two_places / "b")]) == 0
    out = listed(capsys)
    assert "run-a" in out and "run-b" in out and "finished" in out


def test_ls_expands_a_quoted_glob_and_lists_a_run_once(two_places, capsys):
    capsys.readouterr()
    assert main(["ls", str(two_places / "*"), str(two_places / "a")]) == 0
    out = listed(capsys)
    assert out.count("run-a") == 1 and out.count("run-b") == 1, out


def test_ls_with_no_runs_under_runs_says_where_else_to_look(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for made in (False, True):          # no runs/ at all, then an empty one
        if made:
            (tmp_path / "runs").mkdir()
        assert main(["ls"]) == 0
        out = listed(capsys)
        assert "no runs under runs/" in out and "--run-dir" in out and "amp-tui ls DIR" in out, out


def test_ls_names_a_folder_or_glob_that_matches_nothing(two_places, capsys):
    capsys.readouterr()
    assert main(["ls", str(two_places / "a"), str(two_places / "nothing-*")]) == 1
    err = capsys.readouterr().err
    assert "nothing-*" in err and len(err.strip().splitlines()) == 1


def long_run(run_dir, steps: int, *, event_at: int):
    """A finished run of `steps` step records whose one event comes at step `event_at`."""
    from amp_tui.recording.format import event_record, step_record
    from amp_tui.recording.writer import SessionWriter

    from support import step_result

    run_dir.mkdir(parents=True)
    w = SessionWriter(run_dir / "session.jsonl", {"script": "long.py", "dtype": "float16", "steps": steps,
                                                  "device": {"type": "cpu", "backend": "CPU", "name": "Test"}},
                      flush_interval=0)
    for step in range(steps):
        if step == event_at:
            w.write(event_record(step, "note", "the one event of this run", text="the one event of this run",
                                 source="at"))
        w.write(step_record(step_result(step)))
    w.write({"type": "end", "step": steps, "status": "finished", "updates": steps, "skipped_total": 0})
    w.close()
    return run_dir


@pytest.mark.parametrize("event_at", [3, 2995])
def test_ls_shows_the_last_event_however_far_behind_the_end_it_lies(tmp_path, capsys, event_at):
    from amp_tui.recording.listing import TAIL_BYTES, describe_run

    run_dir = long_run(tmp_path / "runs" / "long", 3000, event_at=event_at)
    size = (run_dir / "session.jsonl").stat().st_size
    if event_at == 3:   # the case that was blank: the event lies far before the file's tail
        assert size > 2 * TAIL_BYTES
    row = describe_run(run_dir, lambda _: False)
    assert row.last_event == f"step {event_at}: note: the one event of this run"
    assert (row.state, row.steps, row.skipped) == ("finished", 3000, 0)
    assert main(["ls", str(tmp_path / "runs")]) == 0
    assert f"step {event_at}: note: the one event" in listed(capsys)
