"""Which device a run uses and how the recording names its backend."""

from __future__ import annotations

import platform
from collections.abc import Mapping

import torch


class DeviceError(Exception):
    pass


def resolve_device(requested: str | None) -> torch.device:
    """`cuda` when available, else `cpu`; an explicit request is checked, not trusted."""
    if not requested:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {requested!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {requested!r} requested but no CUDA/ROCm device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {requested!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise DeviceError(f"device {requested!r} is not supported: use cpu or cuda")
    return device


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def describe_device(device: torch.device) -> dict:
    """For the session header: on ROCm the device is still called "cuda"; the backend tells."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        backend = "ROCm/HIP" if getattr(torch.version, "hip", None) else "CUDA"
        version = torch.version.hip if backend == "ROCm/HIP" else torch.version.cuda
        return {"type": "cuda", "index": index, "backend": backend, "backend_version": version,
                "name": torch.cuda.get_device_name(index)}
    return {"type": "cpu", "index": None, "backend": "CPU", "backend_version": None,
            "name": _cpu_name(), "threads": torch.get_num_threads()}


def move_to_device(batch, device: torch.device):
    """Tensors in nested tuples/lists/dicts go to the device; everything else is left alone."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # keep dict subclasses such as a tokenizer's BatchEncoding
        except Exception:  # noqa: BLE001 - a mapping type that can't be rebuilt stays a dict
            return moved
    return batch
