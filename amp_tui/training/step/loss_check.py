"""What loss_fn must return for a guarded step: a floating-point scalar tensor with a graph."""

from __future__ import annotations

from typing import Any

import torch


class LossError(Exception):
    """loss_fn returned something that is not a scalar loss."""


def check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"loss_fn returned a {type(loss).__name__}, not a tensor")
    if loss.numel() != 1:
        raise LossError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar "
                        "(reduce it, e.g. with .mean())")
    if not loss.is_floating_point():
        raise LossError(f"loss_fn returned a {loss.dtype} tensor; a loss must be floating point")
    if not loss.requires_grad:
        raise LossError("loss_fn returned a tensor that does not require grad: "
                        "it does not depend on the model's parameters")
    return loss
