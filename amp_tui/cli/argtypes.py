"""Argument types for the command line: each parses a value and names what was wrong with it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from amp_tui.core.commands import CommandError, parse_at
from amp_tui.core.precision import canonical


def _number(text: str, *, percent: bool = False) -> float:
    try:
        if percent and text.endswith("%"):
            return float(text[:-1]) / 100
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def bounded(check: Callable[[float], bool], requirement: str, *, percent: bool = False):
    """An argparse type accepting finite numbers for which `check` holds."""
    def parse(text: str) -> float:
        value = _number(text, percent=percent)
        if not (math.isfinite(value) and check(value)):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value
    return parse


positive = bounded(lambda v: v > 0, "a positive finite number")
nonnegative = bounded(lambda v: v >= 0, "a finite number ≥ 0")
share = bounded(lambda v: 0 < v <= 1, "a share between 0 and 1 (or a percentage)", percent=True)
unit_share = bounded(lambda v: 0 <= v <= 1, "between 0 and 1 (or a percentage)", percent=True)


def whole(minimum: int):
    """An argparse type accepting whole numbers of at least `minimum`."""
    requirement = "a positive integer" if minimum == 1 else f"a whole number, {minimum} or more"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value
    return parse


positive_int = whole(1)
nonnegative_int = whole(0)
budget = bounded(lambda v: 0 <= v <= 100, "a percentage between 0 and 100")


def probe_every(text: str) -> int | str:
    """`auto` (the adaptive schedule) or a whole number of steps."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"use auto or a whole number of steps, 1 or more, got {text!r}") from None


def fp8_every(text: str) -> int | str:
    """`auto` (spaced to a share of the probe budget) or a whole number of steps."""
    return probe_every(text)


def dtype(text: str) -> str:
    """A precision name in any of its spellings (fp16, half, torch.float16...), canonical."""
    try:
        return canonical(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def at(text: str) -> str:
    """`STEP:ACTION` as `--at` takes it (checked here, kept as typed: the run parses it again)."""
    try:
        parse_at(text)
    except CommandError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
