"""Precision names and ranges: what a dtype is called and how far it reaches. No torch here:
the read side (reports, replays) needs these too; what a device can run is in
amp_tui.training.step.autocast."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16", "float32", "float8")

# Every spelling a user may type, to the canonical torch name used in records.
_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32", "f32": "float32",
    "fp8": "float8", "float8": "float8", "f8": "float8",
}

SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8": "fp8"}

# "float8" is torchao's fp8 training: the converted nn.Linear layers' GEMMs take fp8 inputs, each
# tensor scaled to fit; everything else runs under bf16 autocast. So its autocast dtype, and the
# range the layers' figures are judged against, are bf16's.
AUTOCAST_OF = {"float8": "bfloat16"}

# The largest finite value of each fp8 format: torchao's tensorwise cast scales a tensor by this
# over its amax (e4m3 for inputs and weights, e5m2 for output gradients, its default recipe).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_FORMATS = ("e4m3", "e4m3", "e5m2")   # of [input, weight, grad_output]

# torchao's shape rule: an fp8 GEMM wants both dimensions of the weight a multiple of 16.
FP8_SHAPE_MULTIPLE = 16

# The order `d` cycles through in the dashboard; fp8 is entered by name only (it needs torchao,
# and a filter), and `d` takes it back to bf16.
CYCLE = {"float16": "bfloat16", "bfloat16": "float32", "float32": "float16", "float8": "bfloat16"}

# Largest finite value of each dtype (torch.finfo(...).max), written out so that reading a
# recording needs no torch import: fp16 65504, bf16 ~3.39e38, fp32 ~3.40e38.
MAX_FINITE = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
MAX_FINITE["float8"] = MAX_FINITE["bfloat16"]
# Smallest positive subnormal of fp16 (2**-24): gradients below it flush to zero.
FP16_TINY = 2.0**-24
# The loss scale's floor when the run sets none (--min-scale, min_scale=): GradScaler at scale 0
# applies NaN updates, so the scale is never let reach it.
SCALE_FLOOR = 2.0**-24


def canonical(name: str) -> str:
    """Map fp16/bf16/fp32 and friends to float16/bfloat16/float32, or raise ValueError."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise ValueError(f"unknown dtype {name!r}: use fp16, bf16, fp32 or fp8")
    return _ALIASES[key]


def short_name(dtype: str | None) -> str:
    """float16 -> fp16; a name that isn't one of ours as it is; "?" for none."""
    return SHORT.get(dtype or "", dtype or "?")


def autocast_name(name: str) -> str:
    """The dtype autocast runs in under `name`: bf16 for fp8, the dtype itself otherwise."""
    name = canonical(name)
    return AUTOCAST_OF.get(name, name)


def uses_autocast(name: str) -> bool:
    return canonical(name) != "float32"


def uses_scaler(name: str) -> bool:
    # bf16 has fp32's exponent range: gradients don't underflow, so no loss scaling.
    return canonical(name) == "float16"
