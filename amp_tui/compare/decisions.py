"""From a model's output to scores, and from scores to decisions, near-ties and labels.

The rules docs/compare.md states under "What the script provides": how the model is called, which
tensor holds the scores, argmax or sign decisions, and when a reference decision is a near-tie.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from amp_tui.compare.criteria import Criteria

# Label keys looked for in dict batches (for the optional accuracy figure).
LABEL_KEYS = ("labels", "label", "targets", "target", "y")


def default_predict(model: torch.nn.Module, batch: Any):
    """The model's output: model(batch) for a tensor, model(batch[0]) for a tuple/list
    (inputs first, labels after), model(**batch) for a dict."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, (list, tuple)) and len(batch) > 0:
        return model(batch[0])
    if isinstance(batch, Mapping):
        return model(**batch)
    raise TypeError(f"no default way to call the model on a {type(batch).__name__} batch")


def as_scores(out: Any) -> torch.Tensor | None:
    """A tensor of scores from what predict/model returned: a tensor, `.logits`, ["logits"],
    or the first tensor of a tuple/list."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, (list, tuple)):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    return None


def decision_kind(scores: torch.Tensor) -> str:
    """argmax over the last dim when scores are (batch, ..., classes) with 2+ classes; else the
    sign of each single score (threshold 0)."""
    return "argmax" if scores.ndim >= 2 and scores.shape[-1] >= 2 else "sign"


def _single(scores: torch.Tensor) -> torch.Tensor:
    return scores.squeeze(-1) if scores.ndim >= 2 and scores.shape[-1] == 1 else scores


def decide(scores: torch.Tensor, kind: str) -> torch.Tensor:
    """Decisions: class index (argmax; an exact tie goes to the lowest index) or score > 0."""
    if kind == "argmax":
        return scores.argmax(dim=-1)
    return (_single(scores) > 0).long()


def near_ties(ref: torch.Tensor, kind: str, criteria: Criteria) -> tuple[torch.Tensor, torch.Tensor]:
    """(near-tie mask, decision margin) per sample of the reference scores."""
    if kind == "argmax":
        top = ref.topk(2, dim=-1).values
        gap = top[..., 0] - top[..., 1]
        allowed = (criteria.tolerance(top[..., 0]) + criteria.tolerance(top[..., 1])
                   if criteria.tie_margin is None else torch.full_like(gap, criteria.tie_margin))
    else:
        gap = _single(ref).abs()
        allowed = (criteria.tolerance(gap) if criteria.tie_margin is None
                   else torch.full_like(gap, criteria.tie_margin))
    return gap <= allowed, gap


def find_labels(batch: Any, shape: torch.Size) -> torch.Tensor | None:
    """Integer labels with one entry per decision: batch[1] of a tuple/list, or a dict's
    labels/label/targets/target/y. None when there are none (accuracy is then not reported)."""
    candidates = []
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        candidates.append(batch[1])
    elif isinstance(batch, Mapping):
        candidates.extend(batch.get(k) for k in LABEL_KEYS)
    for c in candidates:
        if (isinstance(c, torch.Tensor) and not c.is_floating_point() and not c.is_complex()
                and c.shape == shape):
            return c
    return None

