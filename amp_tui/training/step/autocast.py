"""Autocast as a run applies it: the torch dtype of a precision name, what a device can run, and
the one context manager every forward of ours goes through."""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from amp_tui.core.precision import autocast_name, canonical

# What autocast runs in, by precision name: fp8's layers take fp8 inputs inside bf16 autocast.
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float8": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    found = _TORCH_DTYPES.get(name)   # the canonical names, as a run holds them: every step asks
    return found if found is not None else getattr(torch, autocast_name(name))


def autocast(device_type: str, dtype: str) -> contextlib.AbstractContextManager:
    """`torch.autocast` for a precision name; fp32 is autocast turned off."""
    torch_type = torch_dtype(dtype)
    return torch.autocast(device_type, dtype=torch_type, enabled=torch_type is not torch.float32)


def unsupported_reason(device, dtype: str) -> str | None:
    """Why `dtype` can't run on `device` (a torch.device), or None when it can."""
    dtype = canonical(dtype)
    if dtype == "float32":
        return None
    if dtype == "float8":
        if importlib.util.find_spec("torchao") is None:
            return "fp8 training needs torchao: pip install 'amp-tui[fp8]'; staying in the current dtype"
        dtype = "bfloat16"   # what the rest of the model runs in
    if device.type == "cuda":
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            return (f"bf16 is not supported on {torch.cuda.get_device_name(device)} "
                    "(NVIDIA needs Ampere or newer); staying in the current dtype")
        return None
    if device.type in ("cpu", "xpu", "mps", "hpu"):
        return None
    return f"autocast is not available on device type {device.type!r}"
