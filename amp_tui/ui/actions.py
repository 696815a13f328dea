"""The one registry of the dashboard's keys: footer bindings, command palette entries and the
help screen are all generated from `KEY_ACTIONS`, so they can't disagree."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class KeyAction:
    id: str             # the Binding id (usable in a keymap)
    key: str            # Textual key name
    action: str         # the App action it runs
    footer: str         # short description for the footer
    title: str          # command palette title
    help: str           # one line for the help screen and the palette
    key_display: str | None = None
    live_only: bool = True   # steers the training run: meaningless when replaying a recording


KEY_ACTIONS: tuple[KeyAction, ...] = (
    KeyAction("amp.cycle_dtype", "d", "cycle_dtype", "dtype", "Cycle the dtype",
              "Switch autocast dtype fp16 → bf16 → fp32 → fp16 at the next step boundary"),
    KeyAction("amp.halve_scale", "s", "halve_scale", "½ scale", "Halve the loss scale",
              "Halve GradScaler's loss scale (in bf16/fp32: the init_scale for the next fp16)"),
    KeyAction("amp.set_scale", "S", "set_scale", "set scale", "Set the loss scale…",
              "Type an exact loss scale / init_scale (a positive finite number, e.g. 4096 or 2^12)"),
    KeyAction("amp.save", "c", "save_checkpoint", "save", "Save a checkpoint",
              "Save weights, optimizer, scheduler and scaler state to a .safetensors checkpoint now"),
    KeyAction("amp.restore", "r", "pick_checkpoint", "restore", "Restore a checkpoint…",
              "Pick one of this run's checkpoints (newest first) or type a path; Enter restores"),
    KeyAction("amp.pause", "space", "toggle_pause", "pause", "Pause / resume",
              "Pause at the next step boundary, or resume", key_display="space"),
    KeyAction("amp.step", "n", "single_step", "step", "Run one step",
              "Run exactly one step while paused"),
    KeyAction("amp.help", "question_mark", "help", "help", "Help",
              "Show the keys and what the colours mean", key_display="?", live_only=False),
    KeyAction("amp.quit", "q", "quit", "quit", "Quit",
              "Stop at a step boundary, flush the session and exit", live_only=False),
)

BY_ACTION = {a.action: a for a in KEY_ACTIONS}


def bindings() -> list[Binding]:
    return [Binding(a.key, a.action, a.footer, key_display=a.key_display, id=a.id, tooltip=a.help)
            for a in KEY_ACTIONS]


def key_label(a: KeyAction) -> str:
    return a.key_display or a.key
