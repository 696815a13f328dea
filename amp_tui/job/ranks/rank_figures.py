"""A probed step's figures from every rank: each rank packs its own into one float64 vector (its
loss, its step time, its per-layer maxima), and rank 0 merges the gathered vectors into the
step's record: each layer's maximum over the ranks, each rank's loss and step time, and where a
value went non-finite, the first rank that saw it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from amp_tui.training.step.engine import StepResult

UNMEASURED = -1.0           # a figure not measured (None), in the packed vector: below any |x|
ALL_KINDS = ("act", "grad", "weight")
# What differs between the ranks in a probed step: the outputs. DDP leaves the same gradients on
# every rank, and the replicas hold the same weights, so rank 0's own figures of those are all.
OWN_KINDS = ("act",)


@dataclass
class RankFigures:
    """Each rank's loss and step time in one probed (or non-finite) step, and the first rank
    that saw a non-finite value in it."""

    loss: list[float]
    step_time: list[float]
    nonfinite_rank: int | None = None


def pack_figures(result: StepResult, compute_s: float, kinds: tuple[str, ...] = ALL_KINDS) -> torch.Tensor:
    """[loss, step time, then each of `kinds` per layer: act..., grad..., weight...] as float64;
    UNMEASURED for a figure not measured, NaN and inf as they are (the maximum over the ranks
    keeps them)."""
    values = [result.loss, compute_s]
    f = result.figures
    if f is not None:
        for kind in kinds:
            values += [UNMEASURED if v is None else v for v in getattr(f, kind) or [None] * len(f.act)]
    return torch.tensor(values, dtype=torch.float64)


def merge_figures(result: StepResult, rows: torch.Tensor, names: list[str], seen: list | None,
                  *, loss_rank: int | None, kinds: tuple[str, ...] = ALL_KINDS) -> StepResult:
    """Rank 0's result with every rank's figures in it (`rows`: one packed vector per rank, of
    `kinds`; rank 0's own figures of the others)."""
    losses = rows[:, 0].tolist()
    times = rows[:, 1].tolist()
    figures = result.figures
    if figures is not None:
        n = len(figures.act)
        top = rows[:, 2:].amax(dim=0).tolist() if rows.shape[0] else []   # amax keeps NaN
        merged = [None if v == UNMEASURED else v for v in top]
        figures = dataclasses.replace(figures, **{kind: merged[k * n:(k + 1) * n] for k, kind in enumerate(kinds)})
    update: dict[str, Any] = {"figures": figures}
    nonfinite = result.nonfinite
    bad_losses = [r for r, v in enumerate(losses) if not math.isfinite(v)]
    if nonfinite is None and bad_losses:
        nonfinite = "loss"   # an own loop: a rank's loss went non-finite (its backward ran all the same)
    first = None
    if nonfinite == "loss":
        first = loss_rank if loss_rank is not None else (bad_losses[0] if bad_losses else 0)
    elif nonfinite is not None:
        # The gradients all-reduced: every rank saw them non-finite, the one that made them
        # located them (its layer, or the op of its own replay).
        located = [r for r, s in enumerate(seen or []) if s and (s.get("layer") or _op_found(s))]
        first = located[0] if located else 0
    if nonfinite is not None:
        update["nonfinite"] = nonfinite
        if seen is not None and seen[first] is not None:
            update.update(loss=seen[first]["loss"] if nonfinite == "loss" else result.loss,
                          first_nonfinite_layer=seen[first]["layer"], diagnosis=seen[first]["diagnosis"],
                          op_trace=seen[first].get("op_trace"))
        else:
            if nonfinite == "loss":
                update["loss"] = losses[first]
            if figures is not None:
                index = figures.first_nonfinite("act" if nonfinite == "loss" else "grad")
                if index is not None:
                    update["first_nonfinite_layer"] = names[index]
    update["per_rank"] = RankFigures(loss=losses, step_time=times, nonfinite_rank=first)
    return dataclasses.replace(result, **update)


def _op_found(seen: dict) -> bool:
    return bool((seen.get("op_trace") or {}).get("op"))
