"""A recording as text: the timeline (`amp-tui replay --headless`) and its interventions as `--at`
arguments (`amp-tui report RUN --as-at`, `amp-tui train --repeat-interventions RUN`).

Everything here is plain text, with no Rich markup, and every string that comes from the recording
has its control characters removed (a recording can hold ANSI escapes). Print it with `print()`
or a Console with `markup=False, highlight=False`.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Union

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.precision import SHORT
from amp_tui.core.records import EventKind, nonfinite_layer, note_text
from amp_tui.core.text import one_line, plural
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.step_lines import F_CALIBRATION, F_NONFINITE_GRADIENTS, F_NONFINITE_LOSS, F_SKIPPED

if TYPE_CHECKING:
    from amp_tui.core.commands import Command

MESSAGE_LIMIT = 400

_DTYPE_NAMES = {**{k: k for k in SHORT}, **{v: k for k, v in SHORT.items()}}

# Interventions the run made on its own (the precision guard's fallback ladder, the autopilot of
# --on-nonfinite isolate): a run repeated with the same settings makes them again, so they are not
# turned into --at arguments.
AUTOMATIC_SOURCES = frozenset({"fallback", "guard", "checkpoint_every", "autopilot"})

IndexLike = Union[SessionIndex, str, Path]


def _index(index: IndexLike) -> SessionIndex:
    return index if isinstance(index, SessionIndex) else SessionIndex(index)


def _short(dtype) -> str:
    return SHORT.get(str(dtype), one_line(dtype, 20)) if dtype is not None else "?"


def _number_text(x: float) -> str:
    """A number as `--at` takes it back exactly: 4096, 0.5, 1e-05."""
    if float(x).is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(float(x))


def _scale_text(x: float | None) -> str:
    return "none" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:g}"


def _steps(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}–{b}"


# ---- the timeline -------------------------------------------------------------------------------

def header_line(index: IndexLike) -> str:
    idx = _index(index)
    h = idx.header
    device = h.get("device") if isinstance(h.get("device"), dict) else {}
    where = f"{device.get('backend', '?')} {device.get('name') or ''}".strip()
    dtype = _short(h.get("dtype"))
    if h.get("dtype") == "float16" and isinstance(h.get("init_scale"), (int, float)):
        dtype += f" (init_scale {h['init_scale']:g})"
    planned = h.get("steps")
    steps = f"{idx.frames} steps recorded" + (f" of {planned}" if isinstance(planned, int) else "")
    script = Path(str(h.get("script"))).name if h.get("script") else "?"
    return one_line(f"{script} on {where}, {dtype}, {steps}", 1000)


def timeline_lines(index: IndexLike) -> list[str]:
    """The recording in step order: a header line, then events (interventions, checkpoints,
    restores, errors, pauses, alerts, notes), runs of skipped updates collapsed into one line each, dtype
    changes nobody asked for, and a summary line."""
    idx = _index(index)
    items: list[tuple[int, int, int, str]] = []   # (step, order, seq, text)
    seq = 0

    def add(step: int, order: int, text: str) -> None:
        nonlocal seq
        items.append((step, order, seq, text))
        seq += 1

    storms = _storms(idx)
    for a, _b, text in storms:
        add(idx.steps[a], 1, text)
    announced_dtypes: set[tuple[int, str]] = set()
    for k in range(idx.event_count):
        kind = idx.event_kind(k)
        step = idx.event_steps[k]
        if kind in ("nonfinite", "calibration") and _in_storm(idx, step):
            continue
        e = idx.event(k)
        after = e.get("after")
        if kind in ("intervention", "checkpoint_restored") and isinstance(after, dict) and after.get("dtype"):
            announced_dtypes.add((step, str(after["dtype"])))
        if kind == "intervention" and e.get("action") == "save":
            continue    # its checkpoint_saved event tells it (a failed save left an error event)
        add(step, 0, f"step {step}: {_event_text(kind, e)}")
    for frame in _dtype_changes(idx):
        step, new = idx.steps[frame], idx.dtype_at(frame)
        if (step, new) in announced_dtypes:
            continue
        old = idx.dtype_at(frame - 1)
        add(step, 2, f"step {step}: dtype {_short(old)} → {_short(new)} (no intervention recorded "
                     "at this step)")
    items.sort()
    return [header_line(idx), *(text for *_, text in items), _summary_line(idx, len(storms))]


def _in_storm(idx: SessionIndex, step: int) -> bool:
    """A nonfinite or calibration event whose step record was a skipped update is told by its
    storm line."""
    frame = idx.frame_of(step)
    return frame >= 0 and idx.steps[frame] == step and bool(idx.flags[frame] & F_SKIPPED)


def _storms(idx: SessionIndex) -> list[tuple[int, int, str]]:
    """Runs of consecutive skipped step records as (first frame, last frame, line)."""
    out = []
    frames = idx.skipped_frames
    n = len(frames)
    i = 0
    while i < n:
        a = frames[i]
        j = i
        while (j + 1 < n and frames[j + 1] == frames[j] + 1
               and idx.steps[frames[j + 1]] == idx.steps[frames[j]] + 1):
            j += 1
        b = frames[j]
        out.append((a, b, _storm_text(idx, a, b)))
        i = j + 1
    return out


def _storm_text(idx: SessionIndex, a: int, b: int) -> str:
    count = b - a + 1
    loss = grads = calibrating = 0
    for f in idx.flags[a:b + 1]:
        loss += bool(f & F_NONFINITE_LOSS)
        grads += bool(f & F_NONFINITE_GRADIENTS)
        calibrating += bool(f & F_CALIBRATION) and not f & (F_NONFINITE_LOSS | F_NONFINITE_GRADIENTS)
    dtypes = {idx.dtype_at(f) for f in (a, b)}
    dtype = " or ".join(sorted(_short(d) for d in dtypes))
    what = []
    if calibrating:
        what.append(f"GradScaler calibrating its scale ×{calibrating}")
    if loss:
        what.append(f"non-finite loss ×{loss}")
    if grads:
        what.append(f"non-finite gradients ×{grads}" if idx.scale_at(a) is None
                    else f"gradient overflow ×{grads}")
    if count - loss - grads - calibrating > 0:
        what.append(f"other ×{count - loss - grads - calibrating}")
    text = f"{_steps(idx.steps[a], idx.steps[b])}: {plural(count, 'skipped update')} in {dtype}"
    if what:
        text += f" ({', '.join(what)})"
    first = idx.scale_at(a)
    after = _scale_text(_scale_after(idx, b)) if b + 1 < idx.frames or idx.end is not None else None
    if first is not None or after not in (None, "none"):
        text += f", scale {_scale_text(first)}"
        text += f" → {after}" if after is not None else " (the recording ends here)"
    layer = _first_layer(idx, idx.steps[a])
    if layer:
        text += f"; first non-finite: {layer}"
    return text


def _scale_after(idx: SessionIndex, b: int) -> float | None:
    """The scale the run went on with after a storm ending at frame `b`."""
    if b + 1 < idx.frames:
        return idx.scale_at(b + 1)
    if idx.end is not None:
        scale = idx.end.get("scale")
        # read_float: a whole number past float's range (a damaged end record) is infinite, not an error
        return read_float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
    return None


def _first_layer(idx: SessionIndex, step: int) -> str | None:
    k = idx.events_upto(step - 1)
    while k < idx.event_count and idx.event_steps[k] == step:
        if idx.event_kind(k) == "nonfinite":
            layer = nonfinite_layer(idx.event(k))
            return one_line(layer, 120) if layer else None
        k += 1
    return None


def _dtype_changes(idx: SessionIndex) -> list[int]:
    codes = idx.dtype_codes
    out = []
    if len(idx.dtypes) < 2:
        return out
    prev = codes[0] if codes else 0
    for frame in range(1, len(codes)):
        c = codes[frame]
        if c != prev:
            out.append(frame)
            prev = c
    return out


# A label before the message, where the message doesn't say what happened by itself
# ("checkpoint … saved", "restored …", "paused after …" do).
_KIND_LABELS: dict[EventKind, str] = {
    "intervention": "intervention",
    "checkpoint_saved": "",
    "checkpoint_restored": "",
    "paused": "",
    "error": "error",
    "refused": "",
    "stopping": "stopping",
    "nonfinite": "non-finite",
    "alert": "alert",
    "forecast": "forecast",
    "note": "note",
}


def _event_text(kind: str, e: dict) -> str:
    message = one_line((note_text(e) if kind == "note" else e.get("message")) or "", MESSAGE_LIMIT)
    label = _KIND_LABELS[kind] if kind in _KIND_LABELS else one_line(kind, 40)
    if not label and not message:
        label = one_line(kind, 40)
    source = e.get("source")
    suffix = ""
    if kind in ("intervention", "checkpoint_restored", "checkpoint_saved", "note", "refused") and source:
        suffix = f" [{one_line(source, 40)}]"
    if kind == "error":
        during = e.get("during")
        if during:
            label = f"error during {one_line(during, 40)}"
    if label and message:
        return f"{label}: {message}{suffix}"
    return f"{label or message}{suffix}"


def _summary_line(idx: SessionIndex, storms: int) -> str:
    frames = idx.frames
    skipped = len(idx.skipped_frames)
    kinds = [idx.event_kind(k) for k in range(idx.event_count)]
    parts = [f"{plural(frames, 'step')}", f"{plural(frames - skipped, 'update')} applied",
             f"{skipped} skipped" + (f" in {plural(storms, 'run')}" if skipped else "")]
    parts.append(plural(kinds.count("intervention"), "intervention"))
    parts.append(plural(kinds.count("checkpoint_saved"), "checkpoint"))
    if kinds.count("checkpoint_restored"):
        parts.append(plural(kinds.count("checkpoint_restored"), "restore"))
    if kinds.count("error"):
        parts.append(plural(kinds.count("error"), "error"))
    if kinds.count("refused"):
        parts.append(plural(kinds.count("refused"), "command") + " refused")
    if kinds.count("note"):
        parts.append(plural(kinds.count("note"), "note"))
    end = idx.end
    if frames:
        last = frames - 1
        dtype = _short(end.get("dtype") if end and end.get("dtype") else idx.dtype_at(last))
        scale = _scale_after(idx, last) if end else idx.scale_at(last)
        parts.append(f"final dtype {dtype}, scale {_scale_text(scale)}")
    if end is not None:
        status = f"ended: {one_line(end.get('status', '?'), 40)}"
    else:
        status = "no end record: the run was killed or is still being written"
    text = f"summary: {', '.join(parts)}; {status}"
    skipped_records = idx.skipped_summary()
    if skipped_records:
        text += f"; {skipped_records}"
    return text


# ---- interventions as --at arguments ------------------------------------------------------------

def _at_action(kind: str, e: dict) -> str | None:
    """The `ACTION` part of `--at STEP:ACTION` that repeats event `e`, or None."""
    if kind == "checkpoint_restored":
        path = e.get("path")
        return f"restore={one_line(path, 4096)}" if path else "restore=latest"
    if kind != "intervention":
        return None
    action = e.get("action")
    value = e.get("value")
    after = e.get("after") if isinstance(e.get("after"), dict) else {}
    if action == "dtype":
        name = _DTYPE_NAMES.get(str(after.get("dtype") or value))
        return f"dtype={SHORT[name]}" if name else None
    if action == "scale":
        if value == "half":
            return "scale=half"
        for x in (after.get("init_scale"), after.get("scale"), value):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0:
                return f"scale={_number_text(x)}"
        return None
    if action in ("save", "pause", "resume", "step", "stop", "undo"):
        return action
    if action == "fp32" and isinstance(value, str) and value:
        return f"fp32={one_line(value, 4096)}"
    return None


def interventions_as_at(index: IndexLike) -> list[str]:
    """Every intervention and restore the user made, as `STEP:ACTION` (for `--at`), in order:
    `10:dtype=bf16`, `20:scale=4096`, `20:scale=half`, `30:save`,
    `40:restore=checkpoints/step-0000030.safetensors`, `50:pause`, `50:resume`. Interventions the
    run made itself (source "fallback", "autopilot") are left out; an `undo` of the autopilot's is
    kept. Refused commands left no intervention event and are not repeated either, nor are notes: a
    note says what happened to that run (a data shard changed by hand), which a run repeating its
    interventions can't claim."""
    idx = _index(index)
    out = []
    for k in range(idx.event_count):
        kind = idx.event_kind(k)
        if kind not in ("intervention", "checkpoint_restored"):
            continue
        e = idx.event(k)
        source = e.get("source")
        if isinstance(source, str) and source in AUTOMATIC_SOURCES:
            continue
        action = _at_action(kind, e)
        if action is not None:
            out.append(f"{idx.event_steps[k]}:{action}")
    return out


def at_arguments(index: IndexLike) -> str:
    """`interventions_as_at` as one shell-ready line: `--at 10:dtype=bf16 --at 30:save ...`
    (quoted where a path needs it); empty when the run had no intervention."""
    return " ".join(f"--at {shlex.quote(text)}" for text in interventions_as_at(index))


def interventions_as_commands(index: IndexLike, source: str = "repeat") -> list[tuple[int, Command]]:
    """`interventions_as_at` as (step, Command) pairs, ready for `RunConfig.at`; an action this
    version can't parse is left out."""
    from amp_tui.core.commands import CommandError, parse_at

    out = []
    for text in interventions_as_at(index):
        try:
            step, command = parse_at(text)
        except CommandError:
            continue
        command.source = source
        out.append((step, command))
    return out
