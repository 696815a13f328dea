"""Precision names and ranges: what a dtype is called and how far it reaches. No torch here:
the read side (reports, replays) needs these too; what a device can run is in
amp_tui.training.step.autocast."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16", "float32")

# Every spelling a user may type, to the canonical torch name used in records.
_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32", "f32": "float32",
}

SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# The order `d` cycles through in the dashboard.
CYCLE = {"float16": "bfloat16", "bfloat16": "float32", "float32": "float16"}

# Largest finite value of each dtype (torch.finfo(...).max), written out so that reading a
# recording needs no torch import: fp16 65504, bf16 ~3.39e38, fp32 ~3.40e38.
MAX_FINITE = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
# Smallest positive subnormal of fp16 (2**-24): gradients below it flush to zero.
FP16_TINY = 2.0**-24
# The loss scale's floor when the run sets none (--min-scale, min_scale=): GradScaler at scale 0
# applies NaN updates, so the scale is never let reach it.
SCALE_FLOOR = 2.0**-24


def canonical(name: str) -> str:
    """Map fp16/bf16/fp32 and friends to float16/bfloat16/float32, or raise ValueError."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise ValueError(f"unknown dtype {name!r}: use fp16, bf16 or fp32")
    return _ALIASES[key]


def short_name(dtype: str | None) -> str:
    """float16 -> fp16; a name that isn't one of ours as it is; "?" for none."""
    return SHORT.get(dtype or "", dtype or "?")


def uses_autocast(name: str) -> bool:
    return canonical(name) != "float32"


def uses_scaler(name: str) -> bool:
    # bf16 has fp32's exponent range: gradients don't underflow, so no loss scaling.
    return canonical(name) == "float16"
