"""Per-layer magnitude probes: max |output|, max |gradient|, max |weight| for every module that
owns parameters.

Every figure stays a tensor on the device until `collect()`, which moves all of them to the host in
one transfer: one sync per probed step, never one per tensor. The reductions are grouped
(`amp_tui.training.probes.extremes`): on small models the count of tensor ops costs more than their
arithmetic, so the hooks only keep each output, and the outputs, the gradients and the weights are
each measured in a few calls (`aminmax`, which like max propagates NaN, so a non-finite figure is
itself the non-finite flag).
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from itertools import repeat

import torch

from amp_tui.core.precision import FP16_TINY
from amp_tui.training.compiled import clean_name
from amp_tui.training.probes.extremes import SMALL_NUMEL, MaxAbsPlan, PlanMismatch
from amp_tui.training.probes.op_probe import OpProbe
from amp_tui.training.sharding import dtensor_type, local_tensor

UNMEASURED = None  # a module that did not run, or a parameter without a gradient


@dataclass
class LayerFigures:
    """Host-side figures of one probed step, in layer order (None = not measured)."""

    act: list[float | None]
    grad: list[float | None]
    weight: list[float | None] | None   # None: the weights were not read in this step
    # Layer indices in the order their forward ran first (for "first non-finite layer").
    order: list[int] = field(default_factory=list)
    # Share of nonzero gradient elements fp16 would flush to zero (below 2**-24): as they are
    # (unscaled), and multiplied by the loss scale in use (None without a scaler).
    underflow: list[float | None] | None = None
    underflow_scaled: list[float | None] | None = None
    # Whether any recorded gradient holds inf/NaN (judged on the host, from the extremes).
    grads_nonfinite: bool = False
    # The largest |output| of the ops inside modules' forwards, by "aten.op in module" (op_probe.py;
    # None: not measured this step).
    ops: dict[str, float] | None = None
    # In fp8 (training/fp8/layers.py): each fp8 layer's amax [input, weight, grad_output], what its
    # casts scale by; None for a layer that is not in fp8 (the list None: not in fp8).
    fp8: list[list[float | None] | None] | None = None

    def first_nonfinite(self, kind: str = "act") -> int | None:
        values = getattr(self, kind)
        indices = self.order if kind == "act" else range(len(values))
        for i in indices:
            v = values[i]
            if v is not None and not math.isfinite(v):
                return i
        return None


def _floating_tensors(value, found: list, limit: int = 4) -> None:
    """The first few floating tensors in a module's output (tensors, tuples, dicts, ModelOutputs)."""
    if len(found) >= limit:
        return
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel() > 0:
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _floating_tensors(v, found, limit)
    elif isinstance(value, dict):
        for v in value.values():
            _floating_tensors(v, found, limit)


KEEP_TOTAL_BYTES = 32 << 20   # small outputs kept until the forward ends or they add up to this
PLAN_CACHE = 8                # output plans kept (one per sequence of modules a forward runs)


class _Slots:
    """(min, max) of the larger outputs, written by the hooks into preallocated buffers (one pair
    per dtype and device): no 0-d result allocated per output."""

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int):
        self.lo = torch.zeros(size, dtype=dtype, device=device)
        self.hi = torch.zeros(size, dtype=dtype, device=device)
        self.lo_views, self.hi_views = list(self.lo.unbind()), list(self.hi.unbind())
        self.layers: list[int] = []   # the layer of each slot written this step

    def maxima(self) -> torch.Tensor:
        n = len(self.layers)
        return torch.maximum(self.hi[:n], self.lo[:n].neg()).abs_().double()


class LayerProbe:
    """Watches a model's parameter-owning modules; measures only between begin() and collect().

    The forward hooks stay attached while consecutive steps are probed (attaching and removing
    them every step costs as much as a fifth of the probes); `end()` takes them off. While not
    armed, a hook returns at once.

    An armed hook measures a larger output (over SMALL_NUMEL elements) right there, while it is
    in the cache; it keeps a reference to a small output, and `end_forward()` measures all those
    at once, stacked (the trainer calls it after each forward; otherwise `record_gradients()` or
    `collect()` do). The kept outputs are measured as soon as they add up to KEEP_TOTAL_BYTES,
    so the probe holds no more than that of memory the forward would have freed. The weights and
    the gradients are measured in a few grouped calls each (`record_weights()`,
    `record_gradients()`): one after the other in a tight loop they cost less than spread over
    the forward's hooks (measured: a 24-block model's probed step 0.1-0.3 ms cheaper).

    With `keep_hooks` (a compiled model) `end()` only disarms them and `detach()` takes them off:
    torch.compile traces the hooks into its graph when they are there at the first compile, and
    keeps one graph armed, one disarmed; hooks attached later would never run inside it. Those
    hooks measure each output where it is made, inside the graph, and leave the weights to
    `record_weights()`.
    """

    def __init__(self, model: torch.nn.Module, *, keep_hooks: bool = False):
        self.keep_hooks = keep_hooks
        self._model = model
        self._ops: OpProbe | None = None   # made on the first step that measures the ops
        self.names: list[str] = []
        self._modules: list[torch.nn.Module] = []
        self._params: list[torch.nn.Parameter] = []  # unique, in first-seen order
        self._layer_params: list[list[int]] = []      # layer -> indices into _params
        seen: dict[int, int] = {}
        for name, module in model.named_modules(remove_duplicate=True):
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            self.names.append(clean_name(name) or type(module).__name__)
            self._modules.append(module)
            idx = []
            for p in own:
                if id(p) not in seen:
                    seen[id(p)] = len(self._params)
                    self._params.append(p)
                idx.append(seen[id(p)])
            self._layer_params.append(idx)
        # FSDP2: the parameters are DTensors, and this rank measures its own shards of them and
        # of their gradients (the ranks' maxima are reduced with the step's figures).
        dtensor = dtensor_type()
        self._sharded = dtensor is not None and any(isinstance(p, dtensor) for p in self._params)
        self._handles: list = []
        self._armed = False
        self._untrained: set[int] = set()   # indices into _params the optimizer doesn't step
        self._weight_plan: MaxAbsPlan | None = None
        self._grad_plans: dict = {}          # which parameters have a gradient -> plan
        self._act_plans: dict = {}           # the modules' sequence of kept outputs -> plan
        self._slots: dict[tuple, _Slots] = {}
        # This step's state (begin() resets it).
        self._calls: list[int] = []          # layer of every measured output, in call order
        self._kept: list[torch.Tensor] = []  # small outputs kept by the hooks, not measured yet
        self._kept_layers: list[int] = []
        self._kept_versions: list[int] = []  # each kept output's version counter when kept
        self._kept_bytes = 0
        # Layers whose small outputs a later in-place op changed before end_forward() (a
        # ReLU(inplace=True), `out += x`): measured in their hook from then on.
        self._measure_at_once: set[int] = set()
        self._act_parts: list[torch.Tensor] = []    # per-output maxima (device vectors) ...
        self._act_meta: list[tuple[list[int], int]] = []   # ... the layer of each, and the length
        self._weight_layers: torch.Tensor | None = None
        self._weights_wanted = True
        self._grad: tuple | None = None             # (plan, per-layer maxima, judged maximum)
        self._under: tuple | None = None            # (plan, per-layer count sums, scaled?)

    def set_untrained(self, params) -> None:
        """Parameters the optimizer doesn't hold: still measured, but a non-finite gradient of
        theirs updates nothing, so it doesn't count in `grads_nonfinite`."""
        untrained = {id(p) for p in params}
        self._untrained = {i for i, p in enumerate(self._params) if id(p) in untrained}
        self._grad_plans = {}

    @property
    def active(self) -> bool:
        return self._armed

    @contextlib.contextmanager
    def disarmed(self):
        """The hooks idle for a forward that is not the step's own (a replay of it under the op
        tracer), whose outputs must not count in the step's figures."""
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._armed = armed

    def owned_ids(self) -> set[int]:
        """id() of every parameter the probed modules own."""
        return {id(p) for p in self._params}

    def begin(self, *, weights: bool = True, ops: bool = False) -> None:
        """Start probing a step: unprobed steps (with the hooks off) pay nothing. `weights`:
        read the weights too (they change little from one step to the next). `ops`: the ops
        inside modules' forwards too (op_probe.py), after the layers' hooks are on."""
        self._weights_wanted = weights
        self._calls.clear()
        self._kept.clear()
        self._kept_layers.clear()
        self._kept_versions.clear()
        self._kept_bytes = 0
        for slots in self._slots.values():
            slots.layers.clear()
        self._act_parts, self._act_meta = [], []
        self._weight_layers = None
        self._grad = self._under = None
        if self._weight_plan is None:
            self._plan_weights()
        self._armed = True
        if not self._handles:
            make = self._make_traced_hook if self.keep_hooks else self._make_hook
            self._handles = [m.register_forward_hook(make(i)) for i, m in enumerate(self._modules)]
        if ops:
            if self._ops is None:
                self._ops = OpProbe(self._model)
            self._ops.begin()

    def end(self) -> None:
        """Take the hooks off the model (the next begin() puts them back); with `keep_hooks`,
        only disarm them."""
        self._armed = False
        self._kept.clear()   # a forward that raised leaves outputs unmeasured: let them go
        self._kept_layers.clear()
        self._kept_versions.clear()
        self._kept_bytes = 0
        if self._ops is not None:
            self._ops.detach()
        if not self.keep_hooks:
            self.detach()

    def detach(self) -> None:
        """Take the hooks off the model, whatever `keep_hooks` says."""
        self._armed = False
        if self._ops is not None:
            self._ops.detach()
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- activations ----------------------------------------------------------------------
    def _make_hook(self, index: int):
        kept, kept_layers, versions, calls = self._kept, self._kept_layers, self._kept_versions, self._calls
        at_once = self._measure_at_once

        def hook(_module, _inputs, output):
            if not self._armed:
                return
            if type(output) is not torch.Tensor:   # tuples, dicts, ModelOutputs: the generic walk
                found: list = []
                _floating_tensors(output, found)
                for t in found:
                    self._take(index, t)
                return
            if not output.is_floating_point():
                return
            n = output.numel()
            if n > SMALL_NUMEL or not n or self._kept_bytes > KEEP_TOTAL_BYTES or index in at_once:
                self._take(index, output)
                return
            calls.append(index)   # the common case, inline: this runs for every module
            kept.append(output)
            kept_layers.append(index)
            versions.append(output._version)
            self._kept_bytes += output.nbytes
        return hook

    def _take(self, index: int, t: torch.Tensor) -> None:
        """Measure an output now (a larger one, while it is in the cache), or keep it for
        end_forward() (after measuring the kept ones, once they add up to KEEP_TOTAL_BYTES)."""
        n = t.numel()
        if not n:
            return
        if self._kept_bytes > KEEP_TOTAL_BYTES:
            self.end_forward()
        self._calls.append(index)
        if n <= SMALL_NUMEL and index not in self._measure_at_once:
            self._kept.append(t)
            self._kept_layers.append(index)
            self._kept_versions.append(t._version)
            self._kept_bytes += t.nbytes
            return
        key = (t.dtype, t.device)
        slots = self._slots.get(key)
        if slots is None or len(slots.layers) == len(slots.lo_views):
            if slots is not None:   # more outputs than slots: twice as many from now on
                self._act_parts.append(slots.maxima())
                self._act_meta.append((list(slots.layers), len(slots.layers)))
            size = 2 * len(slots.lo_views) if slots is not None else 2 * len(self._modules) + 8
            slots = self._slots[key] = _Slots(t.dtype, t.device, size)
        k = len(slots.layers)
        torch.aminmax(t.detach(), out=(slots.lo_views[k], slots.hi_views[k]))
        slots.layers.append(index)

    def _make_traced_hook(self, index: int):
        """For a compiled model: each output measured where it is made, inside the graph."""
        def hook(_module, _inputs, output):
            if not self._armed:
                return
            found: list = []
            _floating_tensors(output, found)
            for t in found:
                lo, hi = torch.aminmax(t.detach())
                self._calls.append(index)
                self._act_parts.append(torch.maximum(hi, lo.neg()).abs_().double().reshape(1))
                self._act_meta.append(([index], 1))
        return hook

    def end_forward(self) -> None:
        """Measure the small outputs the hooks kept, and let them go (the trainer calls this
        after each forward; record_gradients() and collect() do when it wasn't)."""
        if not self._kept:
            return
        outputs, layers = list(self._kept), list(self._kept_layers)
        changed = [k for k, (t, v) in enumerate(zip(outputs, self._kept_versions)) if t._version != v]
        self._kept.clear()
        self._kept_layers.clear()
        self._kept_versions.clear()
        self._kept_bytes = 0
        if changed:
            # What the module returned is gone: this step has no figure from those outputs
            # (rather than another module's), and their hooks measure them at once from now on.
            self._measure_at_once.update(layers[k] for k in changed)
            keep = [k for k in range(len(outputs)) if k not in set(changed)]
            outputs, layers = [outputs[k] for k in keep], [layers[k] for k in keep]
            if not outputs:
                return
        key = tuple(layers)
        with torch.no_grad():
            plan = self._act_plans.get(key)
            try:
                if plan is None:
                    raise PlanMismatch("no plan yet")
                values = plan.measure(outputs)
            except PlanMismatch:
                if len(self._act_plans) >= PLAN_CACHE:
                    self._act_plans.clear()
                plan = self._act_plans[key] = MaxAbsPlan(outputs)
                plan.layers = [layers[p] for p in plan.order]
                values = plan.measure(outputs)
        self._act_parts.append(values)
        self._act_meta.append((plan.layers, len(plan.order) + 1))

    # ---- gradients and weights ---------------------------------------------------------------
    def record_gradients(self, scale: float | None = None, *, underflow: bool = True) -> None:
        """Call after unscale_ (and before clipping): the true gradients' extremes and (with
        `underflow`) the underflow counts, still on the device."""
        self.end_forward()
        grads = [local_tensor(p.grad) for p in self._params] if self._sharded else [p.grad for p in self._params]
        # One no_grad() for all (a gradient built with create_graph would otherwise record).
        with torch.no_grad():
            plan, values = self._measure_grads(grads)
            judged = None
            if plan.any_judged:   # the pad (0) changes no maximum
                judged = (values.index_select(0, plan.judged) if plan.judged is not None else values).amax()
            self._grad = (plan, plan.fold(values), judged)
            self._under = None
            if underflow and plan.order:
                # Per parameter: nonzero count, count below 2**-24, count below 2**-24 / scale;
                # summed per layer. The comparisons count zeros too; the host subtracts them.
                limits = [FP16_TINY, FP16_TINY / scale] if scale else [FP16_TINY]
                self._under = (plan, plan.fold(plan.count(grads, limits), how="sum"), bool(scale))

    def _measure_grads(self, grads: list):
        # (`None in grads` would compare every tensor to None with ==.)
        key = tuple(g is not None for g in grads) if any(map(operator.is_, grads, repeat(None))) else None
        plan = self._grad_plans.get(key)
        try:
            if plan is None:
                raise PlanMismatch("no plan yet")
            return plan, plan.measure(grads)
        except PlanMismatch:
            if len(self._grad_plans) >= PLAN_CACHE:
                self._grad_plans.clear()
            plan = self._grad_plans[key] = MaxAbsPlan(grads, self._layer_params, device=self._device())
            judged = [k for k, p in enumerate(plan.order) if p not in self._untrained]
            plan.any_judged = bool(judged)
            plan.judged = (torch.tensor(judged, dtype=torch.long, device=plan.device)
                           if len(judged) < len(plan.order) else None)
            return plan, plan.measure(grads)

    def _device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    def _weights(self) -> list[torch.Tensor]:
        return [local_tensor(p) for p in self._params] if self._sharded else self._params

    def _plan_weights(self) -> None:
        self._weight_plan = MaxAbsPlan(self._weights(), self._layer_params, device=self._device())

    def record_weights(self) -> None:
        """Call before the optimizer step, so the weights are those this step's forward used."""
        if self._weight_layers is not None or not self._weights_wanted:
            return
        with torch.no_grad():
            try:
                if self._weight_plan is None:
                    raise PlanMismatch("no plan yet")
                values = self._weight_plan.measure(self._weights())
            except PlanMismatch:
                self._plan_weights()
                values = self._weight_plan.measure(self._weights())
            self._weight_layers = self._weight_plan.fold(values)

    # ---- to the host ----------------------------------------------------------------------------
    def collect(self, extra: list[torch.Tensor] = ()) -> tuple[LayerFigures, list[float]]:
        """Bring every figure (and `extra` scalars) to the host in one transfer, and disarm."""
        self.end_forward()
        self._armed = False
        self.record_weights()
        for slots in self._slots.values():
            if slots.layers:
                self._act_parts.append(slots.maxima())
                self._act_meta.append((list(slots.layers), len(slots.layers)))
                slots.layers.clear()
        n_layers = len(self._modules)
        grad, under = self._grad, self._under
        with torch.no_grad():
            # One cat, one transfer; float64 keeps the scale, counts above 2**24 and every
            # dtype's extremes exact.
            parts = [torch.stack([t.reshape(()).double() for t in extra])] if extra else []
            parts += self._act_parts
            weights = self._weight_layers
            if weights is not None:
                parts.append(weights)
            if grad is not None:
                parts.append(grad[1])
                if grad[2] is not None:
                    parts.append(grad[2].reshape(1))
            if under is not None:
                parts.append(under[1].reshape(-1))
            host = torch.cat(parts).tolist() if parts else []
        n_extra = len(extra)
        extra_host, pos = host[:n_extra], n_extra
        act: list[float | None] = [UNMEASURED] * n_layers
        for layers, size in self._act_meta:
            for layer, v in zip(layers, host[pos:pos + size]):   # (the pad has no layer)
                seen = act[layer]
                act[layer] = v if seen is None or seen < v or v != v else seen   # NaN wins
            pos += size
        weight = None
        if weights is not None:
            weight = _read_layers(host, pos, self._weight_plan)
            pos += n_layers
        grads, nonfinite = [UNMEASURED] * n_layers, False
        if grad is not None:
            grads = _read_layers(host, pos, grad[0])
            pos += n_layers
            if grad[2] is not None:
                nonfinite = not math.isfinite(host[pos])
                pos += 1
        underflow = underflow_scaled = None
        if under is not None:
            plan, _, scaled = under
            rows = host[pos:pos + (3 if scaled else 2) * n_layers]
            nonzero = rows[:n_layers]
            underflow = _shares(nonzero, rows[n_layers:2 * n_layers], plan.layer_numel)
            if scaled:
                underflow_scaled = _shares(nonzero, rows[2 * n_layers:], plan.layer_numel)
        figures = LayerFigures(act=act, grad=grads, weight=weight, order=list(dict.fromkeys(self._calls)),
                               underflow=underflow, underflow_scaled=underflow_scaled,
                               grads_nonfinite=nonfinite,
                               ops=self._ops.collect() if self._ops is not None and self._ops.active else None)
        self._act_parts, self._act_meta = [], []
        return figures, extra_host


def _read_layers(host: list[float], pos: int, plan: MaxAbsPlan) -> list[float | None]:
    """One figure per layer from the host copy of `plan.fold(...)`; None where nothing was measured."""
    out: list[float | None] = host[pos:pos + len(plan.layer_numel)]
    for i in plan.missing:
        out[i] = UNMEASURED
    return out


def _shares(nonzero: list[float], below: list[float], numel: list[int]) -> list[float | None]:
    """Per layer: flushed-to-zero count / nonzero count (the counts below a limit include the
    zeros: numel - nonzero of them)."""
    return [(b - (n - nz)) / nz if nz else None for nz, b, n in zip(nonzero, below, numel)]
