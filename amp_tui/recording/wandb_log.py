"""A session in W&B: amp_tui.recording.tracking's metrics as history rows against their own x-axis,
`amp/step` (the session's step), events as alerts and a table, the session file as an artifact.

- history: one row a step, `amp/step` and the `amp/...` series (`run.define_metric("amp/*",
  step_metric="amp/step")`), so that the rows never fight the step W&B counts for another
  logger sharing the run (the HF Trainer's, Lightning's); `amp/dtype` on the row of each change;
- alerts (`run.alert`): non-finite steps with their op and fix (ERROR), guards' alerts and the
  autopilot's own moves (WARN), forecasts (INFO), one of a kind a minute at most (the next says
  how many it held back); every event is a row of the `amp/events` table logged at the end;
- the session file as an artifact of type `amp-tui-session`;
- config: the header's settings under `amp`.

`wandb_backend(project)` logs into `wandb.run` where a run is active (the HF Trainer's
WandbCallback and Lightning's WandbLogger start one before the first step); else it starts one in
`project` (WANDB_PROJECT, or "amp-tui") and finishes it with the session. `WANDB_MODE=offline`
works: the run is written under WANDB_DIR for a later `wandb sync`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from amp_tui.recording.extras import require
from amp_tui.recording.tracking import PREFIX, EventRow

EXTRA = "wandb"
PROJECT = "amp-tui"
STEP_KEY = PREFIX + "step"
ALERT_WAIT_S = 60.0    # one alert a kind this often at most (a skip storm is one alert, not 50)
EVENT_COLUMNS = ["step", "kind", "message", "op", "layer", "fix", "source", "details"]
_ARTIFACT_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _wandb():
    return require("wandb", EXTRA, "W&B logging")


def check_available() -> None:
    """Raise MissingExtra unless wandb can be imported."""
    _wandb()


class WandbBackend:
    name = "W&B"

    def __init__(self, run, *, owned: bool, run_name: str | None):
        self._wandb = _wandb()
        self.run = run
        self.owned = owned
        self.run_name = run_name
        self._dtypes: dict[int, str] = {}
        self._alerted: dict[str, float] = {}     # an alert's title: when it was last sent (event time)
        self._held: dict[str, int] = {}          # an alert's title: how many were not sent since
        run.define_metric(STEP_KEY, hidden=True)
        run.define_metric(PREFIX + "*", step_metric=STEP_KEY)

    def log_header(self, params: dict[str, str]) -> None:
        self.run.config.update({"amp": params}, allow_val_change=True)

    def log_steps(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        log = self.run.log
        for step, _wall, metrics in rows:
            row = {STEP_KEY: step, **metrics}
            dtype = self._dtypes.pop(step, None)
            if dtype is not None:
                row[PREFIX + "dtype"] = dtype
            log(row)

    def log_dtype(self, dtype: str, step: int, time: float) -> None:
        self._dtypes[step] = dtype
        self.run.summary[PREFIX + "dtype"] = dtype

    def log_events(self, rows: list[EventRow]) -> None:
        for row in rows:
            level = row.alert_level
            if level is None:
                continue
            title = row.title
            if row.time - self._alerted.get(title, -ALERT_WAIT_S) < ALERT_WAIT_S:
                self._held[title] = self._held.get(title, 0) + 1
                continue
            held = self._held.pop(title, 0)
            text = f"step {row.step}: {row.text()}" + (f"\n({held} more since the last one: the events "
                                                       "table has them all)" if held else "")
            self.run.alert(title=title, text=text, level=self._wandb.AlertLevel[level], wait_duration=0)
            self._alerted[title] = row.time

    def finish(self, events: list[EventRow], session: Path | None, status: str) -> None:
        wandb = self._wandb
        try:
            if events:
                table = wandb.Table(columns=EVENT_COLUMNS, data=[_table_row(row) for row in events])
                self.run.log({PREFIX + "events": table, STEP_KEY: events[-1].step})
            if session is not None and session.exists():
                name = _ARTIFACT_UNSAFE.sub("-", f"amp-tui-session-{self.run_name or self.run.id}")
                artifact = wandb.Artifact(name, type="amp-tui-session")
                artifact.add_file(str(session), name="session.jsonl")
                self.run.log_artifact(artifact)
        finally:
            if self.owned:
                self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def _table_row(row: EventRow) -> list:
    shown = ("op", "layer", "fix", "source")
    rest = "; ".join(f"{k}: {v}" for k, v in row.details.items() if k not in shown)
    return [row.step, row.kind, row.message, *(row.details.get(k, "") for k in shown), rest]


def wandb_backend(project: str | None = None, *, run_name: str | None = None,
                  reuse_active: bool = True) -> WandbBackend:
    """The W&B run to log into: `wandb.run` where `reuse_active` and one is active, else a new one
    in `project`, named `run_name`. Raises MissingExtra without wandb."""
    wandb = _wandb()
    if reuse_active and wandb.run is not None:
        return WandbBackend(wandb.run, owned=False, run_name=run_name)
    # WANDB_DIR as it is now: wandb reads it once a process, at its first run.
    run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or PROJECT, name=run_name,
                     dir=os.environ.get("WANDB_DIR") or None, reinit="create_new")
    return WandbBackend(run, owned=True, run_name=run_name)
