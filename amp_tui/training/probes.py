"""Per-layer magnitude probes: max |output|, max |gradient|, max |weight| for every module that
owns parameters.

Every figure stays a tensor on the device until `collect()`, which moves all of them to the host in
one transfer: one sync per probed step, never one per tensor. `aminmax` is used instead of an
inf-norm because it is several times faster on the CPU and, like max, propagates NaN, so a
non-finite figure is itself the non-finite flag. On small models the per-tensor bookkeeping
costs as much as the reductions, hence the in-place buffers and the hooks kept between steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from amp_tui.core.precision import FP16_TINY
from amp_tui.training.compiled import clean_name

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
    # Whether any recorded gradient holds inf/NaN (judged on the host, from the extremes).
    grads_nonfinite: bool = False

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


class _ExtremesTable:
    """(min, max) of up to `size` tensors, written in place into preallocated buffers.

    `aminmax(out=...)` into 0-d views of one buffer pair per (dtype, device) allocates nothing per
    tensor, and leaves no pile of 0-d results to stack (a stack of mixed dtypes costs more than
    the reductions themselves). The buffers live as long as the probe; `reset()` only forgets
    which entries this step wrote.
    """

    def __init__(self, size: int):
        self.size = size
        self._buffers: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]] = {}
        self.key_of: list[tuple | None] = [None] * size  # the buffer holding entry i, this step

    def reset(self) -> None:
        self.key_of = [None] * self.size

    def _views(self, key: tuple):
        views = self._buffers.get(key)
        if views is None:
            lo = torch.zeros(self.size, dtype=key[0], device=key[1])
            hi = torch.zeros(self.size, dtype=key[0], device=key[1])
            views = self._buffers[key] = (list(lo.unbind()), list(hi.unbind()), lo, hi)
        return views

    def measure(self, i: int, t: torch.Tensor) -> None:
        key = (t.dtype, t.device)
        lo, hi, _, _ = self._views(key)
        torch.aminmax(t, out=(lo[i], hi[i]))
        self.key_of[i] = key

    def fold(self, i: int, t: torch.Tensor) -> bool:
        """Widen entry i by `t`'s extremes; False when `t` lives in another buffer than entry i."""
        key = (t.dtype, t.device)
        if self.key_of[i] != key:
            return False
        lo, hi, _, _ = self._buffers[key]
        t_lo, t_hi = torch.aminmax(t)
        torch.minimum(lo[i], t_lo, out=lo[i])  # NaN-propagating, like aminmax
        torch.maximum(hi[i], t_hi, out=hi[i])
        return True

    def _used(self) -> list[tuple]:
        keys = dict.fromkeys(self.key_of)
        keys.pop(None, None)
        return list(keys)

    def device_parts(self) -> list[torch.Tensor]:
        """max|x| = max(hi, -lo) per entry, as float64, one tensor per buffer in use."""
        parts = []
        for key in self._used():
            _, _, lo, hi = self._buffers[key]
            parts.append(torch.maximum(hi, lo.neg()).double())
        return parts

    def read(self, host: list[float], pos: int) -> tuple[list[float | None], int]:
        """Entries from the host copy of device_parts() starting at `pos`; and the next position."""
        base = {}
        for key in self._used():
            base[key] = pos
            pos += self.size
        return [host[base[k] + i] if k is not None else UNMEASURED for i, k in enumerate(self.key_of)], pos


class LayerProbe:
    """Watches a model's parameter-owning modules; measures only between begin() and collect().

    The forward hooks stay attached while consecutive steps are probed (attaching and removing
    them every step costs as much as a fifth of the probes); `end()` takes them off. While not
    armed, a hook returns at once.

    With `keep_hooks` (a compiled model) `end()` only disarms them and `detach()` takes them off:
    torch.compile traces the hooks into its graph when they are there at the first compile, and
    keeps one graph armed, one disarmed; hooks attached later would never run inside it.
    """

    def __init__(self, model: torch.nn.Module, *, keep_hooks: bool = False):
        self.keep_hooks = keep_hooks
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
        n_layers, n_params = len(self._modules), len(self._params)
        self._handles: list = []
        self._armed = False
        self._act = _ExtremesTable(n_layers)
        self._act_more: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # outputs of another dtype
        self._order: list[int] = []
        self._grad = _ExtremesTable(n_params)
        self._weight = _ExtremesTable(n_params)
        self._grads_recorded = False
        self._under: list[torch.Tensor] = []
        self._under_index: list[int] = []
        self._under_numel: list[int] = []
        self._scaled = False
        self._judged = list(range(n_params))  # parameters whose non-finite gradient skips a step

    def set_untrained(self, params) -> None:
        """Parameters the optimizer doesn't hold: still measured, but a non-finite gradient of
        theirs updates nothing, so it doesn't count in `grads_nonfinite`."""
        untrained = {id(p) for p in params}
        self._judged = [i for i, p in enumerate(self._params) if id(p) not in untrained]

    @property
    def active(self) -> bool:
        return self._armed

    def owned_ids(self) -> set[int]:
        """id() of every parameter the probed modules own."""
        return {id(p) for p in self._params}

    def begin(self) -> None:
        """Start probing a step: unprobed steps (with the hooks off) pay nothing."""
        self._act.reset()
        self._act_more = []
        self._order = []
        self._grad.reset()
        self._weight.reset()
        self._grads_recorded = False
        self._under = []
        self._armed = True
        if not self._handles:
            self._handles = [m.register_forward_hook(self._make_hook(i)) for i, m in enumerate(self._modules)]

    def end(self) -> None:
        """Take the hooks off the model (the next begin() puts them back); with `keep_hooks`,
        only disarm them."""
        self._armed = False
        if not self.keep_hooks:
            self.detach()

    def detach(self) -> None:
        """Take the hooks off the model, whatever `keep_hooks` says."""
        self._armed = False
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_hook(self, index: int):
        params = self._layer_params[index]

        def hook(_module, _inputs, output):
            if not self._armed:
                return
            if type(output) is torch.Tensor:  # the common case, without the generic walk
                if not (output.is_floating_point() and output.numel()):
                    return
                found = (output,)
            else:
                found = []
                _floating_tensors(output, found)
                if not found:
                    return
            # detach(): no autograd record, and cheaper than entering no_grad() in every hook.
            first = self._act.key_of[index] is None  # this module's first output this step
            if first:
                self._order.append(index)
                # This module's weights, while its forward has just read them: the same values
                # record_weights() would read after the backward, from a warmer cache.
                weight = self._weight
                for i in params:
                    p = self._params[i]
                    if weight.key_of[i] is None and p.numel():
                        weight.measure(i, p.detach())
            for t in found:
                t = t.detach()
                if first:
                    self._act.measure(index, t)
                    first = False
                elif not self._act.fold(index, t):
                    self._act_more.append((index, *torch.aminmax(t)))
        return hook

    def record_gradients(self, scale: float | None = None, *, underflow: bool = True) -> None:
        """Call after unscale_ (and before clipping): the true gradients' extremes and (with
        `underflow`) the underflow counts, still on the device."""
        grad = self._grad
        grads, index = [], []
        # One no_grad() for all (a gradient built with create_graph would otherwise record).
        with torch.no_grad():
            for i, p in enumerate(self._params):
                g = p.grad
                if g is not None and g.numel():
                    grad.measure(i, g)
                    grads.append(g)
                    index.append(i)
            # Per parameter: nonzero count, count below 2**-24, count below 2**-24 / scale. The
            # comparisons count zeros too; the host subtracts them (numel is known there).
            self._under = []
            # Counting costs four small ops per parameter, more than the extremes: hence optional.
            for g in (grads if underflow else ()):
                a = g.abs()
                self._under.append(torch.count_nonzero(a))
                self._under.append(torch.count_nonzero(a < FP16_TINY))
                if scale:
                    self._under.append(torch.count_nonzero(a < FP16_TINY / scale))
        self._grads_recorded = True
        self._scaled = bool(scale)   # the scaled counts were taken (a scale of 0 counts nothing)
        self._under_index = index if underflow else []
        self._under_numel = [g.numel() for g in grads] if underflow else []

    def record_weights(self) -> None:
        """Call before the optimizer step, so the weights are those this step's forward used.
        Only those of modules whose forward did not run are left to read here."""
        weight = self._weight
        for i, p in enumerate(self._params):
            if weight.key_of[i] is None and p.numel():
                weight.measure(i, p.detach())

    def collect(self, extra: list[torch.Tensor] = ()) -> tuple[LayerFigures, list[float]]:
        """Bring every figure (and `extra` scalars) to the host in one transfer, and disarm."""
        self._armed = False
        self.record_weights()
        if not self._grads_recorded:
            self._grad.reset()
        under = self._under if self._grads_recorded else []
        more = self._act_more
        with torch.no_grad():
            # A few stacks, one transfer; float64 keeps the scale, counts above 2**24 and every
            # dtype's extremes exact.
            parts = [torch.stack([t.reshape(()).double() for t in extra])] if extra else []
            parts += self._act.device_parts() + self._grad.device_parts() + self._weight.device_parts()
            if more:  # rare: a second output of another dtype than the first
                highs = torch.stack([hi.double() for _, _, hi in more])
                lows = torch.stack([lo.double() for _, lo, _ in more])
                parts.append(torch.maximum(highs, lows.neg()))
            if under:
                parts.append(torch.stack(under).double())
            host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist() if parts else []
        n_extra = len(extra)
        extra_host = host[:n_extra]
        act, pos = self._act.read(host, n_extra)
        param_grad, pos = self._grad.read(host, pos)
        param_weight, pos = self._weight.read(host, pos)
        for index, *_ in more:
            act[index] = _absmax([v for v in (act[index], host[pos]) if v is not None])
            pos += 1
        counts: list[list[float] | None] = [None] * len(self._params)
        per = 3 if self._scaled else 2
        for k, i in enumerate(self._under_index if under else []):
            nonzero, *below = host[pos + per * k:pos + per * (k + 1)]
            zeros = self._under_numel[k] - nonzero
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
            grads_nonfinite=not all(math.isfinite(param_grad[i]) for i in self._judged
                                    if param_grad[i] is not None),
        )
        self._act_more, self._under = [], []
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
