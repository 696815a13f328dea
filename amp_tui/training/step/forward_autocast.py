"""A module's forward run under an autocast chosen at every call, in place of a fixed one.

Accelerate's `prepare()` (and so the Hugging Face Trainer) makes mixed precision by wrapping
`model.forward` in a `torch.autocast` of the dtype it was configured with, its outputs converted
to fp32, and keeps the forward it wrapped as `model._original_forward`. That autocast can't
change afterwards ("AcceleratorState has already been initialized"). Putting the original
forward under an autocast asked for at each call instead (the monitor's) lets the dtype change
between two steps; fp16 and bf16 outputs are still converted to fp32 as Accelerate does, so the code after
the forward sees what it saw before.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, ContextManager

import torch

_HALF = (torch.float16, torch.bfloat16)


def wrapped_in_autocast(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose forward Accelerate wrapped in a fixed autocast: `model` itself, or the
    module inside a DistributedDataParallel wrapper; None when neither was wrapped."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, torch.nn.Module) and callable(vars(candidate).get("_original_forward")):
            return candidate
    return None


def fixed_autocast_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the autocast fixed around `module.forward` (Accelerate's, kept in the closures
    of its wrappers), when enabled; None when none is found. What the loop already runs in, so that
    putting the forward under the monitor's autocast changes nothing until `d`."""
    seen: set[int] = set()
    todo: list[Any] = [vars(module).get("forward")]
    while todo and len(seen) < 64:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.autocast):
            return item.fast_dtype if item._enabled else None
        item = getattr(item, "__func__", item)
        for cell in getattr(item, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:   # an empty cell
                continue
        if not callable(item) or isinstance(item, (type, torch.nn.Module)):
            continue
        todo.extend(v for v in getattr(item, "__dict__", {}).values() if callable(v) or isinstance(v, torch.autocast))
    return None


class ForwardAutocast:
    """`module.forward` replaced by its original forward under `autocast_now()`; `undo()` puts
    back what was there (Accelerate's wrapper, or nothing: the class's forward). `in_half()`
    says whether that autocast runs fp16 or bf16 now (in fp32 there is nothing to convert)."""

    def __init__(self, module: torch.nn.Module, autocast_now: Callable[[], ContextManager],
                 in_half: Callable[[], bool]):
        self.module = module
        self._previous = vars(module).get("forward")   # None: the class's forward was in use
        original = vars(module).get("_original_forward") or module.forward

        def forward(*args, **kwargs):
            with autocast_now():
                outputs = original(*args, **kwargs)
            return outputs_to_fp32(outputs) if in_half() else outputs
        # As Accelerate's own wrapper does, so that its unwrap_model() finds the plain function.
        forward.__wrapped__ = getattr(original, "__func__", original)
        module.forward = forward

    def undo(self) -> None:
        if self._previous is not None:
            self.module.forward = self._previous
        else:
            vars(self.module).pop("forward", None)


def outputs_to_fp32(value: Any) -> Any:
    """fp16 and bf16 tensors in a forward's outputs (tensors, tuples, named tuples, lists,
    mappings such as a ModelOutput) as fp32, the rest as it is, like Accelerate's
    convert_to_fp32. A dict (a ModelOutput is one) gets the converted tensors in place: building
    a ModelOutput anew costs more than the rest of this."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _HALF else value
    if isinstance(value, (tuple, list)):
        items = [outputs_to_fp32(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, list):
            return type(value)(items)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, Mapping):
        changed = {k: c for k, v in value.items() if (c := outputs_to_fp32(v)) is not v}
        if not changed:
            return value
        if isinstance(value, MutableMapping):
            for k, c in changed.items():
                value[k] = c
            return value
        return type(value)({**value, **changed})
    return value
