"""Per-layer magnitude probes: max |output|, max |gradient|, max |weight| for every module that
owns parameters.

Every figure stays a tensor on the device until `collect()`, which moves all of them to the host in
one transfer: one sync per probed step, never one per tensor. `aminmax` is used instead of an
inf-norm because it is several times faster on the CPU and, like max, propagates NaN, so a
non-finite figure is itself the non-finite flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from amp_tui.precision import FP16_TINY

UNMEASURED = None  # a module that did not run, or a parameter without a gradient


@dataclass
class LayerFigures:
    """Host-side figures of one probed step, in layer order (None = not measured)."""

    act: list[float | None]
    grad: list[float | None]
    weight: list[float | None]
    # Layer indices in the order their forward ran first (for "first non-finite layer").
    order: list[int] = field(default_factory=list)
    # Share of nonzero gradient elements fp16 would flush to zero (below 2**-24): as they are
    # (unscaled), and multiplied by the loss scale in use (None without a scaler).
    underflow: list[float | None] | None = None
    underflow_scaled: list[float | None] | None = None

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


class LayerProbe:
    """Watches a model's parameter-owning modules; active only between begin() and collect()."""

    def __init__(self, model: torch.nn.Module):
        self.names: list[str] = []
        self._modules: list[torch.nn.Module] = []
        self._params: list[torch.nn.Parameter] = []  # unique, in first-seen order
        self._layer_params: list[list[int]] = []      # layer -> indices into _params
        seen: dict[int, int] = {}
        for name, module in model.named_modules(remove_duplicate=True):
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            self.names.append(name or type(module).__name__)
            self._modules.append(module)
            idx = []
            for p in own:
                if id(p) not in seen:
                    seen[id(p)] = len(self._params)
                    self._params.append(p)
                idx.append(seen[id(p)])
            self._layer_params.append(idx)
        self._handles: list = []
        self._act: list[list[torch.Tensor]] = []
        self._order: list[int] = []
        self._grad: list[torch.Tensor] | None = None
        self._grad_index: list[int] = []
        self._under: list[torch.Tensor] = []
        self._scaled = False
        self._grad_numel: list[int] = []
        self._weights: list[torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def begin(self) -> None:
        """Start probing a step: hooks are attached only now, so unprobed steps pay nothing."""
        self._act = [[] for _ in self._modules]
        self._order = []
        self._grad = None
        self._weights = None
        if not self._handles:
            self._handles = [m.register_forward_hook(self._make_hook(i)) for i, m in enumerate(self._modules)]

    def end(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_hook(self, index: int):
        def hook(_module, _inputs, output):
            found: list[torch.Tensor] = []
            _floating_tensors(output, found)
            if not found:
                return
            if not self._act[index]:
                self._order.append(index)
            with torch.no_grad():
                for t in found:
                    self._act[index].extend(torch.aminmax(t.detach()))
        return hook

    def record_gradients(self, scale: float | None = None, *, underflow: bool = True) -> None:
        """Call after unscale_ (and before clipping): the true gradients' extremes and (with
        `underflow`) the underflow counts, still on the device."""
        grads, index = [], []
        for i, p in enumerate(self._params):
            if p.grad is not None:
                grads.append(p.grad)
                index.append(i)
        with torch.no_grad():
            self._grad = [x for g in grads for x in torch.aminmax(g.detach())]
            # Per parameter: nonzero count, count below 2**-24, count below 2**-24 / scale. The
            # comparisons count zeros too; the host subtracts them (numel is known there).
            self._under = []
            # Counting costs four small ops per parameter, more than the extremes: hence optional.
            for g in (grads if underflow else ()):
                a = g.detach().abs()
                self._under.append(torch.count_nonzero(a))
                self._under.append(torch.count_nonzero(a < FP16_TINY))
                if scale:
                    self._under.append(torch.count_nonzero(a < FP16_TINY / scale))
        self._scaled = scale is not None
        self._grad_numel = [g.numel() for g in grads]
        self._grad_index = index

    def gradient_nonfinite_flag(self) -> torch.Tensor:
        """1.0 on the device when a recorded gradient extreme is inf/NaN (no extra pass)."""
        if not self._grad:
            return torch.zeros((), device=self._params[0].device)
        return (~torch.isfinite(torch.stack(self._grad).float())).any().float()

    def record_weights(self) -> None:
        """Call before the optimizer step, so the weights are those this step's forward used."""
        with torch.no_grad():
            self._weights = [x for p in self._params for x in torch.aminmax(p.detach())]

    def collect(self, extra: list[torch.Tensor] = ()) -> tuple[LayerFigures, list[float]]:
        """Bring every figure (and `extra` scalars) to the host in one transfer."""
        if self._weights is None:
            self.record_weights()
        with torch.no_grad():
            weights = self._weights
            act_counts = [len(a) for a in self._act]
            flat_act = [t for a in self._act for t in a]
            grads = self._grad or []
            under = self._under if self._grad else []
            # Few stacks, one transfer: per-element reshapes and casts would cost more than the
            # reductions. Counts go as float64 so that counts above 2**24 stay exact.
            floats = [t.reshape(()) for t in extra] + flat_act + grads + weights
            parts = [torch.stack(floats).double()] if floats else []
            if under:
                parts.append(torch.stack(under).double())
            host = torch.cat(parts).tolist() if parts else []
        self.end()
        n_extra = len(extra)
        extra_host, pos = host[:n_extra], n_extra
        act: list[float | None] = []
        for count in act_counts:
            act.append(_absmax(host[pos:pos + count]) if count else UNMEASURED)
            pos += count
        param_grad: list[float | None] = [UNMEASURED] * len(self._params)
        for k, i in enumerate(self._grad_index):
            param_grad[i] = _absmax(host[pos + 2 * k:pos + 2 * k + 2])
        pos += len(grads)
        param_weight = [_absmax(host[pos + 2 * i:pos + 2 * i + 2]) for i in range(len(self._params))]
        pos += len(weights)
        counts: list[list[float] | None] = [None] * len(self._params)
        per = 3 if self._scaled else 2
        for k, i in enumerate(self._grad_index if under else []):
            nonzero, *below = host[pos + per * k:pos + per * (k + 1)]
            zeros = self._grad_numel[k] - nonzero
            counts[i] = [nonzero, *(b - zeros for b in below)]
        underflow = _underflow_shares(counts, self._layer_params, 1) if under else None
        underflow_scaled = (_underflow_shares(counts, self._layer_params, 2)
                            if under and self._scaled else None)
        figures = LayerFigures(
            act=act,
            grad=[_group_max(param_grad, idx) for idx in self._layer_params],
            weight=[_group_max(param_weight, idx) for idx in self._layer_params],
            order=list(self._order),
            underflow=underflow,
            underflow_scaled=underflow_scaled,
        )
        self._act, self._grad, self._weights, self._under = [], None, None, []
        return figures, extra_host


def _absmax(values: list[float]) -> float:
    """max |v|, where any NaN wins (it marks the figure non-finite)."""
    out = 0.0
    for v in values:
        if v != v:
            return math.nan
        a = abs(v)
        if a > out:
            out = a
    return out


def _group_max(values: list[float | None], indices: list[int]) -> float | None:
    picked = [values[i] for i in indices if values[i] is not None]
    return _absmax(picked) if picked else None


def _underflow_shares(counts: list[list[float] | None], layers: list[list[int]], which: int):
    """Per layer: flushed-to-zero count / nonzero count over the layer's parameters."""
    out: list[float | None] = []
    for idx in layers:
        rows = [counts[i] for i in idx if counts[i] is not None]
        nonzero = sum(r[0] for r in rows)
        out.append(sum(r[which] for r in rows) / nonzero if nonzero else None)
    return out
