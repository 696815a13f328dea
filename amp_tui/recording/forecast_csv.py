"""`amp-tui export --forecasts-csv FILE`: one row per forecast the run recorded, with whether it
came true (the columns of forecast_outcomes.COLUMNS; docs/export.md says what each holds)."""

from __future__ import annotations

from pathlib import Path

from amp_tui.recording.csv_export import _CsvSink, quoted
from amp_tui.recording.forecast_outcomes import COLUMNS, forecast_outcomes, is_forecast, is_verdict

# What forecast_outcomes reads of a `nonfinite` event: kept instead of the whole event.
NONFINITE_FIELDS = ("kind", "step", "where", "layer", "origin", "backward_origin")


def field_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (bool, int, float)):
        return str(value)
    return quoted(str(value))


class ForecastsCsv(_CsvSink):
    """Takes the records one at a time; the rows are written at `finish()`, once every later
    step that can make a forecast come true has been read."""

    def __init__(self, path: str | Path):
        super().__init__(path, COLUMNS)
        self._events: list[dict] = []
        self._last: int | None = None

    def write(self, record: dict, line: bytes | None = None) -> None:
        kind, step = record.get("type"), record.get("step")
        if kind == "step" and isinstance(step, int):
            self._last = step if self._last is None else max(self._last, step)
        elif kind == "event" and (is_forecast(record) or is_verdict(record)):
            self._events.append(record)
        elif kind == "event" and record.get("kind") == "nonfinite":
            self._events.append({k: record.get(k) for k in NONFINITE_FIELDS})

    def finish(self) -> None:
        self._start()
        for row in forecast_outcomes(self._events, self._last):
            self._fh.write(",".join(field_text(row[c]) for c in COLUMNS) + "\n")
            self.rows += 1
        super().finish()
