"""Rank 0's commands as every other rank decodes them at a step boundary: the command code and
the payload, carried through the bytes of the broadcast that sends it (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from amp_tui.core.commands import ACTIONS, Command
from amp_tui.job.ranks.command_codec import MANY, decode_commands, encode_commands


def across_ranks(commands: list[Command]) -> list[Command]:
    """What another rank applies: the payload goes as a uint8 tensor, as the boundary's broadcast
    sends it, and is decoded from its bytes."""
    code, payload = encode_commands(commands)
    sent = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    return decode_commands(code, bytes(sent.tolist()))


NOTES = [
    "changed the data shard",
    "",
    "lr 3e-4 → 1e-4, données mélangées, 学習率を下げた, 🚀🔥",
    'a "quoted" path C:\\runs\\a\nsecond line\ttab',
    '["pause", null]',          # text that is JSON itself
    "\x00 NUL and \x7f DEL",
    "\ud800 a lone surrogate",  # not valid UTF-8 on its own: json's escapes carry it
    "x" * 100_000,
]


@pytest.mark.parametrize("text", NOTES, ids=range(len(NOTES)))
def test_a_note_with_any_text_reaches_every_rank_as_written(text):
    decoded = across_ranks([Command("note", text, "ctl")])
    assert [(c.action, c.value, c.source) for c in decoded] == [("note", text, "rank 0")]


def test_a_note_goes_in_the_payload_among_other_commands():
    commands = [Command("pause", None, "at"), Command("note", "shard 3 of 8 from here", "ctl"),
                Command("restore", "runs/a b/ckpt-ü.pt", "ctl"), Command("scale", 4096.0, "ctl")]
    code, payload = encode_commands(commands)
    assert code == MANY and payload
    assert [(c.action, c.value) for c in across_ranks(commands)] == [(c.action, c.value) for c in commands]


def test_an_action_without_a_code_of_its_own_still_goes_through():
    assert "nonesuch" not in ACTIONS
    assert [(c.action, c.value) for c in across_ranks([Command("nonesuch", None)])] == [("nonesuch", None)]


def test_one_command_without_a_value_is_its_code_alone():
    for action in ACTIONS:
        code, payload = encode_commands([Command(action, None)])
        assert 0 < code < MANY and payload == b""
        assert [(c.action, c.value) for c in decode_commands(code, payload)] == [(action, None)]
    assert encode_commands([]) == (0, b"") and decode_commands(0, b"") == []
