"""torch.compile, seen through: the original module behind an `OptimizedModule`, its names, and a
way to run compiled code eagerly.

`torch.compile(net)` returns a wrapper whose submodules are named `_orig_mod.…`; the figures and
the layer names belong to the module the user wrote, so the probes and the diagnosis look at
`_orig_mod`. Forward hooks reach inside a compiled graph only when they are attached before it is
compiled: Dynamo does not guard on a module's hooks (`skip_nnmodule_hook_guards`), so hooks added
later never run, and hooks removed later keep running as traced.

Nothing here imports torch._dynamo (a second of start-up): a model can only be compiled once
something else has imported it.
"""

from __future__ import annotations

import contextlib
import sys

import torch

COMPILED_PART = "_orig_mod"


def _optimized_module_type():
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(module: torch.nn.Module) -> bool:
    kind = _optimized_module_type()
    return kind is not None and isinstance(module, kind)


def original_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module `torch.compile` wrapped (through several wrappings), or `model` itself; seen
    through DistributedDataParallel too, whose names put `module.` in front of the model's."""
    while True:
        if is_compiled(model):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _compiled_in_place(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None   # nn.Module.compile()


def compiled_module_names(model: torch.nn.Module) -> list[str]:
    """Names (in the original module's terms; "" = the whole model) of the compiled modules:
    wrapped by torch.compile(module), or compiled in place by module.compile()."""
    if _optimized_module_type() is None:
        return []
    names = [""] if is_compiled(model) else []
    names += [n for n, m in original_module(model).named_modules() if is_compiled(m) or _compiled_in_place(m)]
    return sorted({clean_name(n) for n in names})


def clean_name(name: str) -> str:
    """A module name without the `_orig_mod` parts that compiled submodules add."""
    return ".".join(part for part in name.split(".") if part != COMPILED_PART)


def eagerly():
    """Every compiled module and function runs eagerly inside: a checked second pass must see the
    modules themselves, and a pre-flight must not compile a graph the run never uses."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()  # nothing can be compiled
    return torch.compiler.set_stance("force_eager")
