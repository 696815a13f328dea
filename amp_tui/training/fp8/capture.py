"""What the fp8 what-if captures of one step (whatif.py): the tensors of its GEMMs, as they reach
them.

- `LinearCapture`: every nn.Linear, the layer torchao converts: its first call's input and weight,
  and the gradient that reaches its output, kept and measured together by shape after the
  backward (tensor_rows.py).
- `MatmulCapture`: the matmuls a module computes in its own forward, outside any nn.Linear
  (attention's `q @ k.transpose(-2, -1)` and `attn @ v`, a head tied to the embedding through
  `F.linear`, GPT-2's `Conv1D`, an `addmm`), and `F.scaled_dot_product_attention`'s two, computed
  from its q, k and v (forward only: its backward is one fused op). torchao converts none of
  them; the rows say what fp8 attention, or a converted projection, would meet.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from amp_tui.training.fp8.tensor_rows import forward_groups, forward_rows, gradient_groups, gradient_rows
from amp_tui.training.local_fp32 import named_modules


@contextlib.contextmanager
def measuring(device_type: str):
    """Our own arithmetic on the captured tensors: no graph, no autocast, and unseen by a
    torch-function mode (the matmul capture's)."""
    with torch.no_grad(), torch.autocast(device_type, enabled=False), torch._C.DisableTorchFunction():
        yield


@dataclass
class _Seen:
    """One Linear's tensors of the step (its first call in it)."""
    module: torch.nn.Module | None = None   # until its output's gradient came
    low: torch.dtype | None = None          # the autocast dtype its forward ran in
    calls: int = 0
    rows: list[dict] = field(default_factory=list)


# The captured tensors kept for measuring together, at most: past it they are measured at once.
PENDING_BYTES = 256 << 20


class LinearCapture:
    """Hooks on every nn.Linear of the model: the first call's input and weight as its GEMM sees
    them, and the gradient that reaches its output. They are kept, and measured together by
    shape (`flush`, after the backward; sooner when PENDING_BYTES are held)."""

    def __init__(self, model: torch.nn.Module, device_type: str, scale: float | None):
        self.device_type = device_type
        self.unscale = 1.0 / scale if scale else 1.0
        self.seen: dict[str, _Seen] = {}
        self.shapes: dict[str, list[int]] = {}
        self._handles = []
        self._pending: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {"forward": [], "gradient": []}
        self._pending_bytes = 0
        for name, module in named_modules(model).items():
            if isinstance(module, torch.nn.Linear):
                self.shapes[name] = list(module.weight.shape)
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def flush(self) -> None:
        """Measure what is kept: GEMMs of one shape together (tensor_rows.py)."""
        for kind, measure in (("forward", forward_groups), ("gradient", gradient_groups)):
            groups: dict[tuple, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
            for name, a, b in self._pending[kind]:
                groups.setdefault((a.shape, b.shape, a.dtype, b.dtype, a.device), []).append((name, a, b))
            with measuring(self.device_type):
                for group in groups.values():
                    for (name, _, _), rows in zip(group, measure([(a, b) for _, a, b in group])):
                        self.seen[name].rows += rows
            self._pending[kind] = []
        self._pending_bytes = 0

    def _keep(self, kind: str, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        self._pending[kind].append((name, a, b))
        self._pending_bytes += a.numel() * a.element_size()
        if self._pending_bytes > PENDING_BYTES:
            self.flush()

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            seen = self.seen.setdefault(name, _Seen())
            seen.calls += 1
            if seen.calls > 1 or not args or not isinstance(args[0], torch.Tensor):
                return
            low = torch.get_autocast_dtype(self.device_type) if torch.is_autocast_enabled(self.device_type) else None
            seen.low = low
            self._keep("forward", name, _as_run(args[0], low), _as_run(module.weight, low).t())
            if isinstance(output, torch.Tensor) and output.requires_grad:
                seen.module = module
                output.register_hook(self._grad_hook(name))
        return hook

    def _grad_hook(self, name: str):
        def hook(grad):
            seen = self.seen[name]
            if seen.module is not None:
                # A copy: autograd may reuse the gradient it hands a hook once the hook returns.
                kept = _unscaled(grad, self.unscale) if self.unscale != 1 else grad.detach().clone()
                self._keep("gradient", name, kept, _as_run(seen.module.weight, seen.low).t())
                seen.module = None
        return hook


def _unscaled(grad: torch.Tensor, unscale: float) -> torch.Tensor:
    return grad.detach() * unscale if unscale != 1 else grad.detach()


def _as_run(tensor: torch.Tensor, low: torch.dtype | None) -> torch.Tensor:
    """A tensor as the layer's GEMM took it: cast to the autocast dtype where one was in force."""
    tensor = tensor.detach()
    return tensor.to(low) if low is not None and tensor.is_floating_point() else tensor


# The functions whose two operands make one GEMM (output = a @ b), by the name their rows take.
MATMULS = {torch.matmul: "matmul", torch.Tensor.matmul: "matmul", torch.Tensor.__matmul__: "matmul",
           torch.bmm: "bmm", torch.Tensor.bmm: "bmm", torch.mm: "mm", torch.Tensor.mm: "mm",
           F.linear: "linear"}
# ... and those that add a third: (input, a, b) -> input + a @ b (GPT-2's Conv1D is an addmm).
ADD_MATMULS = {torch.addmm: "addmm", torch.Tensor.addmm: "addmm", torch.baddbmm: "baddbmm",
               torch.Tensor.baddbmm: "baddbmm"}


@dataclass
class _Frame:
    """A module call on the way down the forward: whether it is the module's first, and how many
    of each matmul it has made so far."""
    name: str
    module: torch.nn.Module
    first: bool
    counts: dict[str, int] = field(default_factory=dict)


class MatmulCapture(TorchFunctionMode):
    """The matmuls of each module's first call, outside nn.Linear: each op's operands as it takes
    them (in the autocast dtype, which matmul runs in), and the gradient that reaches its output.
    An op is named `MODULE:OP#N`, its Nth of that kind in the module's forward (`op_key`)."""

    def __init__(self, model: torch.nn.Module, device_type: str, scale: float | None):
        super().__init__()
        self.device_type = device_type
        self.unscale = 1.0 / scale if scale else 1.0
        self.seen: dict[str, _Seen] = {}
        self.where: dict[str, tuple[str, str]] = {}      # op key -> (module, op)
        self.shapes: dict[str, list[list[int]]] = {}     # op key -> its operands' shapes
        self._stack: list[_Frame] = []
        self._calls: dict[str, int] = {}
        self._handles = []
        for name, module in named_modules(model).items():
            self._handles += [module.register_forward_pre_hook(self._enter(name)),
                              module.register_forward_hook(self._leave, always_call=True)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, name: str):
        def hook(module, args):
            self._calls[name] = self._calls.get(name, 0) + 1
            self._stack.append(_Frame(name, module, self._calls[name] == 1))
        return hook

    def _leave(self, module, args, output):
        if self._stack and self._stack[-1].module is module:
            self._stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = MATMULS.get(func) or ADD_MATMULS.get(func) or ("sdpa" if func is F.scaled_dot_product_attention
                                                             else None)
        frame = self._stack[-1] if self._stack else None
        # A Linear's own GEMM is LinearCapture's; a module's later calls repeat its first.
        if op is None or frame is None or not frame.first or isinstance(frame.module, torch.nn.Linear):
            return out
        if op == "sdpa":
            self._attention(frame, args, kwargs)
        else:
            a, b = (args[0], args[1].t()) if op == "linear" else args[1:3] if op in ADD_MATMULS.values() \
                else args[:2]
            if _matrices(a, b):
                self._gemm(frame, op, a, b, out)
        return out

    def _key(self, frame: _Frame, op: str) -> str:
        index = frame.counts.get(op, 0)
        frame.counts[op] = index + 1
        key = op_key(frame.name, f"{op}#{index}")
        self.where[key] = (frame.name, f"{op}#{index}")
        return key

    def _low(self) -> torch.dtype | None:
        return torch.get_autocast_dtype(self.device_type) if torch.is_autocast_enabled(self.device_type) else None

    def _gemm(self, frame: _Frame, op: str, a, b, out) -> None:
        key, low = self._key(frame, op), self._low()
        seen = self.seen[key] = _Seen(low=low, calls=1)
        a, b = _as_run(a, low), _as_run(b, low)
        self.shapes[key] = [list(a.shape), list(b.shape)]
        with measuring(self.device_type):
            seen.rows += forward_rows(a, b)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._grad_hook(key, b))

    def _grad_hook(self, key: str, b: torch.Tensor):
        def hook(grad):
            with measuring(self.device_type):
                self.seen[key].rows += gradient_rows(_unscaled(grad, self.unscale), b)
        return hook

    def _attention(self, frame: _Frame, args, kwargs) -> None:
        """scaled_dot_product_attention's two GEMMs from its q, k and v: the scores q @ k^T, then
        softmax(scores * scale + mask) @ v (dropout left out)."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = {**dict(zip(names, args)), **kwargs}
        q, k, v = given.get("query"), given.get("key"), given.get("value")
        if not _matrices(q, k, v):
            return
        low = self._low()
        q, k, v = (_as_run(t, low) for t in (q, k, v))
        if k.dim() >= 3 and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:   # grouped-query attention
            k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
        with measuring(self.device_type):
            scores_key = self._key(frame, "sdpa.scores")
            self.seen[scores_key] = _Seen(low=low, calls=1, rows=forward_rows(q, k.transpose(-1, -2)))
            probs = _attention_weights(q, k, given).to(v.dtype)
            values_key = self._key(frame, "sdpa.values")
            self.seen[values_key] = _Seen(low=low, calls=1, rows=forward_rows(probs, v))
        self.shapes[scores_key] = [list(q.shape), list(k.transpose(-1, -2).shape)]
        self.shapes[values_key] = [list(probs.shape), list(v.shape)]


def op_key(module: str, op: str) -> str:
    """How an op outside nn.Linear is named in the what-if's `op_verdict`: `blocks.0.attn:matmul#1`
    (the model's own forward's: `matmul#0`)."""
    return f"{module}:{op}" if module else op


def _matrices(*tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 and t.numel() > 0
               for t in tensors)


def _attention_weights(q: torch.Tensor, k: torch.Tensor, given: dict) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask), in float32, as scaled_dot_product_attention computes it."""
    scale = given.get("scale") or q.shape[-1] ** -0.5
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if given.get("is_causal"):
        rows, cols = scores.shape[-2:]
        causal = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    mask = given.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return scores.softmax(-1)
