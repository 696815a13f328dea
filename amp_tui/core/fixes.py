"""A verified fix of a non-finite event as the command that applies it live, and in the words of
the way of running at hand.

The op trace names its fix as the flag to run with (`--fp32-modules 'blocks.3.attn'`, `--dtype
bf16`); a running job takes the same change as a command (`fp32=blocks.3.attn`, `dtype=bf16`).
The records keep the flag (`fix`); what a message tells the user to do is `fix_in_words`: the
flag under `amp-tui train`, the monitor's argument and the live command in the user's own loop.
"""

from __future__ import annotations

import shlex
from typing import Iterable

from amp_tui.core.commands import Command, CommandError, parse_action

_FLAG_ACTIONS = {"--fp32-modules": "fp32", "--dtype": "dtype"}

# The ways of running: `amp-tui train` (a script's setup(), run by amp-tui), and `monitor`: the
# user's own loop under `amp_tui.monitor` (which `amp-tui run` starts too).
TRAIN, MONITOR = "train", "monitor"
# What a monitored loop takes in place of a flag: the monitor's argument; `--init-scale` is the
# loop's own GradScaler's.
_MONITOR_ARGUMENTS = {"--fp32-modules": "fp32_modules=[{value!r}]", "--dtype": "dtype={value!r}",
                      "--init-scale": "GradScaler(init_scale={value})"}


def fix_command(fix: str, source: str = "api") -> Command | None:
    """The command for a fix flag; None for a flag no command applies."""
    try:
        words = shlex.split(fix)
    except ValueError:
        return None
    if len(words) != 2 or words[0] not in _FLAG_ACTIONS:
        return None
    try:
        return parse_action(f"{_FLAG_ACTIONS[words[0]]}={words[1]}", source)
    except CommandError:
        return None


def fix_in_words(fix: str, way: str | None = TRAIN, run_dir: str | None = None, *, live: bool = True) -> str:
    """A fix flag (`--fp32-modules 'fc'`, `--dtype bf16`, `--init-scale 2048`) as the way of
    running at hand takes it: under `amp-tui train` the flag itself; in a monitored loop the
    argument to give (`fp32_modules=['fc']` to `amp_tui.monitor`, `init_scale=` to its
    GradScaler) and, for what a running job takes, the live command (`…, or live: amp-tui ctl
    RUN fp32=fc`).
    `live`: with the live command (a recording, which can't be steered, says the argument alone).
    A text that is no single flag is kept as it is."""
    if way != MONITOR:
        return fix
    try:
        words = shlex.split(fix)
    except ValueError:
        return fix
    if len(words) != 2 or words[0] not in _MONITOR_ARGUMENTS:
        return fix
    said = _MONITOR_ARGUMENTS[words[0]].format(value=words[1])
    if not live or fix_command(fix) is None:
        return said
    live = shlex.quote(f"{_FLAG_ACTIONS[words[0]]}={words[1]}")
    return f"{said}, or live: amp-tui ctl {shlex.quote(str(run_dir)) if run_dir else 'RUN'} {live}"


def applied_by_autopilot(events: Iterable[dict], fix_event: dict) -> bool:
    """Whether the autopilot (--on-nonfinite isolate) made `fix_event`'s fix after its step: `f`
    must not apply it again (fp32=MODULE toggles, so it would take it back)."""
    command = fix_command(str(fix_event.get("fix") or ""))
    return command is not None and any(
        e.get("kind") == "intervention" and e.get("source") == "autopilot" and e.get("action") == command.action
        and e.get("value") == command.value and (e.get("step") or 0) > (fix_event.get("step") or 0)
        for e in events)


def fix_in_force(events: Iterable[dict], fix_event: dict) -> bool:
    """Whether the interventions after `fix_event`'s step left its fix in force (applied by `f`,
    `d`, `ctl` or the palette alike): the dtype it names is the run's dtype, or the module it
    names is among the fp32 modules. Each intervention records the state it left (`after`)."""
    command = fix_command(str(fix_event.get("fix") or ""))
    if command is None:
        return False
    in_force = False
    for event in events:
        if event.get("kind") != "intervention" or (event.get("step") or 0) <= (fix_event.get("step") or 0):
            continue
        after = event.get("after") if isinstance(event.get("after"), dict) else {}
        if command.action == "dtype" and "dtype" in after:
            in_force = after["dtype"] == command.value
        elif command.action == "fp32" and isinstance(after.get("fp32_modules"), list):
            in_force = command.value in after["fp32_modules"]
    return in_force


def last_verified_fix(events: Iterable[dict]) -> dict | None:
    """The newest non-finite event whose fix was verified on its step and a command applies."""
    found = None
    for event in events:
        if event.get("kind") == "nonfinite" and event.get("fix_verified") is True \
                and isinstance(event.get("fix"), str) and fix_command(event["fix"]) is not None:
            found = event
    return found


NO_FIX = "no verified fix: none of the run's non-finite steps found one"


def fix_to_apply(events: Iterable[dict], applied_step: int | None, source: str = "api") -> Command | str:
    """`fix` (`f`, `ctl RUN fix`, `--at N:fix`): the command that applies the newest verified fix of
    `events` (the run's non-finite events and its autopilot's interventions), or why there is none
    to apply. `applied_step`: the step whose fix `fix` applied last (fp32=MODULE toggles: applied
    twice, it would be undone)."""
    events = list(events)
    event = last_verified_fix(events)
    if event is None:
        return NO_FIX
    if applied_by_autopilot(events, event):
        return f"the autopilot applied {event['fix']} already (u undoes it)"
    if applied_step == event.get("step"):
        return f"{event['fix']} was already applied (the fix of step {event.get('step')})"
    return fix_command(event["fix"], source)   # type: ignore[return-value] - last_verified_fix checked it
