"""The forecasts a run recorded (its `forecast_scale` and `forecast_layer` alerts, and the `forecast`
events of those that need nothing done) and whether they
came true, worked out from the records alone (docs/session-format.md, "Forecasts"):

- a scale forecast came true or not as the run judged it, in its `forecast_checked` event
  (job/records/forecasts.py): the run alone sees every scale it ran at, a command's and a restore's
  included, so its verdict is the one the live output, the report and the exports all say; a
  forecast the run has not judged (its growth step not reached, or the run ended first) is open;
- a layer forecast came true when a later step went non-finite in that layer (the module a
  `nonfinite` event names is the layer, or inside it, or holds it), and is open while the
  recording has not reached the step it named;
- an fp8 forecast (a layer's crest climbing, `forecast_fp8`) came true when a later fp8 what-if
  kept that layer in bf16 (its `fp8` event's `kept`), and is open until the step it named.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from amp_tui.core.records import nonfinite_layer

REASONS = ("forecast_scale", "forecast_layer", "forecast_fp8")
COLUMNS = ("step", "reason", "layer", "figure", "eta", "at_step", "headroom", "came_true", "true_at", "lead")


def is_forecast(event: Mapping[str, Any]) -> bool:
    return event.get("kind") in ("alert", "forecast") and event.get("reason") in REASONS


def same_module(a: str, b: str) -> bool:
    """One module is the other, or inside it (by their dotted names)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def forecast_outcomes(events: Iterable[Mapping[str, Any]], last_step: int | None) -> list[dict]:
    """Each forecast alert of `events` (in file order, with the `nonfinite` and `forecast_checked`
    events among them), as a row of COLUMNS; `last_step`: the recording's last step (what is not past it is open)."""
    forecasts, nonfinite, checked, turned = [], [], {}, []
    for e in events:
        step = e.get("step")
        if not isinstance(step, int):
            continue
        if is_forecast(e):
            forecasts.append(e)
        elif e.get("kind") == "nonfinite":
            nonfinite.append((step, nonfinite_layer(e), e.get("where")))
        elif is_verdict(e):
            checked[e["forecast_step"]] = (e.get("came_true") is True, step)   # the run's own verdict
        elif e.get("kind") == "fp8" and isinstance(e.get("kept"), list):
            turned.append((step, e["kept"]))
    return [_outcome(e, turned if e.get("reason") == "forecast_fp8" else nonfinite, last_step,
                     checked.get(e["step"])) for e in forecasts]


def is_verdict(event: Mapping[str, Any]) -> bool:
    """A `forecast_checked` event: the run's verdict on one of its scale forecasts."""
    return event.get("kind") == "forecast_checked" and isinstance(event.get("forecast_step"), int)


def _outcome(event: Mapping[str, Any], nonfinite: list, last_step: int | None,
             checked: tuple[bool, int] | None = None) -> dict:
    """`nonfinite`: the steps that went non-finite, with their layer; for an fp8 forecast, the
    what-ifs' steps with the layers they kept in bf16."""
    said = event.get("forecast") if isinstance(event.get("forecast"), Mapping) else {}
    step, reason = event["step"], event.get("reason")
    row = dict.fromkeys(COLUMNS)
    row.update(step=step, reason=reason, headroom=said.get("headroom"))
    if reason == "forecast_scale":
        at = said.get("growth_step")
        row.update(figure="grad", at_step=at)
        if isinstance(at, int):
            row["eta"] = at - step
            if checked is not None:   # else open: the run has not judged it
                row["came_true"], row["true_at"] = checked[0], checked[1] if checked[0] else None
    else:
        layer = said.get("layer")
        row.update(layer=layer, figure=said.get("figure"), eta=said.get("eta"), at_step=said.get("at_step"))
        if reason == "forecast_fp8":
            hit = next((s for s, kept in nonfinite if s > step and layer in kept), None)
        else:
            hit = next((s for s, named, _where in nonfinite
                        if s >= step and isinstance(layer, str) and named and same_module(named, layer)), None)
        row["true_at"] = hit
        at = row["at_step"]
        due = last_step is not None and (not isinstance(at, int) or last_step >= at)
        row["came_true"] = True if hit is not None else (False if due else None)
    if row["true_at"] is not None:
        row["lead"] = row["true_at"] - step
    return row


def outcome_text(row: Mapping[str, Any]) -> str:
    """One forecast in words, for `amp-tui report`."""
    if row["reason"] == "forecast_scale":
        what = f"scale growth at step {row['at_step']} overflows"
    elif row["reason"] == "forecast_fp8":
        what = f"{row['layer']} leaves fp8 range (its crest) in ~{row['eta']} steps"
    else:
        what = f"{row['layer']} ({row['figure']}) reaches the max in ~{row['eta']} steps"
    if row["came_true"] is None:
        end = "open"
    elif row["came_true"]:
        end = f"came true at step {row['true_at']} ({row['lead']} steps later)"
    else:
        end = "did not come true"
    return f"step {row['step']}: {what}: {end}"
