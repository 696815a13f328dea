"""Peak memory of one timed training run: CUDA's allocator figures, or the resident set that
Linux reports in /proc."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch


class PeakMemory:
    """Peak memory a training run adds on top of what was in use before it.

    CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus the memory
    allocated before the run's copies were built (exact, for tensors through PyTorch's allocator).
    CPU (Linux): the process's resident-set high-water mark (VmHWM), reset through
    /proc/self/clear_refs at the start of the timed steps, minus the resident size before the
    copies were built, after handing freed heap back with malloc_trim so earlier runs don't
    lend their freed pages to later ones. It counts everything the process touched (allocator
    slack and caches included): compare it against fp32's figure, not against a tensor count.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.base: int | None = None
        self._libc = None
        if device.type == "cuda":
            self.kind = "cuda max_memory_allocated during the timed steps, minus memory in use before"
            self.available = True
        else:
            self.available = _read_status("VmHWM") is not None and _reset_hwm()
            self.kind = ("peak resident set size (VmHWM) during the timed steps, minus resident size "
                         "before the run" if self.available else
                         "unavailable: peak resident memory needs Linux /proc/self/clear_refs")
            path = ctypes.util.find_library("c")
            try:
                self._libc = ctypes.CDLL(path) if path else None
            except OSError:
                self._libc = None

    def _malloc_trim(self) -> None:
        # Hand freed heap back to the OS, so the resident size counts what is in use now.
        if self._libc is not None and hasattr(self._libc, "malloc_trim"):
            self._libc.malloc_trim(0)

    def before_run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.available:
            gc.collect()
            self._malloc_trim()
            self.base = _read_status("VmRSS")

    def start_timing(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.available:
            self._malloc_trim()
            _reset_hwm()

    def peak(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
        hwm = _read_status("VmHWM")
        return None if hwm is None else max(0, hwm - self.base)


def _read_status(key: str) -> int | None:
    """A /proc/self/status figure in bytes (Linux), or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # "reset the peak resident set size to the current one" (Linux >= 4.0)
        return True
    except OSError:
        return False
