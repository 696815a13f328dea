"""A step of the user's own loop, kept for a replay of it: each forward of the model in the step
(its micro-batches), with what it was called with and what it started from.

amp-tui can't call the loop's loss code again, but it can call the model. For each forward in a
step, hooks on the root module keep:
- references to its inputs (positional and keyword: no copies), with their version counters, so
  a replay knows when the loop changed one in place since;
- the RNG states as it started (CPU and device), so a replay draws the same dropout masks;
- the autocast dtype in force as it started (the loop's own `torch.autocast`, or the monitor's);
- the gradient that flowed into its outputs during the step's backward (a pre-hook on the autograd
  node that made each output, holding the gradient by reference: half the cost of a tensor hook),
  or, when the model returns its own loss (a transformers model given labels), the gradient of that
  loss alone (the loss scale, divided by the micro-batches), the one thing its backward starts from.

The hooks keep only while `keeping()` says the loop is inside a step, and the driver drops what
was kept when the step ends (after its replay, if it failed). The cost on a healthy step is the
RNG state's copy and a few hook calls per forward (bench/monitor_overhead.py measures it); the
memory, the gradients of the outputs, which the backward makes anyway, held until the step ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from amp_tui.training.trace.op_trace import RngSnapshot, loss_in, rng_snapshot


@dataclass
class KeptForward:
    """One forward of the model in a step, as it ran."""
    args: tuple
    kwargs: dict
    rng: RngSnapshot
    autocast: torch.dtype | None                 # in force as it started (None: none)
    versions: list[tuple[torch.Tensor, int]]     # its input tensors and their version counters
    loss_grad: torch.Tensor | None = None        # the gradient of the model's own loss
    grads: dict[int, torch.Tensor] = field(default_factory=dict)   # output leaf index -> gradient
    own_loss: bool = False                       # the model returned its loss

    def keep_grads(self, where: list[tuple[int | None, int]], grad_outputs) -> None:
        """A node's pre-hook: the gradients of the outputs it made (`where`: each output's leaf
        index, None for the loss, and its place among the node's outputs)."""
        for index, output_nr in where:
            grad = grad_outputs[output_nr]
            if index is None:
                self.loss_grad = grad
            elif grad is not None:
                self.grads[index] = grad

    def inputs_changed(self) -> bool:
        """The loop changed an input in place after this forward read it."""
        return any(t._version != v for t, v in self.versions)


def _input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The input tensors, one level into a batch given as a dict, list or tuple: enough for the
    batches loops pass, without walking a nested structure on every forward."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            found.extend(v for v in value.values() if isinstance(v, torch.Tensor))
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss a forward returned (a `.loss`, a "loss" key, a scalar), itself (a hook on it
    fires in the loop's backward), when it has one that the backward can start from."""
    loss = loss_in(output)
    return loss if loss is not None and loss.requires_grad else None


class ForwardKeeper:
    """Forward pre- and post-hooks on `model` (the module the loop calls) keeping each of its
    forwards while `keeping()`; `forwards` until `drop()`. `on_kept(kept)`, when set, is called as
    a forward is kept, before it runs (the X-ray of the step starts there)."""

    def __init__(self, model: torch.nn.Module, device_type: str, keeping: Callable[[], bool]):
        self.model = model
        self.device_type = device_type
        self.keeping = keeping
        self.forwards: list[KeptForward] = []
        self.on_kept: Callable[[KeptForward], None] | None = None
        self._handles: list = []

    def attach(self) -> None:
        self._handles = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                         self.model.register_forward_hook(self._after, with_kwargs=True)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.drop()

    def drop(self) -> None:
        self.forwards = []

    def _before(self, _module, args, kwargs) -> None:
        if not self.keeping():
            return
        dtype = (torch.get_autocast_dtype(self.device_type)
                 if torch.is_autocast_enabled(self.device_type) else None)
        kept = KeptForward(args, dict(kwargs), rng_snapshot(), dtype,
                           [(t, t._version) for t in _input_tensors(args, kwargs)])
        self.forwards.append(kept)
        if self.on_kept is not None:
            self.on_kept(kept)

    def _after(self, _module, _args, _kwargs, output) -> None:
        if not self.keeping() or not self.forwards:
            return
        kept = self.forwards[-1]
        if type(output) is torch.Tensor and output.numel() != 1:
            # The common case, logits: one leaf, no loss to look for (every forward pays this).
            leaves = [(0, output)] if output.grad_fn is not None and output.is_floating_point() else []
        elif (loss := own_loss(output)) is not None:
            # Its backward starts from the loss alone: the logits' gradient, which the loss made,
            # would count that path twice.
            kept.own_loss = True
            leaves = [(None, loss)]
        else:
            leaves = [(i, t) for i, t in enumerate(tree_leaves(output))
                      if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.is_floating_point()]
        # One pre-hook per node (outputs of one split share theirs); the hook holds no tensor.
        nodes: dict = {}
        for index, leaf in leaves:
            nodes.setdefault(leaf.grad_fn, []).append((index, leaf.output_nr))
        for node, where in nodes.items():
            node.register_prehook(partial(kept.keep_grads, where))
