"""A step record's per-layer figures as arrays, and their headroom bits, for the exporters.

A record holds one list per figure (`layers.act`, `layers.grad`, `layers.weight`), each a JSON
number, "NaN"/"Infinity"/"-Infinity", or null (not measured). `layer_figures` turns them into
float arrays with a mask of what was not measured, so that NaN (a non-finite value, which *is*
the non-finite flag) and null stay apart. The headroom is the dashboard's (amp_tui.ui.view
`layer_rows`): log2(largest finite value of the dtype in force / max |figure|), the least of
act, grad times the loss scale (the backward pass holds gradients scaled) and weight; -inf where
a figure is non-finite, +inf where all are zero, NaN where nothing was measured. A layer that runs
in fp32 (an fp32 module or inside one: `InForceTracker`) has its headroom to fp32's max.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.precision import MAX_FINITE
from amp_tui.core.records import InForce, next_in_force

FIGURES = ("act", "grad", "weight")
_NUMBERS = {float, int}
_LOG2_MAX = {dtype: math.log2(value) for dtype, value in MAX_FINITE.items()}


@dataclass
class Figure:
    """One per-layer figure of one step: `values` (float64, NaN where not measured or NaN) and
    `missing` (True where not measured; None when every layer was)."""

    values: np.ndarray
    missing: np.ndarray | None

    def measured(self, i: int) -> bool:
        return self.missing is None or not self.missing[i]


def figure(values, n: int) -> Figure:
    """A recorded per-layer list as `n` floats (cut or padded with "not measured")."""
    if isinstance(values, list) and len(values) == n and set(map(type, values)) <= _NUMBERS:
        try:
            return Figure(np.array(values, dtype=np.float64), None)   # the common case: all numbers
        except OverflowError:
            pass    # an integer too large for a float: read value by value below
    if not isinstance(values, list):
        return Figure(np.full(n, np.nan), np.ones(n, dtype=bool))
    floats = [_read(v) for v in values[:n]]
    floats += [None] * (n - len(floats))
    missing = np.fromiter((v is None for v in floats), dtype=bool, count=n)
    return Figure(np.array([np.nan if v is None else v for v in floats], dtype=np.float64),
                  missing if missing.any() else None)


def _read(value) -> float | None:
    try:
        return read_float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


@dataclass
class StepFigures:
    act: Figure
    grad: Figure
    weight: Figure
    headroom: np.ndarray          # bits per layer (see the module docstring)

    def get(self, name: str) -> Figure:
        return getattr(self, name)


@functools.lru_cache(maxsize=64)
def fp32_mask(names: tuple[str, ...], modules: tuple[str, ...]) -> np.ndarray | None:
    """Which of the layers `names` run in fp32 given the fp32 `modules` (None: none does). The
    same arguments give the same array: an export's writers share one step's figures by it."""
    in_force = InForce(fp32_modules=modules)
    mask = np.fromiter((in_force.runs_in_fp32(name) for name in names), dtype=bool, count=len(names))
    if not mask.any():
        return None
    mask.flags.writeable = False
    return mask


class InForceTracker:
    """What a run trained with at each record of a stream, for an exporter that takes them one
    at a time: core/records.py's reducer, and the layers that run in fp32 (`fp32`, for
    `layer_figures`)."""

    def __init__(self):
        self.in_force = InForce()
        self.fp32: np.ndarray | None = None
        self._names: tuple[str, ...] = ()

    def observe(self, record: dict) -> None:
        if record.get("type") == "header":
            layers = record.get("layers")
            self._names = tuple(str(n) for n in layers) if isinstance(layers, list) else ()
        before = self.in_force
        self.in_force = next_in_force(before, record)
        if self.in_force.fp32_modules != before.fp32_modules or record.get("type") == "header":
            self.fp32 = fp32_mask(self._names, self.in_force.fp32_modules)


_recent: tuple = (None, 0, None, None)   # (record, n, fp32, its figures): an export's writers share one step


def layer_figures(record: dict, n: int, fp32: np.ndarray | None = None) -> StepFigures | None:
    """The per-layer figures of a step record and their headroom; None on an unprobed step.
    `fp32`: the layers that run in fp32 (`fp32_mask`), their headroom to fp32's max. The same
    record asked again (the next writer of an export) gets the same figures."""
    global _recent
    last, last_n, last_fp32, figures = _recent
    if last is record and last_n == n and last_fp32 is fp32:
        return figures
    figures = _layer_figures(record, n, fp32 if fp32 is not None and len(fp32) == n else None)
    _recent = (record, n, fp32, figures)
    return figures


def _layer_figures(record: dict, n: int, fp32: np.ndarray | None) -> StepFigures | None:
    layers = record.get("layers")
    if not isinstance(layers, dict) or n <= 0:
        return None
    scale = read_float(record.get("scale"))
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        scale = None
    lists = [layers.get(name) for name in FIGURES]
    if all(isinstance(v, list) and len(v) == n for v in lists) \
            and set(map(type, lists[0] + lists[1] + lists[2])) <= _NUMBERS:
        try:
            table = np.array(lists, dtype=np.float64)     # the common case: every figure a number
        except OverflowError:
            table = None    # an integer too large for a float: read value by value below
        if table is not None:
            act, grad, weight = (Figure(row, None) for row in table)
            return StepFigures(act, grad, weight, _bits(table, record.get("dtype"), scale, fp32))
    act, grad, weight = (figure(v, n) for v in lists)
    return StepFigures(act, grad, weight, headroom_bits(act, grad, weight, record.get("dtype"), scale, fp32))


def _log2_max(dtype, fp32: np.ndarray | None):
    """log2 of the largest finite value each layer has to stay under: the dtype's, fp32's where
    `fp32` says the layer runs in fp32."""
    # float32's for a name that isn't one of ours, or for no name at all (a damaged record can
    # hold any JSON value there)
    log2_max = _LOG2_MAX.get(dtype, _LOG2_MAX["float32"]) if isinstance(dtype, str) else _LOG2_MAX["float32"]
    return log2_max if fp32 is None else np.where(fp32, _LOG2_MAX["float32"], log2_max)


def _bits(table: np.ndarray, dtype, scale: float | None, fp32: np.ndarray | None = None) -> np.ndarray:
    """headroom_bits for three rows of measured figures (act, grad, weight): the least headroom
    is that of the largest magnitude, a NaN counting as the largest."""
    log2_max = _log2_max(dtype, fp32)
    magnitude = np.abs(table)
    if scale is not None:
        magnitude[1] *= scale
    nan = np.isnan(magnitude)
    if nan.any():
        magnitude[nan] = np.inf               # every figure was measured: NaN is a non-finite value
    with np.errstate(divide="ignore"):
        return log2_max - np.log2(magnitude.max(axis=0))


def headroom_bits(act: Figure, grad: Figure, weight: Figure, dtype, scale: float | None,
                  fp32: np.ndarray | None = None) -> np.ndarray:
    """Per layer, the bits left before the dtype's largest finite value (module docstring);
    `scale` is the loss scale in use (None without a scaler); `fp32`, the layers in fp32."""
    log2_max = _log2_max(dtype, fp32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        g = grad.values * scale if scale is not None else grad.values
        bits = None
        for fig, values in ((act, act.values), (grad, g), (weight, weight.values)):
            h = log2_max - np.log2(np.abs(values))       # 0 -> +inf, inf -> -inf, NaN stays NaN
            nan = np.isnan(values)
            if nan.any():
                h[nan if fig.missing is None else nan & ~fig.missing] = -np.inf   # a NaN value
            bits = h if bits is None else np.fmin(bits, h)               # fmin skips NaN (unmeasured)
    return bits
