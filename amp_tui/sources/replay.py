"""Replay a recorded session in the dashboard: a `Source` over its index.

`ReplaySource` implements `amp_tui.sources.protocol.Source` (`mode = "replay"`): the dashboard renders its
`Snapshot`s with the same code as a live run. Playback is driven by `tick()` (called by
`snapshot()` once started, and by the UI's timer if it likes): it advances by elapsed time x speed,
so it does not depend on being called at a regular rate. A record that can't be read where the
replay stands pauses playback and says so in `Snapshot.notice`; nothing here raises during playback.

Positions are step numbers (0-based, as recorded). The snapshot at a position shows what a live
dashboard showed right after that step: the step's record, and every event written before the next
step record (so an intervention applied before step p+1, which carries step p+1, shows at p, as it
did live; at the last step, everything recorded after it too: the final error, pause or stop).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from amp_tui.core import jsonsafe
from amp_tui.core.jsonsafe import read_floats
from amp_tui.core.records import RunState, next_state, state_after, world_size_of
from amp_tui.recording.index import RATE_WINDOW, SessionIndex
from amp_tui.recording.step_lines import F_LOSS_NONE, F_SKIPPED
from amp_tui.sources.buffer import fp8_rows, rank_view
from amp_tui.sources.protocol import (
    EVENT_LIMIT,
    HISTORY_POINTS,
    MARKER_LIMIT,
    History,
    LayerView,
    Playback,
    PlaybackState,
    RankView,
    Snapshot,
)

if TYPE_CHECKING:
    from amp_tui.core.commands import Command

WEIGHT_LOOKBACK = 64   # probed steps looked back at for the last weights read (4 apart, mostly)


@dataclasses.dataclass
class ReplaySnapshot(Snapshot):
    """A Snapshot with the playback's settings (everything else means what it means live:
    `state` is what the recorded run was doing at `position`, as a live dashboard showed it
    then; `playback_state` says whether the replay plays, is paused or follows the file)."""

    playing: bool = False
    speed: float = 0.0              # steps per second of playback
    following: bool = False         # follow mode (the file is re-read as it grows)
    frame: int = -1                 # index of the shown step record among `total_steps`


class ReplaySource:
    """A recorded session as a `Source` (see the module docstring)."""

    mode = "replay"
    can_steer = False
    detaches = False
    output_path = None
    SPEEDS = tuple(2.0 ** k for k in range(11))      # 1 ... 1024 steps per second
    DEFAULT_SPEED = 16.0

    def __init__(self, target: str | Path, *, follow: bool = False,
                 clock: Callable[[], float] = time.monotonic, speed: float = DEFAULT_SPEED,
                 autoplay: bool = True, refresh_interval: float = 0.25,
                 history_points: int = HISTORY_POINTS):
        self.index = SessionIndex(target, follow=follow)
        self.session_path = self.index.path
        self.run_dir = self.index.run_dir
        self.follow = follow
        self.autoplay = autoplay
        self.refresh_interval = refresh_interval
        self._clock = clock
        self._points = history_points
        self.speed = float(speed)
        self.playing = False
        self.started = False
        self._frame = (self.index.frames - 1) if follow else (0 if self.index.frames else -1)
        self._carry = 0.0
        self._last_tick: float | None = None
        self._last_refresh = clock()
        self._version = 1
        self._cached: ReplaySnapshot | None = None
        self._cached_version = 0
        self._bad: tuple[int, str] | None = None  # (frame, notice) of a record that couldn't be read
        self._records: dict[int, dict] = {}  # a few parsed step records by frame

    # ---- the Source protocol ----------------------------------------------------------------
    def start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.follow:
            self.end()
        if self.follow or self.autoplay:
            self.play()

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        self.pause()
        self.started = False
        self.index.close()
        return True

    def send(self, command: Command) -> tuple[bool, str]:
        return False, (f"replay: {command.text()} not sent: this is a recording (steer a live run, "
                       "or repeat these interventions with amp-tui train --at)")

    def held_stop(self) -> str | None:
        return None   # nothing here is recorded: a stop is never held

    def checkpoints(self) -> list:
        return run_checkpoints(self.run_dir)

    @property
    def playback(self) -> Playback:
        return self

    def snapshot(self) -> ReplaySnapshot:
        if self.started:
            self.tick()
        if self._cached is not None and self._cached_version == self._version:
            return self._cached
        try:
            snap = self._build()
        except Exception as exc:  # noqa: BLE001 - a frame that can't be shown must not end the app
            snap = self._failed(exc)
        self._cached, self._cached_version = snap, self._version
        return snap

    def _failed(self, exc: Exception) -> ReplaySnapshot:
        """The previous picture (or an empty one) with a notice, playback paused."""
        self.playing = False
        self._changed()
        notice = (f"replay: step {self.position} can't be shown ({type(exc).__name__}: {exc}); "
                  "playback paused")
        idx = self.index
        base = self._cached or ReplaySnapshot(
            mode=self.mode, header=dict(idx.header), state="starting", last=None,
            total_steps=idx.frames, steps_per_second=0.0, history=History(),
            layers=LayerView(list(idx.layer_names), [], [], [], None, None), events=[],
            events_seen=0, error=None, version=0)
        return dataclasses.replace(base, playback_state=self.playback_state, playing=False, notice=notice,
                                   version=self._version, position=self.position, frame=self._frame)

    # ---- where we are -----------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        return self.index.frames

    @property
    def frame(self) -> int:
        return self._frame

    @property
    def position(self) -> int | None:
        return self.index.steps[self._frame] if self._frame >= 0 else None

    @property
    def at_end(self) -> bool:
        return self._frame >= self.index.frames - 1

    @property
    def playback_state(self) -> PlaybackState:
        if not self.playing:
            return "paused"
        if self.follow and self.at_end and self.index.end is None:
            return "following"
        return "playing"

    def playback_text(self) -> str:
        """For a status line: "playing 16 steps/s", "paused" or "following the file"."""
        if not self.playing:
            return "paused"
        if self.follow and self.at_end and self.index.end is None:
            return "following the file"
        return f"playing {self.speed:g} steps/s"

    # ---- playback controls ------------------------------------------------------------------
    def _changed(self) -> None:
        self._version += 1

    def _go(self, frame: int) -> bool:
        n = self.index.frames
        frame = min(max(frame, 0), n - 1) if n else -1
        if frame == self._frame:
            return False
        self._frame = frame
        self._changed()
        return True

    def play(self) -> None:
        if self.index.frames and self.at_end and not self.follow:
            self._go(0)             # play at the end starts over
        if not self.playing:
            self.playing = True
            self._changed()
        self._last_tick = self._clock()
        self._carry = 0.0

    def pause(self) -> None:
        if self.playing:
            self.playing = False
            self._changed()
        self._carry = 0.0

    def toggle(self) -> bool:
        """Play/pause; returns True when now playing."""
        if self.playing:
            self.pause()
        else:
            self.play()
        return self.playing

    def faster(self) -> float:
        return self._set_speed(min(self.speed * 2, self.SPEEDS[-1]))

    def slower(self) -> float:
        return self._set_speed(max(self.speed / 2, self.SPEEDS[0]))

    def _set_speed(self, speed: float) -> float:
        if speed != self.speed:
            self.speed = speed
            self._carry = 0.0
            self._changed()
        return self.speed

    def step_by(self, n: int) -> int | None:
        """Move `n` step records (negative: back) and pause; returns the new position."""
        self.pause()
        self._go(self._frame + n)
        return self.position

    def seek(self, step: int) -> int | None:
        """Show step `step` (or the newest recorded step before it); playback goes on if it was on."""
        self._go(self.index.frame_of(int(step)))
        self._last_tick = self._clock()
        return self.position

    def home(self) -> int | None:
        self._go(0)
        self._last_tick = self._clock()
        return self.position

    def end(self) -> int | None:
        self._go(self.index.frames - 1)
        self._last_tick = self._clock()
        return self.position

    def next_event(self) -> int | None:
        """Pause at the step of the next event after the position (a run of non-finite events
        counts once, at its first step); returns the new position, None when there is none."""
        return self._jump(+1)

    def previous_event(self) -> int | None:
        return self._jump(-1)

    def _jump(self, direction: int) -> int | None:
        idx = self.index
        here = self.position
        if here is None or not idx.event_count:
            return None
        nonfinite = idx.kind_code("nonfinite")
        if direction > 0:
            k = idx.events_upto(here)
            ks = range(k, idx.event_count)
        else:
            k = idx.events_upto(here - 1)
            ks = range(k - 1, -1, -1)
        for k in ks:
            step = idx.event_steps[k]
            if idx.event_kinds[k] == nonfinite and self._inside_storm(step):
                continue
            target = idx.frame_of(step)
            if target == self._frame:
                continue
            self.pause()
            self._go(target)
            return self.position
        return None

    def _inside_storm(self, step: int) -> bool:
        """True when the step before `step` was a skipped one (so `step` continues a storm)."""
        idx = self.index
        frame = idx.frame_of(step)
        return frame > 0 and idx.steps[frame] == step and bool(idx.flags[frame - 1] & F_SKIPPED) \
            and idx.steps[frame - 1] == step - 1

    def tick(self) -> bool:
        """Advance playback by the time elapsed since the last tick x speed; in follow mode also
        re-read the file (at most every `refresh_interval` s). Returns True if anything changed."""
        now = self._clock()
        version = self._version
        if self.follow and now - self._last_refresh >= self.refresh_interval:
            self._last_refresh = now
            was_at_end = self.at_end
            shrunk = self.index.shrunk
            if self.index.refresh() or self.index.shrunk != shrunk:
                self._changed()
                if self._frame < 0 and self.index.frames:
                    self._frame = 0
                if was_at_end and self.playing:
                    self._go(self.index.frames - 1)
        if self.playing:
            last, self._last_tick = self._last_tick, now
            if last is not None and now > last:
                advance = (now - last) * self.speed + self._carry
                whole = int(advance)
                self._carry = advance - whole
                if whole:
                    self._go(self._frame + whole)
            if self.at_end and not self.follow:
                self.pause()        # the end of the recording
        return self._version != version

    # ---- the snapshot -------------------------------------------------------------------------
    def _step_record(self, frame: int) -> dict | None:
        r = self._records.get(frame)
        if r is None:
            r = self.index.read_step(frame)
            if r is None:
                return None
            if len(self._records) >= 8:
                self._records.pop(next(iter(self._records)))
            self._records[frame] = r
        return r

    def _stand_in(self, frame: int) -> dict:
        """What the index knows of a step whose record can't be read."""
        idx = self.index
        enc = jsonsafe.encode_float
        flags = idx.flags[frame]
        return {"type": "step", "step": idx.steps[frame], "loss": enc(idx.loss_at(frame)),
                "scale": enc(idx.scale_at(frame)), "skipped": bool(flags & F_SKIPPED),
                "dtype": idx.dtype_at(frame),
                "time": None if math.isnan(idx.times[frame]) else idx.times[frame]}

    def _bad_frame(self, frame: int) -> None:
        if self._bad is not None and self._bad[0] == frame:
            return              # said already: playing on from here is the user's call
        step = self.index.steps[frame]
        self._bad = (frame, f"replay: the record of step {step} can't be read (damaged or changed "
                            "on disk); playback paused")
        self.playing = False
        self._changed()

    def _build(self) -> ReplaySnapshot:
        idx = self.index
        i = self._frame
        names = idx.layer_names
        if i >= 0:
            last = self._step_record(i)
            if last is None:
                self._bad_frame(i)
                last = self._stand_in(i)
            elif self._bad is not None and self._bad[0] != i:
                self._bad = None     # moved on to a readable step
            position = idx.steps[i]
            count = idx.events_shown_at(i)
            history = self._history(i, count)
            layers = self._layers(i, last, names)
            ranks = self._ranks(i, last)
        else:
            ranks = None
            last, position, history = None, None, History()
            layers = LayerView(list(names), [], [], [], None, None)
            count = idx.event_count
        first = max(0, count - EVENT_LIMIT)
        events = [idx.event(k) for k in range(first, count)]
        error = None
        e = bisect.bisect_left(idx.error_events, count) - 1
        if e >= 0:
            error = idx.event(idx.error_events[e])
        return ReplaySnapshot(
            mode=self.mode, header=dict(idx.header), state=self._run_state(i, count), last=last,
            total_steps=idx.frames, steps_per_second=self._rate(i), history=history, layers=layers,
            events=events, events_seen=count, error=error, version=self._version,
            position=position, notice=self._notice(), playback_state=self.playback_state, ranks=ranks,
            in_force=idx.in_force(i, count),
            playing=self.playing, speed=self.speed, following=self.follow, frame=i)

    def _notice(self) -> str | None:
        parts = []
        if self._bad:
            parts.append(self._bad[1])
        skipped = self.index.skipped_summary()
        if skipped:
            parts.append(f"replay: {skipped}")
        if self.index.shrunk:
            parts.append("replay: the session file got shorter while being read; showing what was "
                         "indexed before")
        return "; ".join(parts) or None

    def _history(self, i: int, count: int) -> History:
        idx = self.index
        stride = 1
        while i // stride + 1 > self._points:
            stride *= 2
        stop = i + 1
        steps = idx.steps[0:stop:stride].tolist()
        loss = idx.loss[0:stop:stride].tolist()
        scale = [None if v != v else v for v in idx.scale[0:stop:stride].tolist()]
        if idx.loss_none:
            loss = [None if f & F_LOSS_NONE else v for v, f in zip(loss, idx.flags[0:stop:stride])]
        k = bisect.bisect_right(idx.skipped_frames, i)
        skipped = [idx.steps[j] for j in idx.skipped_frames[max(0, k - MARKER_LIMIT):k]]
        m = bisect.bisect_left(idx.marker_events, count)
        markers = [idx.event_steps[k] for k in idx.marker_events[max(0, m - MARKER_LIMIT):m]]
        return History(steps, loss, scale, skipped, markers, stride)

    def _layers(self, i: int, last: dict | None, names: list[str]) -> LayerView:
        """The figures of the newest probed step <= frame `i` that can be read (a damaged one is
        passed over, a few at most)."""
        idx = self.index
        n = len(names)
        r = None
        j = i + 1
        for _ in range(8):
            j = idx.probed.rfind(1, 0, j)
            if j < 0:
                break
            r = last if j == i else self._step_record(j)
            if r is not None and isinstance(r.get("layers"), dict):
                break
            r = None
        if r is None:
            return LayerView(list(names), [None] * n, [None] * n, [None] * n, None, None)
        layers = r["layers"]
        weight, weight_step = read_floats(layers.get("weight"), n), None
        if "weight" not in layers:
            weight, weight_step = self._last_weights(j, n)
        return LayerView(list(names), read_floats(layers.get("act"), n), read_floats(layers.get("grad"), n),
                         weight, r.get("step"), r.get("dtype"), weight_step, read_floats(layers.get("eta"), n),
                         fp8_rows(layers, n))

    def _last_weights(self, j: int, n: int) -> tuple[list[float | None], int | None]:
        """The weights of the newest probed step before frame `j` that read them (the adaptive
        schedule reads them every few probed steps), and its step; a few dozen looked at at most."""
        idx = self.index
        for _ in range(WEIGHT_LOOKBACK):
            j = idx.probed.rfind(1, 0, j)
            if j < 0:
                break
            r = self._step_record(j)
            layers = r.get("layers") if r is not None else None
            if isinstance(layers, dict) and "weight" in layers:
                return read_floats(layers["weight"], n), r.get("step")
        return [None] * n, None

    def _ranks(self, i: int, last: dict | None) -> RankView | None:
        """A session of several ranks: their figures at the shown step, or at the newest probed
        step before it (which has them)."""
        if world_size_of(self.index.header) < 2:
            return None
        view = rank_view(last) if last is not None else None
        j = self.index.probed.rfind(1, 0, i + 1)
        if view is None and j >= 0:
            r = self._step_record(j)
            view = rank_view(r) if r is not None else None
        return view

    def _rate(self, i: int) -> float:
        if i < 1:
            return 0.0
        idx = self.index
        j = max(0, i - RATE_WINDOW + 1)
        dt = idx.times[i] - idx.times[j]
        if not dt > 0:
            return 0.0
        return (idx.steps[i] - idx.steps[j]) / dt

    def _run_state(self, i: int, count: int) -> RunState:
        idx = self.index
        state = state_after(idx.event(k) for k in itertools.takewhile(lambda k: k < count, idx.state_events))
        if i >= 0:
            state = next_state(state, {"type": "step"})
            if i == idx.frames - 1 and idx.end is not None:
                state = next_state(state, idx.end)
        return state


def run_checkpoints(run_dir: Path) -> list:
    """The checkpoints in a run directory, newest first; none when the folder can't be read."""
    from amp_tui.training.checkpoint import CheckpointError, list_checkpoints
    try:
        return list_checkpoints(run_dir / "checkpoints")
    except (CheckpointError, OSError):
        return []
