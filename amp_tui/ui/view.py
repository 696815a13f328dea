"""What the widgets show, derived from a Snapshot. Pure functions: no Textual, easy to test.

Live and replay sources produce the same Snapshot, so every figure on screen is computed here
once, whatever the source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from amp_tui.core import precision
from amp_tui.core.fixes import applied_by_autopilot, fix_in_force, last_verified_fix
from amp_tui.core.forecast_words import scale_forecast_text
from amp_tui.core.jsonsafe import read_float
from amp_tui.core.records import PROBE_SPACING_REASONS, InForce, nonfinite_layer, world_size_of
from amp_tui.sources.protocol import LayerView, Snapshot

# Headroom thresholds (bits = doublings left before the dtype's largest finite value).
DANGER_BITS = 1.0   # within 2x of overflow
WARN_BITS = 4.0     # within 16x of overflow


@dataclass(frozen=True)
class Precision:
    dtype: str | None
    scale: float | None      # the GradScaler scale; None when no scaler runs (bf16, fp32)


def current_precision(snap: Snapshot) -> Precision:
    """The dtype and loss scale in force now: the newest step, then interventions applied since.

    A step record carries the dtype/scale it ran with; a dtype or scale change applied while
    paused only shows in the intervention's `after`, so those are replayed on top.
    """
    dtype = snap.header.get("dtype")
    scale = read_float(snap.header.get("init_scale")) if dtype == "float16" else None
    last_step = -1
    if snap.last is not None:
        dtype = snap.last.get("dtype", dtype)
        scale = read_float(snap.last.get("scale"))
        last_step = int(snap.last.get("step", -1))
    for event in snap.events:
        after = event.get("after")
        if (event.get("kind") in ("intervention", "checkpoint_restored") and isinstance(after, dict)
                and int(event.get("step", -1)) > last_step and "dtype" in after):
            dtype = after.get("dtype", dtype)
            scale = read_float(after.get("scale"))
    return Precision(dtype, scale)


# ---- the layer table --------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerRow:
    index: int                  # position in the model (forward registration order)
    name: str
    act: float | None
    grad: float | None
    weight: float | None
    headroom: float | None      # bits; -inf when a figure is non-finite, None if nothing measured
    limit: str | None           # which figure sets the headroom: "act", "grad" or "weight"
    eta: float | None = None    # the forecast's steps left before the dtype's max (None: no trend)
    fp32: bool = False          # the module runs in fp32 (an fp32 module, or inside one): its
                                # headroom is to fp32's max, whatever the run's dtype
    fp8: list[float | None] | None = None   # in fp8: the amax of its [input, weight, grad_output]

    @property
    def fp8_scale_bits(self) -> list[float | None] | None:
        """log2 of each fp8 cast's tensorwise scale (the format's max over the amax), as torchao's
        default recipe casts: what the layer's tensors are multiplied by to fill the format."""
        if self.fp8 is None:
            return None
        return [math.log2(precision.FP8_MAX[fmt] / v) if v is not None and 0 < v < math.inf else None
                for v, fmt in zip(self.fp8, precision.FP8_FORMATS)]

    @property
    def nonfinite(self) -> bool:
        return self.headroom is not None and self.headroom == -math.inf


def headroom(value: float | None, max_finite: float) -> float | None:
    """Bits left before `value` reaches `max_finite`: log2(max_finite / value); -inf once it is
    non-finite, inf for zero, None when not measured."""
    if value is None:
        return None
    value = abs(value)
    if not math.isfinite(value):
        return -math.inf
    return math.inf if value == 0 else math.log2(max_finite / value)


def layer_rows(layers: LayerView, prec: Precision, in_force: InForce | None = None) -> list[LayerRow]:
    """One row per layer with its headroom to the active dtype's largest finite value, or to
    fp32's for a module that runs in fp32 (`in_force`).

    Gradients are recorded unscaled; in fp16 the backward pass holds them multiplied by the loss
    scale, so that product is what has to fit.
    """
    dtype = prec.dtype if prec.dtype in precision.MAX_FINITE else (layers.dtype or "float32")
    dtype_max = precision.MAX_FINITE.get(dtype, precision.MAX_FINITE["float32"])
    rows = []
    for i, name in enumerate(layers.names):
        fp32 = in_force is not None and in_force.runs_in_fp32(name)
        max_finite = precision.MAX_FINITE["float32"] if fp32 else dtype_max
        act = _at(layers.act, i)
        grad = _at(layers.grad, i)
        weight = _at(layers.weight, i)
        scaled_grad = grad * prec.scale if grad is not None and prec.scale else grad
        candidates = [(headroom(act, max_finite), "act"), (headroom(scaled_grad, max_finite), "grad"),
                      (headroom(weight, max_finite), "weight")]
        known = [(bits, which) for bits, which in candidates if bits is not None]
        bits, limit = min(known, key=lambda c: c[0]) if known else (None, None)
        rows.append(LayerRow(i, name, act, grad, weight, bits, limit, _at(layers.eta, i), fp32, _at(layers.fp8, i)))
    return rows


SORTS = {
    # column -> (label, default reverse)
    "headroom": ("least headroom first (non-finite on top)", False),
    "eta": ("soonest forecast overflow first", False),
    "index": ("model order", False),
    "name": ("name", False),
    "act": ("largest activation first", True),
    "grad": ("largest gradient first", True),
    "weight": ("largest weight first", True),
    "fp8": ("smallest fp8 scale first", False),
}


def sort_rows(rows: list[LayerRow], column: str, reverse: bool = False) -> list[LayerRow]:
    """Sort for the table; unmeasured figures always go last, non-finite ones count as largest."""
    if column == "name":
        return sorted(rows, key=lambda r: (r.name, r.index), reverse=reverse)
    if column == "index":
        return sorted(rows, key=lambda r: r.index, reverse=reverse)
    measured = [r for r in rows if _sort_value(r, column) is not None]
    missing = [r for r in rows if _sort_value(r, column) is None]
    measured.sort(key=lambda r: (_sort_value(r, column), r.index), reverse=reverse)
    return measured + missing


def _sort_value(row: LayerRow, column: str) -> float | None:
    if column == "fp8":
        bits = [b for b in row.fp8_scale_bits or () if b is not None]
        return min(bits) if bits else None
    if column in ("headroom", "eta"):
        return getattr(row, column)
    value = getattr(row, column)
    if value is None:
        return None
    return math.inf if math.isnan(value) else abs(value)


@dataclass(frozen=True)
class LayerSummary:
    total: int
    nonfinite: int
    near: int                   # below WARN_BITS of headroom
    worst: LayerRow | None


def summarize_layers(rows: list[LayerRow]) -> LayerSummary:
    measured = [r for r in rows if r.headroom is not None]
    worst = min(measured, key=lambda r: (r.headroom, r.index)) if measured else None
    return LayerSummary(len(rows), sum(r.nonfinite for r in rows),
                        sum(1 for r in measured if not r.nonfinite and r.headroom < WARN_BITS), worst)


# ---- the ranks --------------------------------------------------------------------------------

RANK_ROWS = 8   # rows of the per-rank view at most: every rank up to that many, else the slowest


def world_size(snap: Snapshot) -> int:
    """How many ranks the run has (1: a run of one process, as every run before them)."""
    return world_size_of(snap.header)


@dataclass(frozen=True)
class RankRow:
    rank: int
    loss: float | None
    step_time: float | None     # seconds up to the step's first collective
    slowest: bool


@dataclass(frozen=True)
class RankSummary:
    world_size: int
    step: int | None            # the step the figures are from (None: no such step yet)
    rows: list[RankRow]         # by rank, or the slowest first when there are too many to show
    slowest: int | None         # the straggler: the rank with the longest step time
    lag: float | None           # its step time over the fastest rank's (1.0 = as fast)
    hidden: int                 # ranks not in `rows`


def rank_summary(snap: Snapshot) -> RankSummary | None:
    """The per-rank view of a run with several ranks (None for one)."""
    world = world_size(snap)
    if world < 2:
        return None
    view = snap.ranks
    if view is None:
        return RankSummary(world, None, [], None, None, 0)
    times = [(t, r) for r, t in enumerate(view.step_time) if t is not None and math.isfinite(t)]
    slowest = max(times)[1] if times else None
    fastest = min(times)[0] if times else None
    lag = (max(times)[0] / fastest) if times and fastest and fastest > 0 else None
    rows = [RankRow(r, _at(view.loss, r), _at(view.step_time, r), r == slowest)
            for r in range(len(view.loss))]
    if len(rows) > RANK_ROWS:
        rows = sorted(rows, key=lambda row: -(row.step_time or 0.0))[:RANK_ROWS]
    return RankSummary(world, view.step, rows, slowest, lag, len(view.loss) - len(rows))


# ---- notices ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class NonfinitePause:
    """The run paused itself after a non-finite loss or activation (on_nonfinite="pause")."""
    step: int                   # the step whose loss was non-finite
    layer: str | None           # the first layer whose output was non-finite
    loss: str
    dtype: str | None
    event_index: int            # events_seen count at the paused event (to notify once)
    where: str = "loss"         # the event's: "activations" for one the loss never saw
    fix: str | None = None      # the verified fix `f` applies (None: none, or the autopilot applied it)
    fix_applied: bool = False   # that fix is in force already (`f` would be refused)


ACT_NOT_MEASURED = "act not measured under torch.compile"


def unmeasured_note(snap: Snapshot) -> str | None:
    """What the layer table can't show, said once above it rather than as blank cells: the
    activations of a compiled model whose graph runs without amp-tui's hooks."""
    info = snap.header.get("compile")
    if not isinstance(info, dict):
        return None
    if info.get("act") == "not_measured" or any(
            e.get("kind") == "alert" and e.get("reason") == "act_not_measured" for e in snap.events):
        return ACT_NOT_MEASURED
    layers = snap.layers
    measured = [_at(layers.act, i) for i in range(len(layers.names))]
    if layers.step is not None and measured and all(v is None for v in measured):
        return ACT_NOT_MEASURED   # the alert may have left the capped event list
    return None


def probing_every_step(snap: Snapshot) -> bool:
    """Whether every step is probed now: a `probes` event for a step not recorded yet (a command
    applied meanwhile), else what the last step record says of the schedule."""
    last = snap.last or {}
    for event in reversed(snap.events):
        if event.get("kind") == "probes" and event.get("reason") not in PROBE_SPACING_REASONS:
            if event.get("step", -1) > last.get("step", -1):
                return event.get("mode") == "every"
            break
    probes = last.get("probes")
    return isinstance(probes, list) and probes[:1] == ["every"]


def weights_note(snap: Snapshot) -> str | None:
    """The weights shown were read at an earlier probed step than the rest (the adaptive
    schedule reads them every few probed steps)."""
    layers = snap.layers
    if layers.weight_step is None or layers.weight_step == layers.step:
        return None
    return f"weights from step {layers.weight_step}"


def nonfinite_origin(snap: Snapshot) -> str | None:
    """The module the newest step's non-finite event names as the origin (None when that step was
    healthy): the layer table highlights it."""
    last = (snap.last or {}).get("step")
    for event in reversed(snap.events):
        if event.get("kind") == "nonfinite":
            if event.get("step") != last:
                return None
            return nonfinite_layer(event)
    return None


# Events the user must see reflected at once. `nonfinite` is not among them: a skip shows as a
# scale change, and a new origin is looked at on its own; periodic saves change nothing shown.
NOTABLE_EVENTS = frozenset({"intervention", "checkpoint_restored", "resumed", "paused", "stopping",
                            "alert", "error", "refused"})


def newest_notable_event(snap: Snapshot) -> int:
    """The number (in feed order) of the newest notable event, -1 when there is none."""
    events = snap.events
    first = snap.events_seen - len(events)
    for i in range(len(events) - 1, -1, -1):
        if events[i].get("kind") in NOTABLE_EVENTS:
            return first + i
    return -1


def nonfinite_pause(snap: Snapshot) -> NonfinitePause | None:
    # The notice offers keys that steer the run: a replay has none.
    if snap.state != "paused" or snap.playback_state is not None:
        return None
    events = snap.events
    first_index = snap.events_seen - len(events)
    for i in range(len(events) - 1, -1, -1):
        event = events[i]
        kind = event.get("kind")
        if kind == "intervention" and (event.get("after") or {}).get("state") == "paused":
            return None     # paused by hand since: no notice
        if kind == "paused" and event.get("reason") == "nonfinite":
            cause = next((e for e in reversed(events[:i]) if e.get("kind") == "nonfinite"), {})
            step = cause.get("step", max(int(event.get("step", 1)) - 1, 0))
            fixed = last_verified_fix(events)
            fix = fixed["fix"] if fixed is not None and not applied_by_autopilot(events, fixed) else None
            return NonfinitePause(int(step), nonfinite_layer(cause), str(cause.get("loss", "non-finite")),
                                  cause.get("dtype"), first_index + i + 1, str(cause.get("where", "loss")), fix,
                                  fix is not None and fix_in_force(events, fixed))
    return None


def scale_forecast(snap: Snapshot) -> str | None:
    """The loss-scale forecast still ahead of the step shown, in words: the newest
    `forecast_scale` alert, while its growth step is to come and the run has not judged it (a
    `forecast_checked` event: the scale changed first) (None: none)."""
    step = int((snap.last or {}).get("step", -1))
    judged = set()
    for event in reversed(snap.events):
        if event.get("kind") == "forecast_checked":
            judged.add(event.get("forecast_step"))
        elif event.get("kind") in ("alert", "forecast") and event.get("reason") == "forecast_scale":
            if event.get("step") in judged:
                return None
            said = event.get("forecast") if isinstance(event.get("forecast"), dict) else {}
            growth, head = said.get("growth_step"), read_float(said.get("headroom"))
            if isinstance(growth, int) and growth > step and head is not None:
                return scale_forecast_text(growth, head)
            return None
    return None


# ---- the event log ----------------------------------------------------------------------------

EVENT_LABELS = {
    # kind -> (label, style)
    "nonfinite": ("NaN/inf", "bold red"),
    "skip": ("skipped", "yellow"),
    "calibration": ("calibrate", "dim"),   # GradScaler finding its scale at the start: no trouble
    "intervention": ("intervene", "cyan"),
    "checkpoint_saved": ("saved", "green"),
    "checkpoint_restored": ("restored", "green"),
    "error": ("error", "bold red"),
    "refused": ("refused", "yellow"),
    "paused": ("paused", "magenta"),
    "stopping": ("stopping", "magenta"),
    "alert": ("alert", "bold yellow"),
    "forecast": ("forecast", "dim yellow"),   # seen coming, nothing to do: not an alert
    "forecast_checked": ("forecast", "yellow"),
    "note": ("note", "bold blue"),
}


def event_label(event: dict) -> tuple[str, str]:
    kind = str(event.get("kind", "?"))
    if kind == "nonfinite" and event.get("where") == "gradients":
        kind = "skip"          # an overflow GradScaler handled: the update was skipped
    if kind == "intervention":
        # Who intervened: a key in the dashboard, a scheduled --at, or library code.
        return INTERVENTION_SOURCES.get(str(event.get("source")), "intervene"), "cyan"
    return EVENT_LABELS.get(kind, (kind, ""))


INTERVENTION_SOURCES = {"dashboard": "key", "at": "--at", "api": "api"}


def _at(values: list, i: int) -> float | None:
    return values[i] if i < len(values) else None
