"""Rank 0's commands, as every rank receives them at a step boundary: a command code that rides in
the boundary's words, and a payload (rank 0's broadcast, sent only when there is one).

One command without a value, the common case (pause, resume, save, stop), is its code alone; any
other list, whatever its actions and values (a text value such as restore=PATH or a note's
included, and an action that ACTIONS doesn't name), is JSON in the payload. The code indexes
core's ACTIONS, which is the same on every rank."""

from __future__ import annotations

import json

from amp_tui.core.commands import ACTIONS, Command

MANY = 1 + len(ACTIONS)     # the command code of a payload holding a list of commands


def encode_commands(commands: list[Command]) -> tuple[int, bytes]:
    """A command code, and the payload: none for one command without a value, else the list."""
    if not commands:
        return 0, b""
    if len(commands) == 1 and commands[0].value is None and commands[0].action in ACTIONS:
        return 1 + ACTIONS.index(commands[0].action), b""
    # json's escapes (ensure_ascii) keep any text as it was, a lone surrogate included.
    return MANY, json.dumps([[c.action, c.value] for c in commands]).encode("utf-8")


def decode_commands(code: int, payload: bytes) -> list[Command]:
    source = "rank 0"
    if code == 0:
        return []
    if code != MANY:
        return [Command(ACTIONS[code - 1], None, source)]
    return [Command(action, value, source) for action, value in json.loads(payload.decode("utf-8"))]
