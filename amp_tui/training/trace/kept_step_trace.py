"""A failing step of the user's own loop replayed under the op tracer from what ForwardKeeper kept
(training/trace/forward_keeper.py): the first aten op that made inf or NaN, and the remedy tried on it,
in the same event fields as `amp-tui train` gives (training/trace/step_trace.py).

Each kept forward is run again on the model (its original module, eagerly, under torch.compile)
with the inputs, RNG state and autocast dtype it had. Its backward starts from what reached the
model in the step: the gradient of the model's own loss (`op_replay_from: "loss"`), or the
gradients that flowed into its outputs from the loop's loss code (`"outputs"`); with neither, or
with gradients the broken forward already made non-finite, the forward alone (`"forward"`).

Where the replay can't be the step as it ran, `op_replay_exact` is false and `op_message` says
why: the loop applied the step's update before amp-tui saw the step (no GradScaler skipped it:
there was none, or the gradients were finite, as with an activation a saturating op hid), so the
replay runs on the weights after it; or the loop changed an input in place after the
forward read it. Like every replay it leaves the weights, their `.grad`, the optimizer, the
scaler and the RNG as they were, and never raises: a failure is said in `op_trace_error`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_leaves

from amp_tui.core.precision import autocast_name
from amp_tui.training.compiled import original_module
from amp_tui.training.fp8.whatif import fp8_whatif
from amp_tui.training.trace.forward_keeper import KeptForward, own_loss
from amp_tui.training.trace.op_fix import try_fixes
from amp_tui.training.trace.op_trace import Backward, NoLoss, OpTrace, trace_step
from amp_tui.training.trace.op_xray import xray
from amp_tui.training.trace.step_trace import OP_FIELDS

UPDATE_APPLIED = ("not exact: replayed on the weights after this step's update, which the loop applied "
                  "before amp-tui saw the step (no GradScaler skipped it: none was there, or the gradients "
                  "were finite)")
INPUT_CHANGED = "not exact: the loop changed an input of the forward in place after it ran"
GRADIENT_BROKEN = ("the backward was not replayed: the gradient that reached the model's outputs was "
                   "already non-finite (made from the broken forward, or by the loss code outside the model)")
FORWARD_ONLY_FIX = "the fix is checked on the forward only (no finite gradient of the step to replay the backward from)"


def call_plain(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """`module(*args, **kwargs)` with its class's forward: a forward wrapped in an autocast of its
    own (Accelerate's, or the monitor's in its place) is unwrapped for the call, so that the
    replay's autocast is the one in force (a remedy in bf16 runs in bf16)."""
    own = vars(module).get("forward")
    if own is None or not hasattr(own, "__wrapped__"):
        return module(*args, **kwargs)
    del module.forward
    try:
        return module(*args, **kwargs)
    finally:
        module.forward = own


def _wrapped_in_autocast(module: torch.nn.Module) -> bool:
    return hasattr(vars(module).get("forward"), "__wrapped__")


class _Replayable:
    """One kept forward as a replay takes it: the forward to call, the backward to run after it
    (`backward`), and what that backward starts from (`source`)."""

    def __init__(self, model: torch.nn.Module, kept: KeptForward, step_dtype: str):
        self.kept = kept
        self.model = model
        # The forward's autocast: the one in force as it started, else the one its own wrapper
        # applies (the step's dtype); neither: fp32.
        dtype = kept.autocast if kept.autocast is not None else (
            getattr(torch, autocast_name(step_dtype)) if _wrapped_in_autocast(model) else None)
        self.dtype = None if dtype in (None, torch.float32) else dtype
        if kept.own_loss and kept.loss_grad is not None:
            self.source, grads, self._pick = "loss", [kept.loss_grad], _pick_loss
        elif kept.grads:
            indices = sorted(kept.grads)
            self.source, grads, self._pick = "outputs", [kept.grads[i] for i in indices], _picker(indices)
        else:
            self.source, grads, self._pick = "forward", [], None
        self.gradients_finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if grads and not self.gradients_finite:
            self.source = "forward"
        self.backward: Backward = grads if self.source != "forward" else False

    def forward(self) -> Any:
        output = call_plain(self.model, self.kept.args, self.kept.kwargs)
        return self._pick(output) if self._pick is not None and self.source != "forward" else output


def _pick_loss(output: Any) -> tuple:
    return (own_loss(output),)


def _picker(indices: list[int]) -> Callable[[Any], tuple]:
    def pick(output: Any) -> tuple:
        leaves = tree_leaves(output)
        return tuple(leaves[i] for i in indices)
    return pick


def trace_kept_step(model: torch.nn.Module, forwards: Sequence[KeptForward], *, dtype: str,
                    scale: float | None, device: torch.device, update_applied: bool) -> dict:
    """Replay the kept forwards one by one until one shows the op that made inf or NaN; then try
    the remedies on it. `dtype`: the step's (the autocast a wrapped forward applies); `scale`: the
    loss scale the step's backward used (in the kept gradients already; the bf16 remedy takes it
    off); `update_applied`: the loop's update went through before this replay.

    Returns the event's fields: as `trace_failing_step`'s, with `op_replay_exact` and
    `op_replay_from`."""
    try:
        return _trace(original_module(model), forwards, dtype=dtype, scale=scale, device=device,
                      update_applied=update_applied)
    except Exception as exc:  # noqa: BLE001 - a diagnosis must never stop the loop
        return {"op_trace_error": f"{type(exc).__name__}: {exc}"}


def _trace(model, forwards, *, dtype, scale, device, update_applied) -> dict:
    if not forwards:
        return {"op_message": "not replayed: the model's forward did not run inside this step"}
    trace: OpTrace | None = None
    chosen: _Replayable | None = None
    for kept in forwards:
        chosen = _Replayable(model, kept, dtype)
        trace = trace_step(model, chosen.forward, backward=chosen.backward, scale=scale, dtype=chosen.dtype,
                           device=device, rng=kept.rng)
        if trace.op is not None:
            break
    caveats = []
    if update_applied:
        caveats.append(UPDATE_APPLIED)
    if any(kept.inputs_changed() for kept in forwards):
        caveats.append(INPUT_CHANGED)
    if trace.op is None and not chosen.gradients_finite:
        caveats.append(GRADIENT_BROKEN)
    fields: dict = {k: v for k, v in trace.as_fields().items() if k in OP_FIELDS} if trace.op else {}
    fields["op_replay_exact"] = not (update_applied or INPUT_CHANGED in caveats)
    fields["op_replay_from"] = chosen.source
    if trace.op is not None and chosen.dtype is not None:
        fix = try_fixes(model, chosen.forward, trace, backward=chosen.backward, scale=scale,
                        dtype=chosen.dtype, device=device, rng=chosen.kept.rng)
        fields.update(fix.as_fields())
        if chosen.backward is False:
            caveats.append(FORWARD_ONLY_FIX)
    fields["op_message"] = "; ".join([trace.message, *caveats])
    return fields


def xray_kept(model: torch.nn.Module, kept: KeptForward, *, dtype: str, scale: float | None,
              device: torch.device) -> dict:
    """The X-ray of a forward about to run (kept as it starts, on the weights and RNG state it
    starts from), and of the backward from the model's own loss times `scale` when it returns one
    (`backward_from: "loss"`); else of the forward alone (`backward_from: null`: the loop's loss
    code is out of reach). {"error": ...} when the replay failed (never raised)."""
    return _replay_kept(xray, model, kept, dtype=dtype, scale=scale, device=device)


def fp8_kept(model: torch.nn.Module, kept: KeptForward, *, dtype: str, scale: float | None,
             device: torch.device) -> dict:
    """The fp8 what-if (training/fp8/whatif.py) of a forward about to run, and of its backward as
    `xray_kept` has it: without the model's own loss, no gradient reaches the layers and the
    what-if holds their inputs and weights only."""
    return _replay_kept(fp8_whatif, model, kept, dtype=dtype, scale=scale, device=device)


def _replay_kept(run: Callable[..., dict], model: torch.nn.Module, kept: KeptForward, *, dtype: str,
                 scale: float | None, device: torch.device) -> dict:
    try:
        eager = original_module(model)
        replayable = _Replayable(eager, kept, dtype)
        arguments = {"scale": scale, "dtype": replayable.dtype or "float32", "device": device, "rng": kept.rng}
        try:
            result = run(eager, replayable.forward, backward=True, **arguments)
            result["backward_from"] = "loss"
        except NoLoss:
            result = run(eager, replayable.forward, backward=False, **arguments)
            result["backward_from"] = None
        return result
    except Exception as exc:  # noqa: BLE001 - a replay on request must never stop the loop
        return {"error": f"{type(exc).__name__}: {exc}"}
