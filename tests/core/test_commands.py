"""Commands as they are written: `--at STEP:ACTION`, `amp-tui ctl RUN ACTION`, and the note's text."""

from __future__ import annotations

import pytest

from amp_tui.cli import main
from amp_tui.core.commands import (
    ACTIONS,
    NOTE_LIMIT,
    Action,
    Command,
    CommandError,
    Outcome,
    parse_action,
    parse_at,
)
from amp_tui.job.ranks.distributed import decode_commands, encode_commands
from amp_tui.job.steering.control import ControlServer

NOTES = ["changed the data shard", "lr=3e-4, warmup: 200 steps", "a:b=c:d", "données → ✓ 学习率",
         "x" * NOTE_LIMIT]


def test_every_action_is_listed_once_in_the_type_and_the_tuple():
    assert len(set(ACTIONS)) == len(ACTIONS) and "note" in ACTIONS
    assert ACTIONS[:9] == ("dtype", "scale", "save", "restore", "pause", "resume", "step", "stop", "fp32")
    assert Action.__args__ == ACTIONS


@pytest.mark.parametrize("text", NOTES)
def test_a_note_keeps_its_text_whole(text):
    command = parse_action(f"note={text}", source="ctl")
    assert (command.action, command.value, command.source) == ("note", text, "ctl")
    # what an attached dashboard sends over the socket reads back the same
    assert parse_action(command.text(), source="ctl") == command
    step, at = parse_at(f"5:note={text}")
    assert (step, at.action, at.value, at.source) == (5, "note", text, "at")


def test_a_note_loses_only_its_surrounding_blanks():
    assert parse_action("  note =  two  spaces inside  ").value == "two  spaces inside"
    assert parse_action("NOTE=Upper").value == "Upper"


@pytest.mark.parametrize("text, problem", [
    ("note", "the text is empty"),
    ("note=", "the text is empty"),
    ("note=   ", "the text is empty"),
    ("note=" + "x" * (NOTE_LIMIT + 1), f"at most {NOTE_LIMIT}"),
    ("note=two\nlines", "one line of text"),
    ("note=\x1b[2Jclear", "one line of text"),
])
def test_a_note_that_cant_be_recorded_is_refused_with_what_to_change(text, problem):
    with pytest.raises(CommandError, match=problem):
        parse_action(text)
    with pytest.raises(CommandError, match=problem):
        parse_at(f"3:{text}")


def test_an_unknown_action_names_note_among_the_accepted_ones():
    with pytest.raises(CommandError, match="note=TEXT"):
        parse_action("annotate=x")


def test_rank_0_hands_a_note_to_the_other_ranks_whole():
    commands = [Command("note", NOTES[3], "ctl"), Command("pause", None, "ctl")]
    code, payload = encode_commands(commands)
    assert [(c.action, c.value) for c in decode_commands(code, payload)] == \
        [("note", NOTES[3]), ("pause", None)]


class _NoteTaker:
    """Stands in for a run: applies each command at once and keeps it."""

    def __init__(self):
        self.applied: list[Command] = []

    def submit(self, command: Command) -> None:
        self.applied.append(command)
        command.on_done(Outcome(True, f"note: {command.value}"))


def test_ctl_sends_a_note_whole_and_refuses_an_empty_one(tmp_path, capsys):
    run = _NoteTaker()
    server = ControlServer(run, tmp_path)
    server.start()
    try:
        assert main(["ctl", str(tmp_path), "note=changed the data shard: lr=1e-4"]) == 0
        assert capsys.readouterr().out.strip() == "note: changed the data shard: lr=1e-4"
        assert main(["ctl", str(tmp_path), "note="]) == 1
        assert "the text is empty" in capsys.readouterr().out
    finally:
        server.close()
    assert [(c.action, c.value) for c in run.applied] == [("note", "changed the data shard: lr=1e-4")]
    assert run.applied[0].source.startswith("ctl pid=")
