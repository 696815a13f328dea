"""The RNG states of a run of several ranks in a checkpoint: every rank's own, gathered into rank
0's file as base64 text in its `extra` (the file's own RNG tensors are rank 0's), and the world
size that saved them, which a resume must match."""

from __future__ import annotations

import base64

import torch

from amp_tui.training.checkpoint.live import cuda_ready


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(bytes(t.cpu().tolist())).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict:
    """This rank's RNG states: the CPU's, and its own GPU's where CUDA is in use."""
    state = {"cpu": _b64(torch.get_rng_state())}
    if device.type == "cuda" and cuda_ready():
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def rng_problem(extra: dict, rank: int) -> str | None:
    """Why this rank's RNG state in a checkpoint's `extra` can't be set (None: it can, or the
    checkpoint has none for this rank)."""
    states = extra.get("rank_rng")
    if states is None:
        return None
    if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
        return "its per-rank RNG states are malformed"
    if rank >= len(states):
        return None
    try:
        cpu = _bytes_tensor(states[rank]["cpu"])
    except (KeyError, TypeError, ValueError):
        return f"the RNG state of rank {rank} is malformed"
    if cpu.numel() != torch.get_rng_state().numel():
        return f"the CPU RNG state of rank {rank} has the wrong size"
    return None


def restore_rng(extra: dict, rank: int, device: torch.device) -> None:
    """Set this rank's own RNG states from a checkpoint's `extra` (checked by rng_problem)."""
    states = extra.get("rank_rng")
    if not isinstance(states, list) or rank >= len(states):
        return
    state = states[rank]
    torch.set_rng_state(_bytes_tensor(state["cpu"]))
    if "cuda" in state and device.type == "cuda" and cuda_ready():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]), device)


def saved_world_size(extra: dict | None) -> int:
    """The world size a checkpoint was saved by (1 for a run without ranks)."""
    value = (extra or {}).get("world_size", 1)
    return value if isinstance(value, int) and value > 0 else 1
