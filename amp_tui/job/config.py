"""What a run is asked to do: `amp-tui train`'s options as data, for the command line and for any
program or test that builds a run (`amp_tui.job.build.build_run`).

Some fields are requests that `build_run` settles before the run exists: `device`, `dtype` None
(the resumed checkpoint's dtype, else float16), `resume` (the run directory becomes `run_dir`, the
checkpoint chosen `resume_from`), `repeat_interventions` (added to `at`). A `Run` is handed the
settled config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from amp_tui.core.commands import Command
from amp_tui.core.policies import FSDP_CHECKPOINTS, NONFINITE_POLICIES, FsdpCheckpoint, NonfinitePolicy, checked
from amp_tui.training.probes.probe_options import ProbeOptions
from amp_tui.training.step.guards import GuardConfig


@dataclass
class RunConfig:
    script: Path
    script_argv: list[str] = field(default_factory=list)
    dtype: str | None = None             # None: the resumed checkpoint's dtype, else float16
    init_scale: float = 65536.0
    steps: int | None = None            # iterations to run; a resume counts them from where it goes on
    run_dir: Path | None = None
    checkpoint_every: int | None = None
    probe_every: int | str = "auto"     # "auto": the adaptive schedule (training/probes/probe_schedule.py)
    probe_budget: float = 1.0           # percent of the training time amp-tui may cost (auto)
    probe_alert_bits: float = 3.0       # headroom under which every step is probed (auto)
    underflow_every: int = 10           # underflow shares on every Nth probed step
    fp8_every: int | str | None = None  # the fp8 what-if recurring (job/steering/fp8_schedule.py)
    on_nonfinite: NonfinitePolicy = "skip"   # (core/policies.py; the guard's fallback follows it)
    at: list[tuple[int, Command]] = field(default_factory=list)
    command_line: list[str] = field(default_factory=list)
    guard: GuardConfig = field(default_factory=GuardConfig)
    fp32_modules: list[str] = field(default_factory=list)
    fp8_filter: Path | None = None      # in fp8, which layers convert (module_filter_fn); None: the what-if's
    fsdp: bool = False                   # shard the model with FSDP2's fully_shard (several ranks)
    fsdp_checkpoint: FsdpCheckpoint = "auto"   # how a sharded model is checkpointed
    flush_interval: float = 1.0          # seconds between flushes of step records (events: at once)
    control: bool = False                # serve the control socket (amp-tui ctl / attach); rank 0 only
    device: str | None = None            # cpu, cuda, cuda:N; None: cuda when there is one (ranks: their own)
    resume: Path | None = None           # a run directory to continue in place from its newest valid checkpoint
    repeat_interventions: Path | None = None   # a recording whose interventions apply again at their steps
    # ---- build_run's answers
    resume_from: Path | None = None      # a checkpoint to continue from, appending to the session
    resume_skipped: list[tuple[str, str]] = field(default_factory=list)  # newer ones refused: (path, why)

    @property
    def probes(self) -> ProbeOptions:
        return ProbeOptions.of(probe_every=self.probe_every, probe_budget=self.probe_budget,
                               probe_alert_bits=self.probe_alert_bits, underflow_every=self.underflow_every,
                               fp8_every=self.fp8_every)

    def __post_init__(self) -> None:
        # Checked where the config is made, so a bad word fails before anything is built or recorded.
        _ = self.probes   # the probe options, checked as one (training/probes/probe_options.py)
        self.on_nonfinite = checked("on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        self.fsdp_checkpoint = checked("fsdp_checkpoint", self.fsdp_checkpoint, FSDP_CHECKPOINTS)
