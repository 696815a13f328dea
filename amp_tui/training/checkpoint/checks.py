"""Checks that change nothing: a scaler state's values, and a read checkpoint against the live
model, optimizer, scheduler and RNG it is about to be restored into."""

from __future__ import annotations

import math
from typing import Any

import torch

from amp_tui.training.checkpoint.errors import Problem, dtype_name, few
from amp_tui.training.checkpoint.live import ModelState, class_name, cuda_ready, flat_params


def scaler_problem(state: Any) -> str | None:
    """What makes a GradScaler state unrestorable, or None; checked before saving and after reading."""
    if not isinstance(state, dict):
        return f"the scaler state is a {type(state).__name__}, not a dict"
    if not state:
        return None  # a disabled GradScaler's state_dict() is {}
    if "scale" not in state:
        return "the scaler state has no 'scale'"
    # key -> (must be an int, smallest allowed value is 0 rather than just above 0)
    rules = {"scale": (False, False), "growth_factor": (False, False),
             "backoff_factor": (False, False), "growth_interval": (True, False),
             "_growth_tracker": (True, True)}
    for key, (integer, zero_ok) in rules.items():
        if key not in state:
            continue
        value = state[key]
        kinds = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"scaler {key} is {value!r}, not {'an integer' if integer else 'a number'}"
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            return f"scaler {key} is {value!r}; it must be finite and {'>= 0' if zero_ok else '> 0'}"
    return None


def _aliases(live: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """Names of the live state_dict that are the very same tensor (tied weights)."""
    groups: dict[tuple, list[str]] = {}
    for k, t in live.items():
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype,
                   tuple(t.shape), t.stride())
            groups.setdefault(key, []).append(k)
    return {k: set(g) - {k} for g in groups.values() if len(g) > 1 for k in g}


def check_model(saved: dict[str, torch.Tensor], model: ModelState) -> dict[str, str]:
    """Raise Problem unless `saved` fits `model`; return the names to fill from a tied twin."""
    live = model.tensors
    odd = [k for k, v in live.items() if not isinstance(v, torch.Tensor)]
    if odd:
        raise Problem(f"the model has non-tensor state {few(odd)}, which checkpoints cannot hold")
    # Like safetensors.torch.load_model: a name missing from the file is fine when it is
    # the same tensor as a name that is present (save_model keeps one name per tied pair).
    tied = _aliases(live)
    plan, missing = {}, []
    for k in live:
        if k in saved:
            continue
        twin = sorted(a for a in tied.get(k, ()) if a in saved)
        if twin:
            plan[k] = twin[0]
        else:
            missing.append(k)
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {few(missing)}")
        if unexpected:
            parts.append(f"unexpected {few(unexpected)}")
        raise Problem("the weights do not match the model: " + "; ".join(parts))
    shapes = [k for k in saved if tuple(saved[k].shape) != tuple(live[k].shape)]
    if shapes:
        k = shapes[0]
        more = f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else ""
        raise Problem(f"model tensor {k!r} has shape {list(saved[k].shape)} in the file but "
                      f"{list(live[k].shape)} in the model{more}")
    dtypes = [k for k in saved if saved[k].dtype != live[k].dtype]
    if dtypes:
        k = dtypes[0]
        more = f" (and {len(dtypes) - 1} more)" if len(dtypes) > 1 else ""
        raise Problem(f"model tensor {k!r} is {dtype_name(saved[k].dtype)} in the file but "
                      f"{dtype_name(live[k].dtype)} in the model{more}")
    return plan


def check_optimizer(saved: dict, optimizer) -> None:
    live_class = class_name(optimizer)
    if saved["class"] != live_class:
        raise Problem(f"the optimizer was {saved['class']} when saved, but the live optimizer "
                      f"is {live_class}")
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups):
        raise Problem(f"the file has {len(saved_groups)} optimizer parameter groups, the live "
                      f"optimizer has {len(groups)}")
    for i, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise Problem(f"optimizer parameter group {i} has {len(sg['params'])} parameters "
                          f"in the file but {len(g['params'])} in the live optimizer")
    params = flat_params(optimizer)
    for i, (p, shape) in enumerate(zip(params, saved["param_shapes"])):
        if list(p.shape) != shape:
            raise Problem(f"optimizer parameter {i} has shape {shape} in the file but "
                          f"{list(p.shape)} in the live optimizer")
    index = {idx: pos for pos, idx in enumerate(i for sg in saved_groups for i in sg["params"])}
    for idx, pstate in saved["state"].items():
        live_state = optimizer.state.get(params[index[idx]], {})
        for key, value in pstate.items():
            have = live_state.get(key)
            # Without live state (a fresh optimizer) there is nothing to compare with; the
            # parameter shapes above and the digest already vouch for the saved state.
            if (isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor)
                    and value.shape != have.shape):
                raise Problem(f"optimizer state {key!r} of parameter {idx} has shape "
                              f"{list(value.shape)} in the file but {list(have.shape)} in the "
                              "live optimizer")


def check_scheduler(saved_class: str | None, scheduler) -> None:
    if scheduler is None or saved_class is None:
        return
    live = type(scheduler).__name__
    if live != saved_class:
        raise Problem(f"the scheduler was a {saved_class} when saved, but the live scheduler "
                      f"is a {live}")


def check_rng(rng_cpu: torch.Tensor | None, rng_cuda: dict[int, torch.Tensor]) -> None:
    if rng_cpu is not None:
        live = torch.get_rng_state()
        if rng_cpu.dtype != live.dtype or rng_cpu.shape != live.shape:
            raise Problem("the CPU RNG state in the file has the wrong size")
    if rng_cuda and cuda_ready():
        for i, state in rng_cuda.items():
            if i < torch.cuda.device_count():
                live = torch.cuda.get_rng_state(i)
                if state.dtype != live.dtype or state.shape != live.shape:
                    raise Problem(f"the CUDA RNG state of device {i} has the wrong size")
