"""The records of a session as types, and the one reducer from records to a run's state.

A live run, a replay and `amp-tui ls` all need "what state was the run in after these records":
they fold `next_state` over the records they have. The fields are documented in
docs/session-format.md, which a test holds to what the writer writes. Read records stay plain
dicts: a file may be damaged or edited by hand, so a reader takes every field with `.get()` and
checks its type; a per-field type here would claim what no reader can rely on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

RecordType = Literal["header", "step", "event", "end"]
RunState = Literal["starting", "running", "paused", "stopped", "finished", "error"]
EndStatus = Literal["finished", "stopped", "error"]
# live: a run in this process; attached: a job elsewhere (q detaches); launched: a command
# `amp-tui run` started (attached to, but q stops it); replay: a recording.
Mode = Literal["live", "replay", "attached", "launched"]
STEERED_MODES: frozenset[str] = frozenset({"live", "attached", "launched"})
EventKind = Literal["intervention", "checkpoint_saved", "checkpoint_restored", "nonfinite", "alert",
                    "error", "refused", "paused", "stopping", "resumed", "note", "probes", "forecast_checked",
                    "xray"]

ENDED: frozenset[str] = frozenset({"finished", "stopped", "error"})
# The events that change a run's state; the others (a checkpoint saved, an alert...) don't.
STATE_EVENTS: tuple[EventKind, ...] = ("intervention", "checkpoint_restored", "paused", "error")
# The events a chart marks on its step axis.
MARKER_EVENTS: tuple[EventKind, ...] = ("intervention", "checkpoint_restored")
# What an intervention's `after.state` may set.
_STEERED = ("paused", "running", "stopped")


def end_status(state: str) -> EndStatus:
    """What the end record says of a run that was in `state` when it ended."""
    return state if state in ENDED else "stopped"   # type: ignore[return-value]


def next_state(state: RunState, record: Mapping[str, Any]) -> RunState:
    """The state of a run after `record`, given the state before it."""
    kind = record.get("type")
    if kind == "end":
        return end_status(str(record.get("status")))
    if kind == "step":
        return "running" if state == "starting" else state
    if kind != "event":
        return state
    event = record.get("kind")
    if event in ("intervention", "checkpoint_restored"):
        after = record.get("after")
        if isinstance(after, Mapping) and after.get("state") in _STEERED:
            return after["state"]
    elif event == "paused":
        return "paused"
    elif event == "error" and record.get("during") == "step":
        return "error"
    return state


def state_after(records: Iterable[Mapping[str, Any]], state: RunState = "starting") -> RunState:
    for record in records:
        state = next_state(state, record)
    return state


def traced_module(fields: Mapping[str, Any] | None) -> str | None:
    """The module the op replay found the op in (`op_module`), which every place that names a
    non-finite step's origin names then: None when no op was found, or it ran outside the model
    (the loss) or in the root's own forward, where the module checks' answer stands."""
    if not fields or not fields.get("op"):
        return None
    module = fields.get("op_module")
    return module if isinstance(module, str) and module else None


def nonfinite_layer(event: Mapping[str, Any]) -> str | None:
    """The module a `nonfinite` event names: the op's module where the op replay found one;
    else where it went wrong first, in the forward pass for a non-finite loss (`origin`) and in
    the backward pass for gradients (`backward_origin`); `layer` (the same module, or the probes'
    first non-finite figure when no diagnosis ran) otherwise. None when the model's input was
    already non-finite: no module of the model made it."""
    traced = traced_module(event)
    if traced is not None:
        return traced
    first = event.get("origin") if event.get("where") in ("loss", "activations") else event.get("backward_origin")
    found = first or event.get("layer")
    return str(found) if found else None


def note_text(event: Mapping[str, Any]) -> str:
    """What a `note` event says: its `text`, as typed; its message (the same text) when a writer
    left the text out."""
    text = event.get("text")
    if isinstance(text, str):
        return text
    return str(event.get("message") or "")


def world_size_of(header: dict) -> int:
    """The ranks a session's job ran (its header's `world_size`; 1 for a one-process run, and
    for a header that says nothing sensible)."""
    world = header.get("world_size")
    return world if isinstance(world, int) and not isinstance(world, bool) and world > 1 else 1
