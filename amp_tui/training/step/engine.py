"""The guarded mixed-precision step, usable on its own from a user's loop.

Order of one iteration, as PyTorch's AMP recipe has it, with the guards around it:
zero_grad(set_to_none=True) -> autocast around loss_fn only -> finite-loss check ->
scaler.scale(loss).backward() -> scaler.unscale_ -> gradient figures -> optional clipping ->
scaler.step -> scaler.update -> scheduler only when the update was really applied.
With several ranks the finite-loss check is agreed across them while the backward runs, and
a step whose loss was not finite on any rank throws that backward's gradients away.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from amp_tui.training.compiled import compiled_module_names, original_module
from amp_tui.training.probes.hidden_activation import HiddenActivationWatch
from amp_tui.training.probes.layer_probes import LayerFigures, LayerProbe
from amp_tui.training.probes.probe_options import ProbeOptions
from amp_tui.training.probes.probe_schedule import observe_step
from amp_tui.training.sharding import full_value, is_sharded
from amp_tui.training.step.fp8_training import Fp8Training
from amp_tui.training.step.loss_check import LossError, check_loss
from amp_tui.training.step.outcome import CountedSteps, StepOutcomes, first_nonfinite_layer
from amp_tui.training.step.precision_state import OwnedScaling, PrecisionRefused
from amp_tui.training.step.step_result import StepResult
from amp_tui.training.step.update_guard import mark_unscaled_nonfinite, nonfinite_flag, unscale_untrusted
from amp_tui.training.trace.isolation import FailedStep
from amp_tui.training.trace.op_trace import RngSnapshot, rng_snapshot
from amp_tui.training.trace.step_replays import StepReplays

# A rank replays alone, and an FSDP2 forward can't: each block all-gathers its weights from every rank.
__all__ = ["GuardedTrainer", "LossError", "PrecisionRefused", "StepResult", "check_loss", "to_host"]

ACT_UNMEASURED_UNDER_COMPILE = (
    "act not measured under torch.compile: the compiled graph runs without amp-tui's hooks (it was "
    "compiled before they were attached, e.g. by a call in setup()); gradients and weights are "
    "measured")


EVERY_STEP = ProbeOptions(every=1)   # the engine alone probes every step; a run says otherwise


@dataclass
class _StartedStep:
    batch: Any             # the micro-batch the forward ran on (step() checks it is the same)
    loss: torch.Tensor     # with its graph, for the step's backward
    seconds: float         # the forward's time, counted in the step's duration
    rng: RngSnapshot       # the generators before that forward, for a replay of it


class GuardedTrainer(CountedSteps, StepReplays, Fp8Training):
    """One guarded optimizer update per `step()`; dtype and scale can change between steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        *,
        device: str | torch.device = "cpu",
        dtype: str = "float16",
        init_scale: float = 65536.0,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        probe: bool = True,
        probes: ProbeOptions = EVERY_STEP,
        diagnose: bool = True,
        trace_ops: bool = True,
        fp8_filter: str | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        # torch.compile: the probes and the diagnosis look at the module the user wrote.
        self.eager_model = original_module(model)
        self.compiled_modules = compiled_module_names(model)
        # FSDP2: each rank holds shards; what is judged from gradients must be agreed.
        self.sharded = is_sharded(model)
        self.probe = LayerProbe(self.eager_model, keep_hooks=bool(self.compiled_modules)) if probe else None
        # Set once a probed step of a compiled model ran none of the hooks: its graph was
        # compiled before they were attached, and activations can't be measured inside it.
        self.act_unmeasured: str | None = None
        self.probe_schedule = probes.schedule(self.probe.names) if probe else None
        self.underflow_every = probes.underflow_every   # in probed steps
        self.diagnose_bad_steps = diagnose
        # A non-finite step replayed under the op tracer; the RNG state each micro-batch started
        # from is kept for it (5 KB copied, about 3 µs, per micro-batch: docs/performance.md).
        self.trace_ops = trace_ops
        self._batch_rng: list[RngSnapshot] = []
        self._xray_due = False   # request_xray(): the next step is traced op by op first
        self._fp8_due = False    # request_fp8(): the next step's Linear layers cast to fp8 first
        self.failed_step: FailedStep | None = None   # the last step traced, until the next one starts
        self._hidden = HiddenActivationWatch()
        # Several ranks: the finite-loss check agreed by all of them. Called with the loss, it
        # starts the check and returns its answer to wait for (True: finite on every rank),
        # which the step asks for after the micro-batch's backward.
        self.agree_finite: Callable[[float], Callable[[], bool]] | None = None
        self.precision = OwnedScaling(self.device, dtype, init_scale)
        self._init_fp8(fp8_filter)   # --dtype fp8: the layers torchao trains in fp8 (fp8_training.py)
        self.outcomes = StepOutcomes()   # the step counter and the counts (outcome.py)
        self._started: _StartedStep | None = None  # a forward run ahead by start_step()
        self._sort_parameters()

    def _sort_parameters(self) -> None:
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # Parameters the optimizer steps but no probed module owns: their gradients still need
        # the device-side non-finite check when the probes judge the rest on the host.
        owned = self.probe.owned_ids() if self.probe else set()
        self._unprobed_params = [p for p in self._params if id(p) not in owned]
        # Trainable parameters the optimizer doesn't hold: they get gradients and train nothing.
        # GradScaler.unscale_ doesn't reach them and optimizer.zero_grad doesn't clear them, so
        # both happen here, for their figures to be each step's true gradient like the others'.
        held = {id(p) for p in self._params}
        self.untrained_params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in held]
        if self.probe:
            self.probe.set_untrained(self.untrained_params)

    def compile_info(self) -> dict | None:
        """What torch.compile changes in the figures (None: nothing in the model is compiled)."""
        if not self.compiled_modules:
            return None
        measured = self.probe is not None and self.act_unmeasured is None
        return {"modules": list(self.compiled_modules), "act": "in_graph" if measured else "not_measured",
                "diagnosis": "eager"}

    # ---- precision policy ---------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        return self.probe.names if self.probe else []

    @property
    def dtype(self) -> str:
        return self.precision.dtype

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def scale(self) -> float | None:
        return self.precision.scale

    @property
    def init_scale(self) -> float:
        return self.precision.starting_scale

    def set_dtype(self, dtype: str) -> dict:
        """Switch autocast dtype at a step boundary; returns {"before", "after"} for the record."""
        old = self._fp8_refuses(dtype)
        change = self.precision.set_dtype(dtype)
        if change["before"] != change["after"]:
            self._fp8_switched(old)
            self.discard_started_step()  # it ran under the old dtype
        return change

    def set_scale(self, value: float | str) -> dict:
        """Set the loss scale (a number, or "half"); also the init_scale for the next fp16 entry."""
        return self.precision.set_scale(value)

    def clamp_scale(self, value: float) -> None:
        self.precision.clamp(value)

    def describe_precision(self) -> dict:
        return self.precision.describe()

    # ---- checkpoint state ---------------------------------------------------------------
    def scaler_state(self) -> dict | None:
        return self.precision.scaler_state()

    def checkpoint_extra(self) -> dict:
        return {**self.precision.checkpoint_fields(),
                "updates_applied": self.updates_applied, "skipped_total": self.skipped_total}

    def restore_scaler(self, state: dict | None) -> None:
        self.precision.restore_scaler(state)
        self.calibration.end()

    # ---- the guarded step ---------------------------------------------------------------
    def probing_next(self) -> bool:
        return self.probe is not None and self.probe_schedule.probing(self.step_index)

    def _begin_probe(self) -> None:
        schedule = self.probe_schedule
        self.probe.begin(weights=schedule.weights_due(),
                         ops=not self.compiled_modules and schedule.ops_due(self.dtype))
        self._fp8_measure()

    def start_step(self, batch: Any) -> torch.Tensor:
        """Run the next step's forward on `batch` now, and keep it: when step() is then given
        `batch` as its first micro-batch, it goes on from this forward instead of calling
        loss_fn again. amp-tui's pre-flight check is this forward, so loss_fn runs exactly as
        often, on the same state, as in a plain loop. Raises what the forward raises (LossError
        for a loss that is not a scalar), keeping nothing."""
        self.discard_started_step()
        self._fp8_before_step(batch)
        started = time.perf_counter()
        rng = rng_snapshot()
        probe = self.probe if self.probing_next() else None
        if probe:
            self._begin_probe()
        try:
            loss = self._forward(batch)
        except BaseException:
            if probe:
                probe.end()
            raise
        self._started = _StartedStep(batch, loss, time.perf_counter() - started, rng)
        return loss

    def discard_started_step(self) -> None:
        """Forget the forward start_step() kept: the precision or the weights changed since, so
        the step runs its forward again."""
        self._started = None

    def request_xray(self) -> None:
        """X-ray the next step: before it runs, its first micro-batch's forward and backward once
        more under the op tracer, from the same RNG state (the replay leaves the weights, their
        gradients and the RNG as they were), into `StepResult.xray`."""
        self._xray_due = True

    def request_fp8(self) -> None:
        """The fp8 what-if of the next step (training/fp8/whatif.py): before it runs, its first
        micro-batch's forward and backward once more with every nn.Linear's tensors cast to fp8,
        from the same RNG state, into `StepResult.fp8`."""
        self._fp8_due = True

    def step(self, micro_batches: Sequence[Any]) -> StepResult:
        """One iteration over `micro_batches` (already on the device): one update attempt."""
        if not micro_batches:
            raise ValueError("step() needs at least one micro-batch")
        ahead, self._started = self._started, None
        if ahead is not None and ahead.batch is not micro_batches[0]:
            ahead = None  # kept for another batch
        if ahead is None:
            self._fp8_before_step(micro_batches[0])
        rng = ahead.rng if ahead is not None else None
        xray = self._xray(micro_batches, rng) if self._xray_due else None
        fp8 = self._fp8(micro_batches, rng) if self._fp8_due else None
        self.failed_step = None
        started = time.perf_counter()
        self._batch_rng = [ahead.rng] if ahead is not None else []
        probe = self.probe if self.probing_next() else None
        if probe and ahead is None:
            self._begin_probe()  # (start_step began it for its forward)
        elif probe is None and self.probe is not None:
            self.probe.end()   # the hooks kept on for this step, which the boundary took off the schedule
        try:
            result = self._step(micro_batches, probe, ahead.loss if ahead is not None else None)
        except BaseException:
            if probe:
                probe.end()
            self.fp8.read_amax()
            raise
        result.duration = time.perf_counter() - started + (ahead.seconds if ahead is not None else 0.0)
        result.xray, result.fp8 = xray, fp8
        self._fp8_close(result)
        if probe and self.compiled_modules and result.figures is not None and not result.figures.order:
            self.act_unmeasured = self.act_unmeasured or ACT_UNMEASURED_UNDER_COMPILE
        if self.probe_schedule is not None:
            observe_step(self.probe_schedule, result, planned=probe is not None)
        if probe and not self.probing_next():
            probe.end()  # the hooks stay on only while the next step is probed too
        return result

    def close(self) -> None:
        """Leave the user's model as it was given: no hooks of ours on it."""
        self.discard_started_step()
        if self.probe:
            self.probe.detach()

    def _forward(self, batch):
        loss = check_loss(self._forward_unchecked(batch))
        if self.probe is not None and self.probe.active:
            self.probe.end_forward()   # the outputs its hooks kept, measured now and let go
        return loss

    def _step(self, micro_batches, probe: LayerProbe | None, first_loss: torch.Tensor | None) -> StepResult:
        """One update attempt, in the order of PyTorch's AMP recipe (see the module docstring)."""
        used_scale = self.precision.scale
        lr = self._lr_in_use()
        self._zero_grad()
        losses, bad = self._forward_and_backward(micro_batches, first_loss)
        mean_loss = sum(losses) / len(losses)
        n = len(micro_batches)
        if bad is not None:
            return self._skip_nonfinite_loss(micro_batches, bad, mean_loss, used_scale, lr, probe)
        self._unscale(used_scale)
        found_inf = self._measure_gradients(probe, used_scale)
        # Sharded: the total norm over every rank's shards (a DTensor), the same on every rank.
        grad_norm = (full_value(torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm))
                     if self.max_grad_norm is not None else None)
        if probe:
            probe.record_weights()  # before the update: the weights this step's forward used
        extra = [grad_norm] if grad_norm is not None else []
        if self.scaler is not None:
            skipped, figures, host = self._update_with_scaler(probe, used_scale, extra)
        else:
            skipped, figures, host = self._update_unscaled(probe, found_inf, extra)
        if grad_norm is not None:
            grad_norm = host[-1]
        if skipped and figures is None:
            figures = self._unplanned_gradient_figures(used_scale)
        if not skipped and self.scheduler is not None:
            self.scheduler.step()   # only after an update really applied: skipped steps don't count
        # GradScaler finding its scale at the start is no failure: nothing to locate or replay.
        nonfinite, calibrating = self.outcomes.classify(loss_finite=True, skipped=skipped,
                                                        scale=used_scale if self.scaler is not None else None)
        if nonfinite:
            first, diagnosis = self._locate_nonfinite_gradient(micro_batches, used_scale, figures)
        elif not calibrating and (first := self._hidden_activation(figures)) is not None:
            nonfinite, diagnosis = "activations", None
        else:
            first, diagnosis = None, None
        # A hidden activation is found in the forward, replayed on the weights after the update.
        op_trace = self._trace_ops(micro_batches, range(n), used_scale, backward=skipped) if nonfinite else None
        return self._finish(mean_loss, used_scale, lr, skipped=skipped, nonfinite=nonfinite, first_layer=first,
                            figures=figures, micro=n, grad_norm=grad_norm, diagnosis=diagnosis,
                            op_trace=op_trace, calibration=calibrating)

    def _forward_and_backward(self, micro_batches, first_loss: torch.Tensor | None):
        """Autocast forward and scaled backward of each micro-batch, stopping once a loss is
        known not to be finite. Returns the losses seen and the index of the micro-batch whose loss
        was not, or None.

        One process: it is known at once, and that batch gets no backward (it would only spread
        the inf/NaN). Several ranks (`agree_finite`): the check goes round while the backward runs
        on every rank whatever its own loss, and is answered after it (where DDP's gradient
        all-reduce carries it, after the step's last micro-batch); a non-finite loss only makes
        non-finite gradients, which the skip then throws away. Waiting before the backward would
        make the check a meeting point of its own, ahead of DDP's all-reduce in the backward."""
        n = len(micro_batches)
        losses: list[float] = []
        first_bad = None   # this rank's first micro-batch whose loss was not finite
        for i, batch in enumerate(micro_batches):
            if self.trace_ops and len(self._batch_rng) <= i:
                self._batch_rng.append(rng_snapshot())
            with self._gradient_sync(i == n - 1):
                loss = first_loss if i == 0 and first_loss is not None else self._forward(batch)
                value = float(loss.detach().float())  # the one sync the finite-loss check needs
                losses.append(value)
                if self.agree_finite is None:
                    if not math.isfinite(value):
                        return losses, i
                    self._backward(loss, n)
                    continue
                if first_bad is None and not math.isfinite(value):
                    first_bad = i
                finite_everywhere = self.agree_finite(value)   # started; answered after the backward
                self._backward(loss, n)
                if not finite_everywhere():
                    # Every rank learns it here and stops alike. An answer can come a micro-batch
                    # or more after the loss that caused it (one carried by the gradients' own
                    # all-reduce comes with the last): the batch diagnosed is the one that failed.
                    return losses, first_bad if first_bad is not None else i
        return losses, None

    def _backward(self, loss: torch.Tensor, micro: int) -> None:
        scaled = loss / micro if micro > 1 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()

    def _gradient_sync(self, last: bool):
        """DistributedDataParallel all-reduces the gradients in the last micro-batch's backward
        only (no_sync for the others), where unscale_ and the update then see them."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None and not last else contextlib.nullcontext()

    def _skip_nonfinite_loss(self, micro_batches, bad: int, mean_loss, used_scale, lr, probe) -> StepResult:
        """No update: the gradients (of the backward several ranks ran) go, and nothing of the
        scaler moves (no unscale_, step or update). Then find where the forward went non-finite."""
        self._zero_grad()
        self.outcomes.classify(loss_finite=False, skipped=True, scale=used_scale)   # calibration is over
        figures = probe.collect()[0] if probe else None
        diagnosis = self._diagnose([micro_batches[bad]], used_scale, backward=False)
        # Several ranks: one whose own losses were finite skips because another's were not, and
        # has nothing to replay; the rank that saw it replays on its own.
        own = not math.isfinite(mean_loss)
        op_trace = self._trace_ops(micro_batches, [bad], used_scale, backward=False) if own else None
        first = diagnosis.forward_layer if diagnosis else None
        # Not when the data brought the inf/NaN in: the probes' first non-finite output was handed it.
        if first is None and not (diagnosis and diagnosis.input_nonfinite):
            first = first_nonfinite_layer(figures, "loss", self.layer_names)
        return self._finish(mean_loss, used_scale, lr, skipped=True, nonfinite="loss", first_layer=first,
                            figures=figures, micro=len(micro_batches), diagnosis=diagnosis, op_trace=op_trace)

    def _unscale(self, used_scale: float | None) -> None:
        """Gradients back to their true size before anything reads or clips them."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            self._unscale_untrained(used_scale)
            if unscale_untrusted(used_scale):   # GradScaler's check came before the unscale
                mark_unscaled_nonfinite(self.scaler, self.optimizer, self.device)

    def _measure_gradients(self, probe: LayerProbe | None, used_scale: float | None):
        """The per-layer gradient figures (probed steps), and where nothing else judges them in
        bf16/fp32 (unprobed steps, parameters no probed module owns), a device-side flag that is
        1 when a gradient holds inf/NaN."""
        if probe:
            underflow = self.probe_schedule.underflow_due(self.step_index, self.underflow_every)
            probe.record_gradients(used_scale, underflow=underflow)
        # Sharded: the flag over every shard, which the DTensor op all-reduces (a rank's own
        # figures see its shards only, and the ranks must skip alike).
        if self.scaler is None and (self._unprobed_params or not probe or self.sharded):
            params = self._unprobed_params if probe and not self.sharded else self._params
            return nonfinite_flag([p.grad for p in params if p.grad is not None], self.device)
        return None

    def _update_with_scaler(self, probe, used_scale: float, extra: list):
        """fp16: GradScaler steps (or skips) and moves the scale; a fused optimizer is called even
        on overflow, so the step counts as skipped when the scale dropped, not by whether the
        optimizer ran. The figures and the new scale come to the host in one transfer."""
        self.scaler.step(self.optimizer)
        self.scaler.update()
        figures, host = probe.collect([self.scaler._scale, *extra]) if probe \
            else (None, to_host([self.scaler._scale, *extra]))
        new_scale = host.pop(0)
        self.precision.observed_scale(new_scale)
        return new_scale < used_scale, figures, host

    def _update_unscaled(self, probe, found_inf, extra: list):
        """bf16/fp32: nothing skips for us, so a non-finite gradient is checked before stepping,
        from the probes' figures or the flag, in the same one transfer."""
        flags = [found_inf] if found_inf is not None else []
        figures, host = probe.collect(flags + extra) if probe else (None, to_host(flags + extra))
        skipped = ((found_inf is not None and host.pop(0) > 0)
                   or bool(figures and figures.grads_nonfinite and not self.sharded))
        if not skipped:
            self.optimizer.step()
        return skipped, figures, host

    def _unplanned_gradient_figures(self, used_scale: float | None) -> LayerFigures | None:
        """A skipped step that was not probed: its gradients (unscaled, never applied) and the
        weights are still there, until the diagnosis or the next step zeroes them. Its
        activations are gone. With several ranks, only planned steps are gathered."""
        if self.probe is None or self.agree_finite is not None:
            return None
        self.probe.begin()
        self.probe.record_gradients(used_scale, underflow=False)
        figures, _ = self.probe.collect()
        self.probe.end()
        return figures

    def _hidden_activation(self, figures: LayerFigures | None) -> str | None:
        """A non-finite activation the loss never saw, when that is news (hidden_activation.py).
        Several ranks: not looked for (this rank's figures alone would make the step non-finite on
        this rank only)."""
        return None if self.agree_finite is not None else self._hidden.news(figures, self.layer_names)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.untrained_params:
            p.grad = None

    def _unscale_untrained(self, scale: float) -> None:
        grads = [p.grad for p in self.untrained_params if p.grad is not None]
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, 1.0 / scale)  # as GradScaler.unscale_ does for the rest

    def _lr_in_use(self):
        """The first param group's lr as this step's update uses it: read before the scheduler
        moves it on for the next step."""
        lr = self.optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            return lr.detach().clone()  # schedulers update a tensor lr in place
        return lr

    def _finish(self, loss, scale, lr, *, skipped, nonfinite, first_layer, figures, micro,
                grad_norm=None, diagnosis=None, op_trace=None, calibration=False):
        return self.outcomes.close(
            skipped=skipped, applied=not skipped, lr=lr, loss=loss, scale=scale, dtype=self.dtype,
            micro_batches=micro, nonfinite=nonfinite, first_nonfinite_layer=first_layer, grad_norm=grad_norm,
            figures=figures, diagnosis=diagnosis, next_scale=self.scale, op_trace=op_trace, calibration=calibration)

def to_host(tensors: list[torch.Tensor]) -> list[float]:
    """One-element tensors (a loss in any float dtype, the float32 scale, flags) as floats. On
    an accelerator in one transfer (cat promotes them to the widest dtype among them, which holds
    each exactly); on the CPU, where reading a value is no transfer, one by one, cheaper than
    building the cat."""
    if len(tensors) == 1 or tensors[0].device.type == "cpu":
        return [t.item() for t in tensors]
    return torch.cat([t.reshape(1) for t in tensors]).tolist()
