"""What a checkpoint reads from the live objects: the model's state by names that do not depend
on torch.compile, the optimizer's parameters, whether CUDA RNG is in use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from amp_tui.training.compiled import clean_name, original_module


def portable_names(names) -> dict[str, str]:
    """name -> the name without the `_orig_mod` parts torch.compile adds ("_orig_mod.0.weight"
    and "0.weight" are one tensor), unless that would give two names one tensor's name."""
    names = list(names)
    cleaned = {n: clean_name(n) for n in names}
    if len(set(cleaned.values())) < len(names):
        return {n: n for n in names}
    return cleaned


@dataclass
class ModelState:
    module: torch.nn.Module  # the module torch.compile wrapped, or the model itself
    tensors: dict[str, Any]  # its state_dict by portable name
    names: dict[str, str]  # portable name -> name in module.state_dict()


def model_state(model: torch.nn.Module) -> ModelState:
    # The original module's state, so a checkpoint of a compiled model loads into an eager one
    # and the other way round.
    module = original_module(model)
    state = module.state_dict()
    portable = portable_names(state)
    return ModelState(module, {portable[k]: v for k, v in state.items()},
                      {p: k for k, p in portable.items()})


def class_name(optimizer) -> str:
    """The optimizer's class as a checkpoint names it (a view of a sharded one names the real one)."""
    return getattr(optimizer, "class_name", None) or type(optimizer).__name__


def flat_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def cuda_ready() -> bool:
    # Only touch CUDA RNG when CUDA is already in use: setting it before initialisation is
    # deferred by torch and would fail later, far from here.
    return torch.cuda.is_available() and torch.cuda.is_initialized()
