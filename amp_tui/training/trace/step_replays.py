"""A guarded step's replays, for GuardedTrainer (training/step/engine.py): the checked second pass
over a bad step (diagnose.py), its op-by-op trace (op_trace.py) and the X-ray of a step about to
run (op_xray.py), and its fp8 what-if (training/fp8/whatif.py). Apart from the step itself: none of
this runs on a healthy step."""

from __future__ import annotations

import contextlib

import torch

from amp_tui.training.fp8.whatif import fp8_whatif
from amp_tui.training.step.autocast import autocast
from amp_tui.training.step.outcome import first_nonfinite_layer
from amp_tui.training.trace.diagnose import Diagnosis, diagnose
from amp_tui.training.trace.isolation import FailedStep
from amp_tui.training.trace.op_trace import RngSnapshot, rng_snapshot
from amp_tui.training.trace.op_xray import xray
from amp_tui.training.trace.step_trace import step_ahead, trace_failing_step

SHARDED_NOT_TRACED = ("not traced to its op: a rank replays the step alone, and a model sharded with FSDP2 "
                      "can't run a forward without the other ranks (each block all-gathers its weights)")


class StepReplays:
    """The replays of GuardedTrainer's steps: a mixin over its model, loss, dtype, device and
    probes (engine.py's attributes of the same names)."""

    def _locate_nonfinite_gradient(self, micro_batches, used_scale, figures):
        """The checked second pass over a skipped step, then the probes' own figures."""
        diagnosis = self._diagnose(micro_batches, used_scale, backward=True)
        first = diagnosis.backward_layer if diagnosis else None
        return first or first_nonfinite_layer(figures, "gradients", self.layer_names), diagnosis

    def _diagnose(self, micro_batches, scale: float | None, *, backward: bool) -> Diagnosis | None:
        """The second, checked pass over a bad step's micro-batches (the first that shows it)."""
        if not self.diagnose_bad_steps:
            return None
        diagnosis = None
        for batch in micro_batches:
            # Sharded: every rank replays the same forwards (each gathers the shards with the
            # others) and no backward (whose gradients go to the unsharded parameters).
            found = diagnose(self.eager_model, lambda batch=batch: self._forward_unchecked(batch, self.eager_model),
                             scale=scale, device=self.device, backward=backward and not self.sharded)
            if diagnosis is None or not (diagnosis.forward_layer or diagnosis.backward_layer):
                diagnosis = found
            if (diagnosis.forward_layer or diagnosis.backward_layer) and not self.sharded:
                break
        self._zero_grad()
        return diagnosis

    def _trace_ops(self, micro_batches, indices, scale: float | None, *, backward: bool = True) -> dict | None:
        """The failing step replayed op by op from the micro-batches at `indices`, with the
        backward as the step ran it (the loss over the micro-batches, times the scale); without it
        (`backward` False) for a non-finite loss, which the forward made.
        Several ranks: each rank replays its own micro-batches on the inner module, not the DDP
        wrapper, and alone: the replay refuses any collective (the others would never join it)."""
        if not self.trace_ops:
            return None
        if self.sharded:
            return {"op_message": SHARDED_NOT_TRACED}
        n = len(micro_batches)
        factor = (scale if scale is not None else 1.0) / n
        self.failed_step = FailedStep(
            self.eager_model, lambda batch: self.loss_fn(self.eager_model, batch),
            [micro_batches[i] for i in indices],
            [self._batch_rng[i] if i < len(self._batch_rng) else None for i in indices], backward=backward,
            scale=None if scale is None and n == 1 else factor, dtype=self.dtype, device=self.device)
        f = self.failed_step
        return trace_failing_step(f.model, f.forward_of, f.batches, f.rngs, scale=f.scale, dtype=f.dtype,
                                  device=f.device, backward=backward)

    def _xray(self, micro_batches, rng: RngSnapshot | None) -> dict:
        """The step about to run, X-rayed on its first micro-batch (`_ahead`)."""
        self._xray_due = False
        return self._ahead(xray, micro_batches, rng)

    def _fp8(self, micro_batches, rng: RngSnapshot | None) -> dict:
        """The fp8 what-if of the step about to run, on its first micro-batch (`_ahead`)."""
        self._fp8_due = False
        return self._ahead(fp8_whatif, micro_batches, rng)

    def _ahead(self, replay, micro_batches, rng: RngSnapshot | None) -> dict:
        """`replay` (op_xray.xray or fp8/whatif.fp8_whatif) of the step about to run, on its first
        micro-batch with the backward as the step runs it (the loss over the micro-batches, times
        the scale); not counted in the step's duration. The probes' hooks idle: a forward run ahead
        may hold their figures."""
        scale, n = self.precision.scale, len(micro_batches)
        rng = rng if rng is not None else rng_snapshot()   # None: the step starts from the RNG now
        with self.probe.disarmed() if self.probe else contextlib.nullcontext():
            return step_ahead(replay, self.eager_model, lambda: self.loss_fn(self.eager_model, micro_batches[0]),
                              rng, scale=None if scale is None and n == 1 else (scale or 1.0) / n,
                              dtype=self.dtype, device=self.device)

    def _forward_unchecked(self, batch, model: torch.nn.Module | None = None):
        with autocast(self.device.type, self.dtype):
            return self.loss_fn(self.model if model is None else model, batch)
