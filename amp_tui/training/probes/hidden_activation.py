"""A non-finite activation the loss never sees: a layer's output overflowed to inf (or made NaN)
and a saturating op after it (tanh, a clamp, a softmax's max) hid it, so the loss and gradients
came out finite while the layer is dead from then on. Only a probed step measures activations."""

from __future__ import annotations

from typing import Sequence

from amp_tui.training.probes.layer_probes import LayerFigures


class HiddenActivationWatch:
    """Says the first layer whose output held inf/NaN on a probed step whose loss and gradients
    came out finite, when that is news: once, and again only after a probed step found it finite
    (or another layer went first), so a layer dead for a thousand steps is one event."""

    def __init__(self) -> None:
        self._last: str | None = None   # the layer said last, while it stays non-finite

    def news(self, figures: LayerFigures | None, names: Sequence[str]) -> str | None:
        if figures is None:
            return None
        index = figures.first_nonfinite("act")
        layer = names[index] if index is not None else None
        news = layer is not None and layer != self._last
        self._last = layer
        return layer if news else None
