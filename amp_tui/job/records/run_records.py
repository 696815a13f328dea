"""What a run writes in its own words, built in one place whatever drives the steps: the session
header, a non-finite step's event and an X-ray's file and event (docs/session-format.md)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from datetime import datetime
from typing import Callable

import torch

import amp_tui
from amp_tui.core import precision
from amp_tui.core.jsonsafe import encode_float
from amp_tui.core.numfmt import number
from amp_tui.core.records import traced_module
from amp_tui.job.run_context import RunContext
from amp_tui.recording.fp8_file import filter_source, fp8_file_name, fp8_filter_name, fp8_message, kept, ready
from amp_tui.recording.xray_file import xray_file_name, xray_message
from amp_tui.training.devices import describe_device
from amp_tui.training.step.calibration import CALIBRATION_SKIPS
from amp_tui.training.step.engine import StepResult


def session_header(controller: RunContext, described: dict) -> dict:
    """The header of a session: the same keys in the same order whatever drives the steps."""
    t, driver = controller.training, controller.driver
    ranks = controller.ranks
    return {
        "amp_tui_version": amp_tui.__version__,
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
        "device": describe_device(controller.device),
        "script": described["script"],
        "argv": list(described["argv"]),
        "command": list(described["command"]),
        "way": controller.loop.way,
        "dtype": t.dtype,
        "init_scale": controller.precision.starting_scale,
        "steps": described.get("steps"),
        "accumulate": described.get("accumulate"),
        "max_grad_norm": described.get("max_grad_norm"),
        "probe_every": described["probe_every"],
        "probe_budget": described.get("probe_budget"),
        "underflow_every": described["underflow_every"],
        "fp8_every": controller.fp8_schedule.every,
        "fp8_filter": described.get("fp8_filter"),   # --fp8-filter (None: a what-if chooses)
        "on_nonfinite": controller.on_nonfinite,
        "checkpoint_every": controller.checkpoint_every,
        "optimizer": type(driver.optimizer).__name__,
        "scheduler": type(t.scheduler).__name__ if t.scheduler is not None else None,
        "parameters": sum(p.numel() for p in driver.model.parameters()),
        "layers": described["layers"],
        "compile": described.get("compile"),
        "fp32_modules": controller.local_fp32.names,
        "guards": dict(vars(controller.guard.config)),
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        **(ranks.header_fields() if ranks else {}),
    }


def nonfinite_message(result: StepResult, words: Callable[[str], str] = str) -> str:
    """A non-finite step in words: what went non-finite, where it started, and what was done;
    then the op that made it and the fix (as `words` puts it for the way of running), where the
    step was replayed op by op."""
    said = _step_message(result)
    op = op_sentence(result.op_trace or {}, words)
    return f"{said}. {op}" if op else said


def op_sentence(fields: dict, words: Callable[[str], str] = str) -> str:
    """The op that made inf or NaN and its fix in words ("" when no op was found, unless the
    replay was not exact: that is always said). `words`: the fix flag as the way of running
    takes it (core/fixes.py, `fix_in_words`)."""
    message = fields.get("op_message") if fields.get("op") or fields.get("op_replay_exact") is False else None
    if not message:
        return ""
    fix = fields.get("fix")
    if fix:
        # In the user's own loop a fix may be checked on the forward alone (op_replay_from).
        step = "this step's forward" if fields.get("op_replay_from") == "forward" else "this step"
        message += f"; fix: {words(fix)} ({f'verified on {step}' if fields.get('fix_verified') else 'not verified'})"
    return message


def _step_message(result: StepResult) -> str:
    layer = result.first_nonfinite_layer
    short = precision.SHORT[result.dtype]
    rank = result.per_rank.nonfinite_rank if result.per_rank is not None else None
    on = f" on rank {rank}" if rank is not None else ""
    outcome = ("amp-tui held the update back" if result.held_back else "update skipped" if result.skipped
               else "the loop applied the update" if result.scale is not None
               else "the loop applied the update (no GradScaler to skip it)")
    if result.nonfinite == "activations":
        return (f"non-finite activation{on} in {short} in {layer}, while the loss and the gradients stayed "
                "finite (an op after it hid it, e.g. a tanh): update applied")
    if result.nonfinite == "loss":
        if layer:
            where = f"; first non-finite output: {layer}"
        elif result.diagnosis is not None and result.diagnosis.input_nonfinite:
            where = "; the model's input was already non-finite (the data, or code before the model)"
        else:
            where = ""
        return f"non-finite loss ({number(result.loss, 4)}){on} in {short}{where}: {outcome}"
    where = f"; first non-finite gradient: {layer}" if layer else ""
    if result.held_back and result.scale is not None:
        return (f"non-finite gradients{on} after the unscale at scale {result.scale:g}, which GradScaler's "
                f"check (made before it) missed{where}: amp-tui held the update back, scale now "
                f"{result.next_scale:g}")
    if result.held_back:
        return (f"non-finite gradients{on} in {short}{where}: amp-tui held the update back (no GradScaler "
                "to skip it)")
    if result.skipped and result.scale is not None:
        return (f"gradients overflowed at scale {result.scale:g}{on}{where}: update skipped, "
                f"scale now {result.next_scale:g}")
    return f"non-finite gradients{on} in {short}{where}: {outcome}"


def calibration_message(result: StepResult) -> str:
    """A skip of GradScaler finding its scale at the start (training/step/calibration.py), said as such."""
    return (f"GradScaler calibrating its scale: the gradients overflowed at scale {result.scale:g}, update "
            f"skipped, scale now {result.next_scale:g} (an fp16 run's first steps find the scale this way; "
            f"calibration skip {result.skipped_total} of at most {CALIBRATION_SKIPS})")


# The non-finite kinds the forward made: --on-nonfinite pause and stop act on them (a gradient
# overflow is GradScaler's to handle).
FORWARD_KINDS = {"loss": "a non-finite loss", "activations": "a non-finite activation"}


def nonfinite_fields(result: StepResult) -> dict:
    layer = result.first_nonfinite_layer
    if result.diagnosis is not None:
        origin = result.diagnosis.as_fields()
    else:   # from the probes' figures: the forward's first non-finite output, or the backward's
        origin = {"origin": layer} if result.nonfinite in FORWARD_KINDS else {"backward_origin": layer}
    traced = traced_module(result.op_trace)
    if traced is not None:   # the op replay saw it happen: its module is the origin, in its pass
        if (result.op_trace or {}).get("op_phase") == "backward":
            origin["backward_origin"] = traced
        else:
            inputs = (result.op_trace or {}).get("op_inputs") or []
            finite = all(isinstance(i.get("max"), (int, float)) for i in inputs)
            origin.update(origin=traced, origin_input_nonfinite=not finite)
    rank = result.per_rank.nonfinite_rank if result.per_rank is not None else None
    return {"where": result.nonfinite, "layer": layer, "loss": encode_float(result.loss),
            "scale": result.scale, "dtype": result.dtype, **origin,
            **({"rank": rank} if rank is not None else {}), **({"held_back": True} if result.held_back else {}),
            **(result.op_trace or {})}


def record_replays(run: RunContext, result: StepResult) -> None:
    """What was asked of the step just ended: its X-ray and its fp8 what-if."""
    if result.xray is not None:
        record_xray(run, result.step, result.xray, run.driver.xray_by)
    if result.fp8 is not None:
        # The what-if that chose fp8's layers names who asked for one that step, else itself.
        entry = result.fp8_layers is not None and result.fp8_layers["whatif_step"] == result.step
        unasked = entry and not result.fp8_layers["asked"]
        record_fp8(run, result.step, result.fp8, {"source": "fp8 entry"} if unasked else run.driver.fp8_by)
    if result.fp8_layers is not None:
        record_fp8_layers(run, result.step, result.fp8_layers)


def record_fp8_layers(run: RunContext, step: int, entered: dict) -> None:
    """The step that entered fp8: which layers it converted, and the filter that chose them."""
    layers = entered["layers"]
    # The --fp8-filter file, or the one the what-if that chose emitted.
    source = entered["source"] or fp8_filter_name(entered["whatif_step"])
    run.event("fp8_layers", f"fp8: {len(layers)} of {entered['linear']} Linear layers train in fp8 "
              f"(filter: {source})", step=step, layers=layers, filter=source)


def record_xray(run: RunContext, step: int, xray: dict, by: dict | None = None) -> None:
    """The X-ray of `step` (StepResult.xray) as JSON in the run directory, then its event naming
    the file and the op closest to its dtype's max, and who asked for it (`by`: the command's
    `source` and `client`)."""
    name = xray_file_name(step)
    by = by or {}
    if not _write_on_request(run, step, "xray", "X-ray", {name: json.dumps(xray, indent=1, allow_nan=False)}
                             if "error" not in xray else {}, xray.get("error"), by):
        return
    first = (xray.get("closest") or [{}])[0]
    run.event("xray", xray_message(step, xray), step=step, path=name, dtype=xray.get("dtype"),
              op=first.get("op"), op_module=first.get("module"), op_phase=first.get("phase"),
              headroom_bits=first.get("headroom_bits"), **by)


def record_fp8(run: RunContext, step: int, whatif: dict, by: dict | None = None) -> None:
    """The fp8 what-if of `step` (StepResult.fp8) as JSON in the run directory, with the filter
    it implies for torchao beside it, then the `fp8` event naming both and who asked (`by`)."""
    name, filter_name = fp8_file_name(step), fp8_filter_name(step)
    by = by or {}
    files = {} if "error" in whatif else {
        filter_name: filter_source(whatif, step=step, run=run.run_dir.name),
        name: json.dumps({**whatif, "step": step, "filter": filter_name}, indent=1, allow_nan=False)}
    if not _write_on_request(run, step, "fp8", "fp8 what-if", files, whatif.get("error"), by):
        return
    run.event("fp8", fp8_message(step, whatif), step=step, path=name, filter=filter_name,
              dtype=whatif.get("dtype"), ready=len(ready(whatif)), kept=sorted(kept(whatif)), **by)


def _write_on_request(run: RunContext, step: int, during: str, what: str, files: dict[str, str],
                      error: str | None, by: dict) -> bool:
    """Files asked of a step, each written whole or not at all (a temporary file renamed: a reader
    never finds half of one). False, with an `error` event naming who asked, when the replay
    failed or a file can't be written."""
    asked = {"source": by["source"]} if "source" in by else {}   # an error names its source only
    if error is not None:
        run.event("error", f"{what} of step {step} failed: {error}", step=step, during=during, **asked)
        return False
    for name, text in files.items():
        path = run.run_dir / name
        temporary = path.with_name(f".{name}.tmp")
        try:
            temporary.write_text(text, encoding="utf-8")
            os.replace(temporary, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            run.event("error", f"{what} of step {step} not written: {exc.strerror or exc}: {path}", step=step,
                      during=during, **asked)
            return False
    return True


def status_snapshot(run, *, pid: int) -> dict:
    """The run now, for `amp-tui ctl RUN status` (read from another thread: plain values only).
    `run` is the run controller (job/controller.py): its settings and last step as well."""
    t, r = run.training, run.last_result
    # The counts before the step: the training thread moves the step on before it counts it.
    return {"state": run.state, "step": run.step_index, "steps": run.steps, "dtype": t.dtype,
            "scale": run.precision.scale, "updates": t.updates_applied, "skipped": t.skipped_total,
            "loss": encode_float(r.loss) if r is not None else None, "pid": pid,
            "run_dir": str(run.run_dir), "script": str(run.script),
            "probes": run.driver.probe_schedule.status_field(),
            **(run.ranks.header_fields() if run.ranks else {})}
