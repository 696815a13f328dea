"""The guarded trainer's fp8 (`--dtype fp8`): torchao's Float8Linear on the chosen layers, entered
and left at step boundaries, and each fp8 layer's amax on probed steps.

Which layers: `--fp8-filter FILE`, or else the fp8 what-if of the first fp8 step, run on its batch
just before it (its verdict and torchao's shape rule: the filter file it emits). Leaving fp8 (`d`,
`ctl RUN dtype=bf16`) puts the layers back as they were, their weights as fp8 trained them.
"""

from __future__ import annotations

from amp_tui.core.precision import canonical
from amp_tui.training.fp8.layers import Fp8Layers, load_filter
from amp_tui.training.fp8.whatif import fp8_whatif
from amp_tui.training.step.precision_state import PrecisionRefused

FP8_SHARDED = ("fp8 under FSDP2 is not switched live: convert the model with torchao's "
               "convert_to_float8_training before fully_shard, and run it in bf16")
# Each rank would run its own what-if, and could choose other layers than the others.
FP8_RANKS_UNCHOSEN = ("fp8 with several ranks needs --fp8-filter FILE, the same layers on every rank "
                      "(amp-tui fp8 SCRIPT writes one from a what-if)")


class Fp8Training:
    """Mixed into GuardedTrainer (engine.py), which holds `precision`, `eager_model`, `device`,
    `sharded` and StepReplays' `_ahead`."""

    def _init_fp8(self, fp8_filter: str | None) -> None:
        filter_fn = load_filter(fp8_filter) if fp8_filter else None
        self.fp8 = Fp8Layers(self.eager_model, self.device, filter_fn, source=fp8_filter)
        self._fp8_entry: dict | None = None      # what the step entering fp8 tells the record
        self._fp8_fp32: tuple | None = None      # the fp32 modules fp8 last followed
        if self.precision.dtype == "float8" and self.sharded:
            raise PrecisionRefused(FP8_SHARDED)

    def _fp8_refuses(self, dtype: str) -> str:
        """Before a dtype change: fp8 refused where it can't be switched; the dtype it leaves."""
        if canonical(dtype) == "float8":
            if self.sharded:
                raise PrecisionRefused(FP8_SHARDED)
            if self.agree_finite is not None and not self.fp8.chosen:
                raise PrecisionRefused(FP8_RANKS_UNCHOSEN)
        return self.precision.dtype

    def _fp8_switched(self, old: str) -> None:
        """After the precision changed: out of fp8 at once; into it at the next step's start."""
        if old == "float8" and self.fp8.active:
            self.fp8.leave()

    def _fp8_before_step(self, batch) -> None:
        """At a step's start, before anything runs its forward: in fp8, the layers converted (the
        first time, the what-if on `batch` choosing them when no filter file did), and following
        the fp32 modules."""
        if self.precision.dtype != "float8":
            return
        if not self.fp8.active:
            whatif, asked = None, False
            if not self.fp8.chosen:
                # This what-if is the step's own: one asked of it too (request_fp8) is this one.
                asked, self._fp8_due = self._fp8_due, False
                whatif = self._ahead(fp8_whatif, [batch], None)
                if "error" in whatif:
                    raise PrecisionRefused(f"the fp8 what-if that chooses the layers failed: {whatif['error']}")
                self.fp8.choose(whatif["verdict"], self.step_index)
            linear = len(self.fp8.candidates())
            layers = self.fp8.enter()
            self._fp8_entry = {"layers": layers, "source": self.fp8.source, "whatif_step": self.fp8.whatif_step,
                               "whatif": whatif, "asked": asked, "linear": linear}
            self._fp8_fp32 = tuple(self.fp8.kept_out())
            return
        fp32 = tuple(self.fp8.kept_out())
        if fp32 != self._fp8_fp32:
            self._fp8_fp32 = fp32
            self.fp8.sync()

    def _fp8_measure(self) -> None:
        # Under torch.compile, hooks put on and taken off each probed step would recompile it.
        if self.fp8.active and not self.compiled_modules:
            self.fp8.measure()

    def _fp8_close(self, result) -> None:
        """The step's fp8 amax with its figures and, on the step that entered fp8, what it
        entered with."""
        amax = self.fp8.read_amax()
        if amax and result.figures is not None:
            result.figures.fp8 = [amax.get(name) for name in self.layer_names]
        entry, self._fp8_entry = self._fp8_entry, None
        if entry is not None:
            whatif = entry.pop("whatif")
            if whatif is not None:
                result.fp8 = whatif
            result.fp8_layers = entry
