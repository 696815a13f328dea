"""The policies a run is given as words, each a Literal checked once, where it comes in (a
config, `amp_tui.monitor`, a framework callback), with an error that lists what it takes."""

from __future__ import annotations

from typing import Literal, TypeVar, get_args

# What a non-finite step does: skip it (GradScaler's way), pause or stop the run, fall back down
# the ladder fp16 -> bf16 -> fp32, or put the overflowing op's module in fp32.
NonfinitePolicy = Literal["skip", "pause", "stop", "fallback", "isolate"]
NONFINITE_POLICIES: tuple[NonfinitePolicy, ...] = get_args(NonfinitePolicy)
# A loop of the user's own pauses and stops itself, and keeps its dtype unless told.
MonitorPolicy = Literal["skip", "isolate"]
MONITOR_POLICIES: tuple[MonitorPolicy, ...] = get_args(MonitorPolicy)
# How a model sharded with FSDP2 is checkpointed.
FsdpCheckpoint = Literal["full", "sharded", "auto"]
FSDP_CHECKPOINTS: tuple[FsdpCheckpoint, ...] = get_args(FsdpCheckpoint)

Policy = TypeVar("Policy", bound=str)


def checked(name: str, value: object, allowed: tuple[Policy, ...]) -> Policy:
    """`value` when it is one of `allowed`; otherwise a ValueError that names the option and the
    values it takes."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: use {', '.join(map(repr, allowed[:-1]))} or {allowed[-1]!r}"
                         if len(allowed) > 1 else f"{name}={value!r}: use {allowed[0]!r}")
    return value  # type: ignore[return-value]
