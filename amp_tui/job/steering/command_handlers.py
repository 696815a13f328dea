"""The commands that change what a run trains with or keeps: the dtype, the loss scale, a module
in fp32, a checkpoint saved or restored, a note, the probes and an X-ray. Each is one function of the run controller
and the command, whatever drives the steps; the controller's table maps an action to it. The
commands that move the run's own state (pause, resume, step, stop) are the controller's.
"""

from __future__ import annotations

import shlex
from functools import partial

from amp_tui.core import precision
from amp_tui.core.commands import Command, CommandError, Outcome, note_text
from amp_tui.job.records.probe_events import escalate_probes
from amp_tui.job.run_context import RunContext
from amp_tui.job.states import PauseReason
from amp_tui.job.steering.commands import Handler
from amp_tui.training.local_fp32 import ModuleMatchError, match_modules
from amp_tui.training.probes.probe_schedule import dtype_change_reason
from amp_tui.training.step.engine import PrecisionRefused
from amp_tui.training.step.guards import LadderMove


def table(run: RunContext, *, stop: Handler, fix: Handler, undo: Handler) -> dict[str, Handler]:
    """One handler per action: a new command is one entry here (docs/architecture.md). `stop`,
    `fix` and `undo` are the controller's and the autopilot's own."""
    own = {"dtype": set_dtype, "scale": set_scale, "save": save, "restore": restore, "fp32": toggle_fp32,
           "note": note, "pause": pause, "resume": resume, "step": single_step, "probe": set_probes, "xray": xray,
           "fp8": fp8_whatif}
    return {**{action: partial(handler, run) for action, handler in own.items()},
            "stop": stop, "fix": fix, "undo": undo}


def set_dtype(run: RunContext, command: Command) -> Outcome:
    try:
        change = run.training.set_dtype(str(command.value))
    except PrecisionRefused as exc:
        return run.refused(command, f"dtype change refused: {exc}")
    b, a = change["before"], change["after"]
    note = f" (scale {a['scale']:g})" if a.get("scale") is not None else ""
    note += collapsed_scale_note(run) if a["dtype"] != b["dtype"] else ""
    outcome = run.intervention(command, b, a, f"dtype {precision.SHORT[b['dtype']]} → "
                               f"{precision.SHORT[a['dtype']]}{note}")
    # Before the run's first step (`--at 0:dtype=...`) this is the starting dtype, not a change:
    # the first steps are probed anyway.
    if b["dtype"] != a["dtype"] and run.step_index > 0:
        escalate_probes(run, "dtype", dtype_change_reason(b["dtype"], a["dtype"]))
    return outcome


def set_scale(run: RunContext, command: Command) -> Outcome:
    try:
        change = run.precision.set_scale(command.value)
    except PrecisionRefused as exc:
        return run.refused(command, f"scale change refused: {exc}")
    b, a = change["before"], change["after"]
    if b["scale"] is not None and b["dtype"] == "float16":
        text = f"loss scale {b['scale']:g} → {a['scale']:g}"
    else:
        text = f"fp16 loss scale {b['fp16_scale']:g} → {a['fp16_scale']:g} (used when fp16 is next entered)"
    return run.intervention(command, b, a, text)


def save(run: RunContext, command: Command) -> Outcome:
    info = run.save_checkpoint(source=command.source)
    if info is None:
        return Outcome(False, "checkpoint not saved (see the error event)")
    path = run.checkpointing.relative(info.path)
    return run.intervention(command, {}, {"checkpoint": path}, f"checkpoint saved: {path}")


def restore(run: RunContext, command: Command) -> Outcome:
    run.driver.settle()   # the steps the restore undoes are recorded before it
    return run.checkpointing.restore(command)


def toggle_fp32(run: RunContext, command: Command) -> Outcome:
    pattern = str(command.value)
    local = run.local_fp32
    before = {"fp32_modules": local.names}
    try:
        already = set(match_modules(run.driver.fp32_root(), pattern)) & set(local.names)
        changed = local.remove(pattern) if already else local.add(pattern)
        if changed:
            run.training.discard_started_step()   # it ran under the old autocast policy
    except ModuleMatchError as exc:
        return run.refused(command, str(exc))
    verb = "back to autocast" if already else "now in fp32"
    return run.intervention(command, before, {"fp32_modules": local.names},
                            f"{', '.join(changed) or pattern} {verb}{collapsed_scale_note(run)}")


def collapsed_scale_note(run: RunContext) -> str:
    """A fix applied while fp16's loss scale lies collapsed below 1 trains little: its gradients
    underflow at that scale. Said with the fix, with how to set the scale back."""
    scale, start = run.precision.scale, run.precision.starting_scale
    if scale is None or scale >= 1 or run.training.dtype != "float16":
        return ""
    back = f"scale={start:g}" if start is not None and start >= 1 else "scale=65536"
    return (f"; the loss scale is {scale:g}, collapsed by the overflows before: at it the gradients "
            f"underflow, so set it back ({back}) for this fix to train")


def note(run: RunContext, command: Command) -> Outcome:
    """A note of the user's, recorded at this boundary (what changed outside the run). Checked
    here too: a program may submit a Command without the parser."""
    try:
        text = note_text(str(command.value or ""))
    except CommandError as exc:
        return run.refused(command, str(exc))
    who = {"client": command.client} if command.client else {}
    run.event("note", text, text=text, source=command.source, **who)
    return Outcome(True, "note recorded")


def set_probes(run: RunContext, command: Command) -> Outcome:
    """`probe=every` probes every step until `probe=auto` lets the schedule decide again."""
    schedule = run.driver.probe_schedule
    change = schedule.set_mode(str(command.value))
    if change is None:
        return Outcome(True, "probing every step already" if schedule.mode == "every"
                       else f"probing at {schedule.describe_budget()} already")
    who = {"client": command.client} if command.client else {}
    run.event("probes", change.message, mode=change.mode, reason=change.reason, source=command.source, **who)
    return Outcome(True, change.message)


def xray(run: RunContext, command: Command) -> Outcome:
    """`xray`: the next step traced op by op (engine.py before it runs; in the user's own loop as
    its first forward starts: hook_driver.py); its file and event come once the step ran
    (run_records.py, `record_xray`)."""
    if run.ranks:
        return run.refused(command, "the X-ray runs with one process only: a rank alone can't run "
                                    "DDP's collectives in a replay of the step")
    run.driver.request_xray({"source": command.source, **({"client": command.client} if command.client else {})})
    return Outcome(True, f"step {run.step_index} will be X-rayed: its file and event come once it ran")


def fp8_whatif(run: RunContext, command: Command) -> Outcome:
    """`fp8`: the next step's fp8 what-if (training/fp8/whatif.py), at its start as the X-ray is;
    its files and event come once the step ran (run_records.py, `record_fp8`)."""
    if run.ranks:
        return run.refused(command, "the fp8 what-if runs with one process only: a rank alone can't run "
                                    "DDP's collectives in a replay of the step")
    run.driver.request_fp8({"source": command.source, **({"client": command.client} if command.client else {})})
    return Outcome(True, f"step {run.step_index} will be cast to fp8 in a what-if: its files and event come "
                         "once it ran")


def fall_back(run: RunContext, move: LadderMove, source: str = "fallback") -> None:
    """The fallback ladder's move (--on-nonfinite fallback, or the autopilot's: `source`): with
    --rollback, restore the newest checkpoint from before the trouble began first, then the next
    dtype down."""
    if move.rollback_before is not None:
        good = [c for c in run.checkpoints() if c.step is not None and c.step <= move.rollback_before]
        if run.ranks:   # rank 0's listing for every rank: the restore is a collective
            good = run.ranks.share(good[:1])
        if good:
            run.apply(Command("restore", str(good[0].path), source))
        else:
            run.alert("no_checkpoint", f"--rollback: no checkpoint saved at or before step "
                      f"{move.rollback_before}; moving on without one", cause="no checkpoint yet",
                      fix="use --checkpoint-every N")
    change = run.training.set_dtype(move.to_dtype)
    before, after = change["before"], change["after"]
    run.event("intervention", f"{source} {precision.SHORT[before['dtype']]} → "
              f"{precision.SHORT[move.to_dtype]}: {move.reason}", action="dtype",
              value=move.to_dtype, source=source, reason=move.reason, before=before, after=after)
    if before["dtype"] != after["dtype"]:
        escalate_probes(run, "dtype", dtype_change_reason(before["dtype"], after["dtype"]))


# ---- pause, resume, a single step ------------------------------------------------------------
def pause(run: RunContext, command: Command) -> Outcome:
    # The paused state (ctl status, attach) comes with the last step in the file.
    run.driver.settle(flush=True)
    before = {"state": run.state}
    run.single_steps = 0
    run.pause_reason = PauseReason.COMMAND
    run.set_state("paused")
    return run.intervention(command, before, {"state": run.state}, "paused")


def resume(run: RunContext, command: Command) -> Outcome:
    before = {"state": run.state}
    run.single_steps, run.pause_reason = 0, None
    run.set_state("running")
    return run.intervention(command, before, {"state": run.state}, "resumed")


def single_step(run: RunContext, command: Command) -> Outcome:
    if run.state != "paused":
        return run.refused(command, _pause_first(run, command.source))
    run.single_steps += 1
    return run.intervention(command, {"state": run.state}, {"state": run.state}, f"single step {run.step_index}")


def _pause_first(run: RunContext, source: str) -> str:
    """Why a single step was refused, in the terms of whoever asked for it."""
    if source == "dashboard":
        return "single step works while paused (press space first)"
    if source.startswith("ctl"):
        return (f"step works while the job is paused: send pause first "
                f"(amp-tui ctl {shlex.quote(str(run.run_dir))} pause), then step")
    return "a single step works while the run is paused: pause it first"
