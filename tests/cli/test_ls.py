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
