"""How a model sharded with FSDP2 is checkpointed (`--fsdp-checkpoint full|sharded|auto`).

- full: the whole model and optimizer state gathered on rank 0 and written as the usual single
  safetensors file (training/checkpoint/sharded.py). One file any single process can load, and
  what the listing, replay and `safetensors.safe_open` read like any other; but rank 0 holds the
  whole state in host memory while it writes, twice over (the gathered state, and the private
  copy the file is written from).
- sharded: every rank writes its own shards with `torch.distributed.checkpoint`
  (training/checkpoint/dcp.py, manifest.py): no rank ever holds more than its shards; it loads
  back into a run of the same world size.
- auto (the default): full while twice the whole state takes at most half of the memory this
  host has available, sharded beyond. Rank 0 decides at each save and the other ranks follow.
"""

from __future__ import annotations

import os

from amp_tui.core.numfmt import byte_size

LAYOUTS = ("auto", "full", "sharded")
# The share of the host's available memory a gathered checkpoint may take (twice the state).
FULL_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes of memory this host has available now (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def state_bytes(model, optimizer) -> int:
    """The whole model and optimizer state in bytes, counted from the full shapes (a sharded
    parameter's `shape` is the whole one); an optimizer without state yet counted as two
    float32 tensors per parameter (Adam's)."""
    def size(t) -> int:
        return t.numel() * t.element_size()

    total = sum(size(t) for t in model.state_dict().values() if hasattr(t, "numel"))
    states = [s for s in optimizer.state.values() if s]
    if states:
        total += sum(size(v) for s in states for v in s.values() if hasattr(v, "numel"))
    else:
        total += sum(2 * 4 * p.numel() for g in optimizer.param_groups for p in g["params"])
    return total


def choose(mode: str, whole: int, available: int | None) -> tuple[str, str]:
    """("full" or "sharded", why) for `--fsdp-checkpoint mode` with a state of `whole` bytes and
    `available` bytes of host memory (None: unknown)."""
    if mode not in LAYOUTS:
        raise ValueError(f"--fsdp-checkpoint must be one of {', '.join(LAYOUTS)}, not {mode!r}")
    if mode == "full":
        return "full", "--fsdp-checkpoint full: gathered on rank 0"
    if mode == "sharded":
        return "sharded", "--fsdp-checkpoint sharded: each rank writes its shards"
    if available is None:
        return "sharded", "the host's available memory is unknown: each rank writes its shards"
    need = 2 * whole
    if need <= FULL_SHARE * available:
        return "full", (f"the whole state (twice {byte_size(whole)} while written) fits in half of the "
                        f"{byte_size(available)} available: gathered on rank 0")
    return "sharded", (f"the whole state (twice {byte_size(whole)} while written) would take more than half "
                       f"of the {byte_size(available)} available: each rank writes its shards")

