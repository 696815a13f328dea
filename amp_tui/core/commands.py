"""Commands that steer a run: what they are, how they are written (`--at`, `ctl`) and parsed.

A run applies them at its next step boundary (amp_tui.job.steering.commands), so a command never lands in
the middle of a forward or backward pass.
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field
from typing import Callable, Literal, get_args

from amp_tui.core import precision
from amp_tui.core.jsonsafe import encode_float

# Every command a run applies. `status` (ctl) is not one: the control socket answers it without
# the run. The order is part of how rank 0 hands a command to the other ranks (its index is the
# command's code): add new actions at the end.
Action = Literal["dtype", "scale", "save", "restore", "pause", "resume", "step", "stop", "fp32", "note",
                 "probe", "xray", "undo", "fix", "fp8"]
PROBE_MODES = ("every", "auto")
ACTIONS: tuple[Action, ...] = get_args(Action)
NO_VALUE_ACTIONS: tuple[Action, ...] = ("save", "pause", "resume", "step", "stop", "xray", "undo", "fix", "fp8")
# A note is a line for whoever reads the recording later, not a document.
NOTE_LIMIT = 500


class CommandError(ValueError):
    """A command that can't be parsed; the message says what is accepted."""


@dataclass
class Outcome:
    ok: bool
    message: str


@dataclass
class Command:
    action: Action
    value: str | float | None = None
    source: str = "api"
    # Who sent it over the control socket ({"pid", "uid", "user"}), recorded with the event.
    client: dict | None = field(default=None, compare=False)
    # Called on the training thread once the command was applied or refused.
    on_done: Callable[[Outcome], None] | None = field(default=None, repr=False, compare=False)

    def text(self) -> str:
        if self.value is None:
            return self.action
        if self.action == "dtype":
            return f"dtype={precision.SHORT.get(self.value, self.value)}"
        if isinstance(self.value, float):
            return f"{self.action}={self.value:g}"
        return f"{self.action}={self.value}"

    def record_fields(self) -> dict:
        """What an event about this command records of it: its value, its source and its sender."""
        value = encode_float(self.value) if isinstance(self.value, float) else self.value
        return {"value": value, "source": self.source, **({"client": self.client} if self.client else {})}


def parse_action(text: str, source: str = "api") -> Command:
    """`dtype=bf16`, `scale=4096`, `scale=half`, `save`, `restore=latest|PATH`, `pause`, `resume`,
    `step`, `stop`, `fp32=MODULE_PATTERN` (toggles local fp32), `note=TEXT` (recorded as it is),
    `probe=every|auto` (every step probed, or the probe schedule), `xray` (the next step traced op
    by op), `undo` (the autopilot's last decision taken back), `fix` (the run's last verified fix
    applied: `f` in the dashboard), `fp8` (the next step's fp8 what-if)."""
    raw = text.strip()
    name, _, value = raw.partition("=")
    name = name.strip().lower()
    value = value.strip()
    if name == "dtype":
        try:
            return Command("dtype", precision.canonical(value), source)
        except ValueError:
            raise CommandError(f"unknown dtype in {raw!r}: use dtype=fp16, dtype=bf16, dtype=fp32 "
                               "or dtype=fp8") from None
    if name == "scale":
        if value.lower() == "half":
            return Command("scale", "half", source)
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number > 0):
            raise CommandError(f"bad scale in {raw!r}: use scale=half or a positive number like scale=4096")
        return Command("scale", number, source)
    if name == "restore":
        return Command("restore", value or "latest", source)
    if name == "fp32":
        if not value:
            raise CommandError(f"{raw!r}: name the module(s), e.g. fp32=blocks.0.attn or fp32='*.attn'")
        return Command("fp32", value, source)
    if name == "note":
        return Command("note", note_text(value), source)
    if name == "probe":
        if value.lower() not in PROBE_MODES:
            raise CommandError(f"{raw!r}: use probe=every (every step probed) or probe=auto (the schedule)")
        return Command("probe", value.lower(), source)
    if name in NO_VALUE_ACTIONS:
        if value:
            raise CommandError(f"{name!r} takes no value (got {raw!r})")
        return Command(name, None, source)
    raise CommandError(f"unknown action {raw!r}: use dtype=…, scale=…, save, restore=…, pause, "
                       "resume, step, stop, fp32=MODULE, note=TEXT, probe=every|auto, xray, undo, fix or fp8")


def note_text(text: str) -> str:
    """A note's text as recorded: whole (`=`, `:`, any script), without surrounding blanks; one
    line of at most NOTE_LIMIT characters, else CommandError says what to change."""
    note = text.strip()
    if not note:
        raise CommandError("note: the text is empty: write it after the =, e.g. note='changed the data shard'")
    if len(note) > NOTE_LIMIT:
        raise CommandError(f"note: {len(note)} characters is too long: a note holds at most {NOTE_LIMIT}")
    # A control character (a newline, an escape sequence) would break the one-line views of the
    # recording, or play tricks on the terminal that shows it.
    if any(unicodedata.category(c) == "Cc" for c in note):
        raise CommandError("note: a note is one line of text: no newlines, tabs or other control characters")
    return note


def parse_at(text: str) -> tuple[int, Command]:
    """`STEP:ACTION`, e.g. `10:dtype=bf16`: apply ACTION before step STEP runs."""
    step_text, sep, action = text.partition(":")
    if not sep:
        raise CommandError(f"expected STEP:ACTION, e.g. 10:dtype=bf16, got {text!r}")
    try:
        step = int(step_text)
    except ValueError:
        raise CommandError(f"{step_text!r} is not a step number, in {text!r}") from None
    if step < 0:
        raise CommandError(f"the step must be 0 or more, got {step} in {text!r}")
    return step, parse_action(action, source="at")
