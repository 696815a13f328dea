"""The run as its parts see it: what the autopilot, the forecasts, the command handlers, the
full-disk policy, the probe events and the run's records read and call on it. The run controller
(job/controller.py) implements it; a part is given one and names nothing else of the controller.

The types are named for checkers and readers only (TYPE_CHECKING). The driver, the checkpoints
and the autopilot import parts that are given a RunContext, so naming their types here would be
an import cycle: those three are described in words (their modules say what they hold).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from amp_tui.core.policies import FsdpCheckpoint, NonfinitePolicy

if TYPE_CHECKING:
    import torch

    from amp_tui.core.commands import Command, Outcome
    from amp_tui.core.records import RunState
    from amp_tui.job.ranks.distributed import Ranks
    from amp_tui.job.records.recorder import Recorder
    from amp_tui.job.states import IoPolicy, LoopKind, PauseReason
    from amp_tui.job.steering.commands import CommandQueue
    from amp_tui.training import checkpoint as ckpt
    from amp_tui.training.local_fp32 import LocalFp32
    from amp_tui.training.step.guards import PrecisionGuard
    from amp_tui.training.step.precision_state import PrecisionState


class RunContext(Protocol):
    """One run, for the parts it is composed of (the module docstring says which)."""

    # ---- what it is made of ----------------------------------------------------------------
    driver: Any                  # job/drivers/driver.py's Driver: what runs the steps
    device: torch.device
    ranks: Ranks | None          # several ranks: what they agree on goes through it
    guard: PrecisionGuard
    recorder: Recorder
    commands: CommandQueue
    checkpointing: Any           # job/checkpoints/run_checkpoints.py's RunCheckpoints: save, restore, resume
    autopilot: Any               # job/steering/autopilot.py's Autopilot: --on-nonfinite isolate
    loop: LoopKind               # whose loop runs the steps, in the user's terms

    # ---- its settings ----------------------------------------------------------------------
    run_dir: Path
    session_path: Path
    on_nonfinite: NonfinitePolicy
    io_policy: IoPolicy
    checkpoint_every: int | None
    fsdp_checkpoint: FsdpCheckpoint

    # ---- its state -------------------------------------------------------------------------
    state: RunState
    exit_status: int
    error: str | None
    nonfinite_events: int
    single_steps: int
    pause_reason: PauseReason | None
    stop_requested: threading.Event
    stop_held: threading.Event
    held_message: str | None
    checkpoint_due: str | None
    give_up_unwritten: bool
    unwritten: dict[str, int]
    recording_error: str | None

    @property
    def training(self) -> Any: ...   # job/checkpoints/run_checkpoints.py's TrainingState: what a checkpoint saves

    @property
    def precision(self) -> PrecisionState: ...

    @property
    def local_fp32(self) -> LocalFp32: ...

    @property
    def step_index(self) -> int: ...

    # ---- what it does ----------------------------------------------------------------------
    def event(self, kind: str, message: str, *, step: int | None = None, **fields: Any) -> dict: ...

    def alert(self, reason: str, message: str, *, cause: str, fix: str, step: int | None = None) -> dict: ...

    def fix_words(self, fix: str) -> str: ...

    def apply(self, command: Command) -> Outcome: ...

    def submit(self, command: Command) -> None: ...

    def intervention(self, command: Command, before: dict, after: dict, message: str) -> Outcome: ...

    def refused(self, command: Command, reason: str, **fields: Any) -> Outcome: ...

    def set_state(self, state: RunState) -> None: ...

    def ask_stop(self, *, checkpoint: bool = False, reason: str | None = None) -> None: ...

    def status(self) -> dict: ...

    def save_checkpoint(self, *, source: str) -> ckpt.CheckpointInfo | None: ...

    def checkpoints(self) -> list[ckpt.CheckpointInfo]: ...

    def checkpoint_refused(self, source: str, message: str) -> None: ...

    def saved_extra(self) -> dict: ...

    def pending_records(self) -> dict[str, int]: ...
