"""The values inside a module's forward: on a probed fp16 step, the largest |output| of each aten
op that runs in a module's own forward, by module and op ("aten.mul in blocks.1").

What overflows in real attention is an intermediate: the scores `q @ k.T * scale`, computed inside
the attention module's forward and squashed by the softmax after them, so no module's output shows
them growing. The op tracer sees every op (trace/op_trace.py), but replays a step; this probe rides
on the step itself, under a `TorchDispatchMode` armed while the outermost module's forward runs.
Each op's max |x| stays on the device until `collect()` reads them in one transfer.

Only what can overflow is measured: outputs in float16 (bfloat16 has fp32's range), and only ops
in the forward of the root, of a module that has children of its own, or of a module of the
user's own (not one of torch.nn's): a torch.nn leaf's ops make its output, which the layer probes
already measure (layer_probes.py). Not armed under
torch.compile (a compiled graph runs its own kernels, past any dispatch mode) and never in the
backward (the mode ends with the forward).
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from amp_tui.training.local_fp32 import named_modules

WATCHED_DTYPES = (torch.float16,)


def op_key(op: str, module: str) -> str:
    """How an op inside a module is named, in the forecasts and the alerts."""
    return f"{op} in {module or '<model>'}"


def split_key(key: str) -> tuple[str, str]:
    """(op, module) of an `op_key`."""
    op, _, module = key.partition(" in ")
    return op, "" if module == "<model>" else module


def _watched(name: str, module: torch.nn.Module) -> bool:
    """Whether a module's own forward may compute a value its output doesn't show: the root, a
    module with children, or a leaf of the user's own (an attention written on raw parameters)."""
    return name == "" or any(True for _ in module.children()) or not type(module).__module__.startswith("torch.nn")


# Ops that only move or rename values another op computed (its maximum is already counted): the
# views are told by the op itself (`is_view`); these are not views but copy or alias the same values.
SAME_VALUES = frozenset({"_unsafe_view", "clone", "alias", "lift_fresh", "lift_fresh_copy", "_reshape_alias",
                         "contiguous", "detach", "copy", "copy_"})


class _OpMaxima(TorchDispatchMode):
    """Each watched op's max |output|, kept on the device, keyed by the module it runs in."""

    def __init__(self, probe: OpProbe):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        module = self.probe.current()
        if module is None or func.is_view or func.overloadpacket.__name__ in SAME_VALUES:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in WATCHED_DTYPES and t.numel() > 0:
                self.probe.pending.append((func.overloadpacket, module,
                                           torch.linalg.vector_norm(t.detach(), math.inf)))
        return out


class OpProbe:
    """Armed for one step's forwards (`begin`), read at its end (`collect`). The mode is entered by
    the pre-hook of the outermost module that runs (the root, or under a framework that calls a
    child's forward itself, as Lightning's training_step does, that child) and left once it returns.
    Each module's pre-hook, put on last, says which module runs; its first forward hook (put on
    first) says none does while the other hooks of that module run (the layer probes' measures are
    no op of any module), and its last pops it."""

    def __init__(self, model: torch.nn.Module):
        modules = named_modules(model)
        # The modules whose own forward is watched; None for a torch.nn leaf, whose ops make its output.
        self._modules = [(m, name if _watched(name, m) else None) for name, m in modules.items()]
        self.active = False
        self.pending: list[tuple[object, str, torch.Tensor]] = []
        self._stack: list[str | None] = []
        self._mode: _OpMaxima | None = None
        self._handles: list = []

    # ---- a step ------------------------------------------------------------------------------
    def begin(self) -> None:
        self.active = True
        self.pending = []
        if self._handles:
            return
        for module, name in self._modules:
            self._handles += [module.register_forward_pre_hook(self._enter(name)),
                              module.register_forward_hook(self._hooks_run, prepend=True),
                              module.register_forward_hook(self._leave)]

    def collect(self) -> dict[str, float]:
        """The step's maxima by `op_key` (inf or NaN where an op made one), and the probe idle."""
        self._disarm()
        self.active = False
        pending, self.pending = self.pending, []
        if not pending:
            return {}
        values = torch.stack([v.float() for _, _, v in pending]).tolist()
        out: dict[str, float] = {}
        for (op, module, _), value in zip(pending, values):
            key = op_key(f"aten.{op.__name__}", module)
            previous = out.get(key)
            out[key] = value if previous is None or not value <= previous else previous
        return out

    def detach(self) -> None:
        """Idle, with every hook off the model (the next `begin` puts them back)."""
        self._disarm()
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- around each forward ---------------------------------------------------------------------
    def current(self) -> str | None:
        """The innermost module running now, where watched (None: a leaf's own ops, a module's
        other hooks, or no forward)."""
        return self._stack[-1] if self._stack else None

    def _disarm(self) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self._stack = []

    def _enter(self, name: str | None):
        def enter(_module, _args) -> None:
            if not self.active:
                return
            if self._mode is None:
                self._stack = []
                self._mode = _OpMaxima(self)
                self._mode.__enter__()
            self._stack.append(name)
        return enter

    def _hooks_run(self, _module, _args, _output) -> None:
        if self._mode is not None:
            self._stack.append(None)

    def _leave(self, _module, _args, _output) -> None:
        if self._mode is None:
            return
        del self._stack[-2:]
        if not self._stack:
            self._disarm()
