"""The records of a session as types, and the one reducer from records to a run's state.

A live run, a replay and `amp-tui ls` all need "what state was the run in after these records":
they fold `next_state` over the records they have. The fields are documented in
docs/session-format.md, which a test holds to what the writer writes. Read records stay plain
dicts: a file may be damaged or edited by hand, so a reader takes every field with `.get()` and
checks its type; a per-field type here would claim what no reader can rely on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from amp_tui.core.precision import SCALE_FLOOR

RecordType = Literal["header", "step", "event", "end"]
RunState = Literal["starting", "running", "paused", "stopped", "finished", "error"]
EndStatus = Literal["finished", "stopped", "error"]
# live: a run in this process; attached: a job elsewhere (q detaches); launched: a command
# `amp-tui run` started (attached to, but q stops it); replay: a recording.
Mode = Literal["live", "replay", "attached", "launched"]
STEERED_MODES: frozenset[str] = frozenset({"live", "attached", "launched"})
EventKind = Literal["intervention", "checkpoint_saved", "checkpoint_restored", "nonfinite", "alert",
                    "error", "refused", "paused", "stopping", "resumed", "note", "probes", "forecast",
                    "forecast_checked", "xray", "calibration", "fp8"]

ENDED: frozenset[str] = frozenset({"finished", "stopped", "error"})
# The `probes` events that say why the spacing within the schedule narrowed, not a change of mode.
PROBE_SPACING_REASONS = frozenset({"trend", "growth"})
# The events that change a run's state or what it trains with (`InForce`); the others (a
# checkpoint saved, an alert...) don't.
STATE_EVENTS: tuple[EventKind, ...] = ("intervention", "checkpoint_restored", "paused", "error", "resumed")
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


@dataclass(frozen=True)
class InForce:
    """What a run trains with at a point of its recording: the autocast dtype, the modules that
    run in fp32 whatever the dtype (`--fp32-modules`, `fp32=`, `f`, the autopilot), and the loss
    scale's floor (`--min-scale`, `min_scale=`)."""

    dtype: str | None = None
    fp32_modules: tuple[str, ...] = ()
    min_scale: float | None = None     # the run's own floor; None: amp-tui's default

    @property
    def scale_floor(self) -> float:
        return SCALE_FLOOR if self.min_scale is None else self.min_scale

    def runs_in_fp32(self, module: str) -> bool:
        """Whether `module` runs in fp32: it is one of the fp32 modules, or inside one."""
        return any(module == name or module.startswith(name + ".") for name in self.fp32_modules)


def _names(value: Any) -> tuple[str, ...] | None:
    return tuple(str(n) for n in value) if isinstance(value, list) else None


def _floor(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
    return float(value) if ok else None


def next_in_force(in_force: InForce, record: Mapping[str, Any]) -> InForce:
    """What the run trains with after `record`, given what it trained with before: the header's
    start, each step's dtype, the `after` of an intervention (a dtype, the fp32 modules: `fp32=`,
    `f`, the autopilot and its undo) or a restore, a resume's own flags, the end's dtype."""
    kind = record.get("type")
    dtype = record.get("dtype")
    dtype = dtype if isinstance(dtype, str) else None
    if kind == "header":
        guards = record.get("guards") if isinstance(record.get("guards"), Mapping) else {}
        return InForce(dtype, _names(record.get("fp32_modules")) or (), _floor(guards.get("min_scale")))
    if kind in ("step", "end"):
        return replace(in_force, dtype=dtype) if dtype and dtype != in_force.dtype else in_force
    if kind != "event":
        return in_force
    event = record.get("kind")
    if event in ("intervention", "checkpoint_restored"):
        after = record.get("after")
        if not isinstance(after, Mapping):
            return in_force
        changed = {}
        if isinstance(after.get("dtype"), str):
            changed["dtype"] = after["dtype"]
        if _names(after.get("fp32_modules")) is not None:
            changed["fp32_modules"] = _names(after["fp32_modules"])
        return replace(in_force, **changed) if changed else in_force
    if event == "resumed":   # a process of its own, with its own flags
        changed = {"min_scale": _floor(record.get("min_scale"))} if "min_scale" in record else {}
        if _names(record.get("fp32_modules")) is not None:
            changed["fp32_modules"] = _names(record["fp32_modules"])
        return replace(in_force, **changed) if changed else in_force
    return in_force


def in_force_after(records: Iterable[Mapping[str, Any]], in_force: InForce = InForce()) -> InForce:
    for record in records:
        in_force = next_in_force(in_force, record)
    return in_force
