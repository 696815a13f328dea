"""SessionIndex's lookups by frame, step and event, apart from index.py's reading of the file."""

from __future__ import annotations

import bisect

from amp_tui.core.records import InForce, next_in_force
from amp_tui.recording.step_lines import F_LOSS_NONE, F_SCALE_NONE, F_SKIPPED

EVENT_CACHE = 4096             # parsed nonfinite events kept at most (others are always kept)


class SessionIndexLookups:
    """The queries over a `SessionIndex`'s arrays (see index.py for what they hold). Mixed into
    `SessionIndex`, whose `refresh()` builds the arrays; what reads the file again (`_read`) stays there."""

    @property
    def frames(self) -> int:
        """Step records indexed."""
        return len(self.steps)

    @property
    def event_count(self) -> int:
        return len(self.event_steps)

    def event_kind(self, k: int) -> str:
        return self.kinds[self.event_kinds[k]]

    def kind_code(self, kind: str) -> int | None:
        """The code of an event kind in `event_kinds`, None if no such event was indexed."""
        return self._kind_code.get(kind)

    def dtype_at(self, frame: int) -> str:
        return self.dtypes[self.dtype_codes[frame]]

    def loss_at(self, frame: int) -> float | None:
        return None if self.flags[frame] & F_LOSS_NONE else self.loss[frame]

    def scale_at(self, frame: int) -> float | None:
        return None if self.flags[frame] & F_SCALE_NONE else self.scale[frame]

    def skipped_at(self, frame: int) -> bool:
        return bool(self.flags[frame] & F_SKIPPED)

    def frame_of(self, step: int) -> int:
        """The newest frame whose step is <= `step` (0 when `step` is before the first; -1 when
        there is no frame)."""
        n = len(self.steps)
        if n == 0:
            return -1
        if self._steps_sorted:
            return max(bisect.bisect_right(self.steps, step) - 1, 0)
        best = 0
        for i, s in enumerate(self.steps):
            if s <= step:
                best = i
        return best

    def events_before_frame(self, frame: int) -> int:
        """How many events were written before step record `frame` (all of them past the last)."""
        if frame >= len(self.steps):
            return len(self.event_steps)
        return bisect.bisect_right(self.event_frames, frame)

    def events_shown_at(self, frame: int) -> int:
        """How many events a live dashboard had shown right after step record `frame`."""
        return self.events_before_frame(frame + 1)

    def events_upto(self, step: int) -> int:
        """How many events (in file order) have a step <= `step`."""
        if self._events_sorted:
            return bisect.bisect_right(self.event_steps, step)
        return sum(1 for s in self.event_steps if s <= step)

    def event(self, k: int) -> dict:
        """Event `k` (file order) as a dict; nonfinite events are read back from the file (an
        unreadable one becomes a stand-in with the kind and step)."""
        e = self._kept.get(k)
        if e is not None:
            return e
        e = self._cache.get(k)
        if e is None:
            e = self._read(self.event_offsets[k], self.event_lengths[k])
            if e is None or e.get("type") != "event":
                e = {"type": "event", "step": self.event_steps[k], "kind": self.event_kind(k),
                     "message": "(this event could not be read back from the file)"}
            e["step"] = self.event_steps[k]
            if len(self._cache) >= EVENT_CACHE:
                self._cache.clear()
            self._cache[k] = e
        return e

    def in_force(self, frame: int, count: int | None = None) -> InForce:
        """What the run trained with once step record `frame` and the first `count` events (every
        one by default) were written: core/records.py's reducer over the header, the events that
        change it (STATE_EVENTS) and the frame's dtype, in file order (-1: before any step)."""
        count = self.event_count if count is None else count
        in_force = next_in_force(InForce(), self.header)
        stepped = frame < 0 or frame >= len(self.steps)
        for k in self.state_events:
            if k >= count:
                break
            if not stepped and self.event_frames[k] > frame:
                in_force, stepped = next_in_force(in_force, {"type": "step", "dtype": self.dtype_at(frame)}), True
            in_force = next_in_force(in_force, self.event(k))
        if not stepped:
            in_force = next_in_force(in_force, {"type": "step", "dtype": self.dtype_at(frame)})
        return in_force
