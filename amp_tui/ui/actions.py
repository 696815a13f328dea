"""The one registry of the dashboard's keys: footer bindings, command palette entries and the
help screen are all generated from `KEY_ACTIONS`, so they can't disagree.

Which keys work depends on the source's mode: "live" (a run in this process), "attached" (a job
running elsewhere, steered over its control socket; q detaches), "launched" (a job `amp-tui run`
started: attached, but q stops it) and "replay" (a recording). A key that means something
different per mode keeps one binding; its texts per mode live here.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding

STEER = frozenset({"live", "attached", "launched"})
JOB = frozenset({"attached", "launched"})     # a job in another process
REPLAY = frozenset({"replay"})
ALL = frozenset({"live", "attached", "launched", "replay"})


@dataclass(frozen=True)
class KeyAction:
    id: str             # the Binding id (usable in a keymap)
    key: str            # Textual key name
    action: str         # the App action it runs
    footer: str         # short description for the footer
    title: str          # command palette title
    help: str           # one line for the help screen and the palette
    key_display: str | None = None
    modes: frozenset = STEER   # where the key does something (else it is hidden)
    # (footer, title, help) in a mode where the key does something else
    texts: tuple[tuple[str, tuple[str, str, str]], ...] = ()
    priority: bool = False     # before the focused widget's own keys (home/end, arrows)
    always: bool = False       # works in every mode, whatever the run's state (help, quit)
    shown: bool = True         # in the footer and the palette (False: listed in the help only: a
                               # second key for an action that has its own entry, or a key that
                               # only does something after a rare event, like f)
    # Modes where the key can't work, bound only to say why (x in a replay): listed nowhere, so
    # the footer, the palette and the help name only keys that work in the mode at hand.
    refused_in: frozenset = frozenset()

    def shown_in(self, mode: str) -> bool:
        return self.shown and mode in self.modes

    def bound_in(self, mode: str) -> bool:
        return mode in self.modes or mode in self.refused_in

    def text(self, mode: str) -> tuple[str, str, str]:
        return dict(self.texts).get(mode, (self.footer, self.title, self.help))


_PLAY = ("play", "Play / pause the replay", "Play or pause the recording")
_QUIT_REPLAY = ("quit", "Quit", "Close the replay")
_QUIT_ATTACHED = ("detach", "Detach", "Leave the dashboard; the job keeps running (amp-tui attach "
                  "RUN_DIR comes back)")
_QUIT_LAUNCHED = ("quit", "Quit", "Stop the job at a step boundary, wait for it to exit, and exit")

KEY_ACTIONS: tuple[KeyAction, ...] = (
    KeyAction("amp.cycle_dtype", "d", "cycle_dtype", "dtype", "Cycle the dtype",
              "Switch autocast dtype fp16 → bf16 → fp32 → fp16 (fp8 → bf16) at the next step boundary"),
    KeyAction("amp.halve_scale", "s", "halve_scale", "½ scale", "Halve the loss scale",
              "Halve GradScaler's loss scale (in bf16/fp32: the init_scale for the next fp16)"),
    KeyAction("amp.set_scale", "S", "set_scale", "set scale", "Set the loss scale…",
              "Type an exact loss scale / init_scale (a positive finite number, e.g. 4096 or 2^12)"),
    KeyAction("amp.save", "c", "save_checkpoint", "save", "Save a checkpoint",
              "Save weights, optimizer, scheduler and scaler state to a .safetensors checkpoint now"),
    KeyAction("amp.restore", "r", "pick_checkpoint", "restore", "Restore a checkpoint…",
              "Pick one of this run's checkpoints (newest first) or type a path; Enter restores"),
    KeyAction("amp.pause", "space", "toggle_pause", "pause", "Pause / resume",
              "Pause at the next step boundary, or resume", key_display="space", modes=ALL,
              texts=(("replay", _PLAY),)),
    KeyAction("amp.step", "n", "single_step", "step", "Run one step",
              "Run exactly one step while paused"),
    KeyAction("amp.note", "m", "add_note", "note", "Add a note…",
              "Type a line to record in the session at the next step boundary (Enter records, Esc cancels)"),
    KeyAction("amp.probes", "p", "toggle_probes", "probes", "Probe every step / the schedule",
              "Probe every step from the next one on, or go back to the probe schedule (the budget)"),
    KeyAction("amp.apply_fix", "f", "apply_fix", "fix", "Apply the verified fix",
              "Apply the fix the last non-finite step verified (fp32=MODULE or dtype=bf16) at the next "
              "step boundary", modes=ALL, shown=False,
              texts=(("replay", ("fix", "The verified fix", "Say the last verified fix (a recording "
                                 "can't be steered: run again with it)")),)),
    KeyAction("amp.undo_autopilot", "u", "undo_autopilot", "undo", "Undo autopilot",
              "Take back the autopilot's last decision (--on-nonfinite isolate): a module out of fp32, "
              "the scale or the dtype as before it, at the next step boundary", shown=False,
              refused_in=REPLAY,
              texts=(("replay", ("undo", "Undo autopilot", "Say why a recording can't be steered "
                                 "(u in a live run)")),)),
    KeyAction("amp.replay.faster", "plus", "replay_faster", "faster", "Replay faster",
              "Double the playback speed", key_display="+", modes=REPLAY, priority=True),
    KeyAction("amp.replay.slower", "minus", "replay_slower", "slower", "Replay slower",
              "Halve the playback speed", key_display="-", modes=REPLAY, priority=True),
    KeyAction("amp.replay.back", "left", "replay_step(-1)", "-1", "Step back",
              "Show the previous step (pauses)", key_display="←", modes=REPLAY, priority=True),
    KeyAction("amp.replay.forward", "right", "replay_step(1)", "+1", "Step forward",
              "Show the next step (pauses)", key_display="→", modes=REPLAY, priority=True),
    KeyAction("amp.replay.previous_event", "left_square_bracket", "replay_event(-1)", "prev",
              "Previous event", "Go back to the previous event (pauses)", key_display="[",
              modes=REPLAY, priority=True),
    KeyAction("amp.replay.next_event", "right_square_bracket", "replay_event(1)", "next",
              "Next event", "Go to the next event (pauses)", key_display="]", modes=REPLAY,
              priority=True),
    KeyAction("amp.replay.home", "home", "replay_home", "first", "Go to the start",
              "Show the first recorded step", modes=REPLAY, priority=True),
    KeyAction("amp.replay.end", "end", "replay_end", "last", "Go to the end",
              "Show the last recorded step", modes=REPLAY, priority=True),
    KeyAction("amp.replay.goto", "g", "replay_goto", "go to", "Go to a step…",
              "Type a step number and show it", modes=REPLAY),
    KeyAction("amp.help", "question_mark", "help", "help", "Help",
              "Show the keys and what the colours mean", key_display="?", modes=ALL, always=True),
    KeyAction("amp.quit", "q", "quit", "quit", "Quit",
              "Stop at a step boundary, flush the session and exit", modes=ALL, always=True,
              texts=(("replay", _QUIT_REPLAY), ("attached", _QUIT_ATTACHED), ("launched", _QUIT_LAUNCHED))),
    # Textual reads Ctrl+C as a key (no SIGINT reaches the app); here it is q, on every screen,
    # as it is in headless mode: a reflexive Ctrl+C must never leave a run without a way out.
    KeyAction("amp.interrupt", "ctrl+c", "interrupt", "quit", "Quit",
              "Same as q (a second Ctrl+C forces the exit, as a second q does)",
              key_display="ctrl+c", modes=ALL, always=True, priority=True, shown=False,
              texts=(("replay", ("quit", "Quit", "Same as q: close the replay")),
                     ("attached", ("detach", "Detach", "Same as q: leave the dashboard; the job "
                                   "keeps running")))),
    KeyAction("amp.stop_job", "Q", "stop_job", "stop job", "Stop the job and quit",
              "Stop the job at its next step boundary (it flushes its session), then leave",
              modes=JOB),
    KeyAction("amp.output", "o", "show_output", "output", "Show the job's output",
              "The job's own output (its stdout and stderr, kept in the run directory)", modes=JOB,
              always=True),
    # Last: where the footer can't hold every key (120 columns) it cuts this one, not quit.
    KeyAction("amp.xray", "x", "xray", "X-ray", "X-ray the next step",
              "Trace the next step op by op (amp-tui train): the dtype autocast ran each op in and its "
              "headroom to that dtype's max, shown once the step ran", refused_in=REPLAY,
              texts=(("replay", ("X-ray", "X-ray", "Say why a recording can't be X-rayed (the X-ray runs a "
                                 "step again: x in a live run)")),)),
    KeyAction("amp.fp8", "8", "fp8", "fp8?", "fp8 what-if of the next step",
              "Cast the next step's Linear layers to fp8 and fp4 in a what-if: a verdict per layer and a "
              "filter for torchao's convert_to_float8_training, shown once the step ran", refused_in=REPLAY,
              texts=(("replay", ("fp8?", "fp8 what-if", "Say why a recording can't be cast to fp8 (the "
                                 "what-if runs a step again: 8 in a live run)")),)),
)

BY_ACTION = {a.action.partition("(")[0]: a for a in KEY_ACTIONS}


def bindings(mode: str = "live") -> list[Binding]:
    """The bindings of the keys that exist in `mode`, with that mode's texts."""
    out = []
    for a in KEY_ACTIONS:
        if not a.bound_in(mode):
            continue
        footer, _, help_line = a.text(mode)
        out.append(Binding(a.key, a.action, footer, key_display=a.key_display, id=a.id,
                           tooltip=help_line, priority=a.priority, show=a.shown_in(mode)))
    return out


def key_label(a: KeyAction) -> str:
    return a.key_display or a.key
