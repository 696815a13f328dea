"""What the dashboard reads: one `Source` protocol, implemented by a live run (`LiveSource`), a
replay (`ReplaySource`) and an attached job (`AttachedSource`), and the `Snapshot` they give.

Nothing here imports Textual, torch or the job: a source is read through this interface alone.
A recording's playback controls are a protocol of their own (`Playback`), which a source offers
through its `playback` attribute (None for a run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from amp_tui.core.records import InForce, Mode, RunState

if TYPE_CHECKING:
    from amp_tui.core.commands import Command

# A recording's playback: "following" is at the end of a session still being written, waiting
# for more.
PlaybackState = Literal["playing", "paused", "following"]

HISTORY_POINTS = 2048
EVENT_LIMIT = 1000
MARKER_LIMIT = 2048


@dataclass
class History:
    """Chart series, decimated to at most HISTORY_POINTS points."""

    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    scale: list[float | None] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)      # markers: updates not applied
    intervention_steps: list[int] = field(default_factory=list)  # markers: interventions/restores
    stride: int = 1

    def copy(self) -> "History":
        return History(list(self.steps), list(self.loss), list(self.scale), list(self.skipped_steps),
                       list(self.intervention_steps), self.stride)


@dataclass
class LayerView:
    """The newest per-layer figures (from the last probed step)."""

    names: list[str]
    act: list[float | None]
    grad: list[float | None]
    weight: list[float | None]
    step: int | None
    dtype: str | None
    # The step `weight` was read at, when that is an earlier probed step than `step` (the
    # adaptive schedule reads the weights on some probed steps only); None: at `step`.
    weight_step: int | None = None
    # The headroom forecast of `step`: each layer's steps left before the dtype's max (None: no
    # trend; empty: the step forecast none).
    eta: list[float | None] = field(default_factory=list)
    # In fp8: each layer's amax [input, weight, grad_output] as its fp8 casts took them (None: the
    # layer is not in fp8); empty when the step ran no layer in fp8.
    fp8: list[list[float | None] | None] = field(default_factory=list)


@dataclass
class RankView:
    """The newest per-rank figures of a run with several ranks (from the last step that has
    them: a probed one, or a non-finite one)."""

    step: int | None
    loss: list[float | None]
    step_time: list[float | None]   # seconds up to the step's first collective


@dataclass
class Snapshot:
    mode: Mode
    header: dict
    state: RunState                 # what the run is doing (a replay: was doing at `position`)
    last: dict | None               # newest step record
    total_steps: int | None
    steps_per_second: float
    history: History
    layers: LayerView
    events: list[dict]              # newest last, capped
    events_seen: int                # total events fed so far (to find new ones)
    error: dict | None              # the newest error event with a traceback
    version: int                    # bumps on every fed record
    position: int | None = None     # replay: the step shown
    notice: str | None = None       # replay: e.g. "3 damaged lines skipped"
    playback_state: PlaybackState | None = None  # replay: its playback; None for a run
    ranks: RankView | None = None   # several ranks: each one's newest figures (world size: header)
    # What the run trains with: its dtype, the modules in fp32, the loss scale's floor
    # (core/records.py's reducer over the records shown).
    in_force: InForce = field(default_factory=InForce)


class Playback(Protocol):
    """A recording's playback: what the replay keys move."""

    playing: bool
    speed: float                    # steps per second

    @property
    def total_steps(self) -> int: ...

    @property
    def position(self) -> int | None: ...

    def playback_text(self) -> str: ...

    def toggle(self) -> bool: ...

    def faster(self) -> float: ...

    def slower(self) -> float: ...

    def step_by(self, n: int) -> int | None: ...

    def seek(self, step: int) -> int | None: ...

    def home(self) -> int | None: ...

    def end(self) -> int | None: ...

    def next_event(self) -> int | None: ...

    def previous_event(self) -> int | None: ...


class Source(Protocol):
    """What the dashboard needs of whatever it shows."""

    mode: Mode
    can_steer: bool                 # it takes commands (a live run, an attached job)
    detaches: bool                  # q leaves the job running (attach); else q stops it
    playback: Playback | None       # a recording's playback controls; None for a run
    run_dir: Path | None            # where the run's files are
    session_path: Path | None
    output_path: Path | None        # the job's own output (stdout and stderr), if kept

    def snapshot(self) -> Snapshot: ...

    def send(self, command: Command) -> tuple[bool, str]:
        """Ask for an intervention: (accepted, message). A replay refuses with a reason."""

    def checkpoints(self) -> list:
        """The run's checkpoints, newest first (CheckpointInfo-like: path, step, dtype, kind)."""

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        """Stop at a step boundary and flush; False if it did not stop within `timeout`, or if
        the stop was held because the disk refuses records (`held_stop()` says what would be
        lost). `give_up_unwritten`: stop even so."""

    def held_stop(self) -> str | None:
        """Why the last stop was held (records a full disk refused), or None."""
