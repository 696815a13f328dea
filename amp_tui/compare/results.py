"""What a comparison found, and its JSON form (the document docs/compare.md describes).

Plain records, no torch: the command renders them, and a caller can keep or serialise them
without the model around.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from amp_tui.compare.criteria import Criteria
from amp_tui.core.jsonsafe import encode_float

if TYPE_CHECKING:
    import torch


@dataclass
class Reference:
    """The fp32 run over the eval set: whether it is finite, its decisions' near-ties."""

    finite: bool
    nonfinite: int
    elements: int
    samples: int
    decision: str                       # "argmax" or "sign"
    near_ties: int
    near_tie_samples: list[list[int]]
    accuracy: float | None

    def as_json(self) -> dict:
        return {"dtype": "float32", "finite": self.finite, "nonfinite": self.nonfinite,
                "elements": self.elements, "samples": self.samples, "decision": self.decision,
                "near_ties": self.near_ties, "near_tie_samples": self.near_tie_samples,
                "accuracy": encode_float(self.accuracy)}


@dataclass
class DtypeResult:
    """One AMP dtype judged against the reference."""

    dtype: str
    status: str                          # pass / fail / unsupported / error
    failed: list[str] = field(default_factory=list)
    reason: str | None = None
    finite: bool | None = None
    nonfinite: int = 0
    elements: int = 0
    samples: int = 0
    max_abs: float | None = None
    mean_abs: float | None = None
    max_rel: float | None = None
    mean_rel: float | None = None
    out_of_tolerance: int = 0
    worst: dict | None = None            # where |amp - fp32| is largest
    flips: int = 0                       # decisions changed, near-ties excluded
    flip_samples: list[dict] = field(default_factory=list)
    near_tie_flips: int = 0
    near_tie_flip_samples: list[dict] = field(default_factory=list)
    agreement: float | None = None
    accuracy: float | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def as_json(self) -> dict:
        f = encode_float
        return {"dtype": self.dtype, "status": self.status, "passed": self.passed,
                "failed": list(self.failed), "reason": self.reason, "finite": self.finite,
                "nonfinite": self.nonfinite, "elements": self.elements, "samples": self.samples,
                "max_abs": f(self.max_abs), "mean_abs": f(self.mean_abs), "max_rel": f(self.max_rel),
                "mean_rel": f(self.mean_rel), "out_of_tolerance": self.out_of_tolerance,
                "worst": _json_sample(self.worst), "flips": self.flips,
                "flip_samples": [_json_sample(s) for s in self.flip_samples],
                "near_tie_flips": self.near_tie_flips,
                "near_tie_flip_samples": [_json_sample(s) for s in self.near_tie_flip_samples],
                "agreement": f(self.agreement), "accuracy": f(self.accuracy)}


def _json_sample(sample: dict | None) -> dict | None:
    # Scores of a sample can be inf/NaN: strict JSON spells those as strings.
    if sample is None:
        return None
    return {k: encode_float(v) if isinstance(v, float) else v for k, v in sample.items()}


@dataclass
class Validation:
    """The reference and every dtype's result, under the criteria they were judged by."""

    criteria: Criteria
    device: torch.device
    eval_source: str                     # "eval_batches" or "batches"
    eval_batches: int
    predict: str                         # "script" or "default"
    reference: Reference | None
    results: list[DtypeResult]
    batches: list = field(default_factory=list, repr=False)  # the eval set (host side)

    @property
    def passed(self) -> bool:
        return (self.reference is not None and self.reference.finite
                and all(r.passed for r in self.results))

    def as_json(self) -> dict:
        return {"criteria": self.criteria.as_json(),
                "eval_set": {"source": self.eval_source, "batches": self.eval_batches,
                             "samples": self.reference.samples if self.reference else 0,
                             "predict": self.predict},
                "reference": self.reference.as_json() if self.reference else None,
                "results": [r.as_json() for r in self.results],
                "passed": self.passed}


@dataclass
class SpeedRun:
    """One dtype's timed training steps and peak memory."""

    dtype: str
    median_ms: float | None = None
    step_ms: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    skipped_updates: int = 0
    error: str | None = None
    time_ratio: float | None = None      # median / fp32 median
    memory_ratio: float | None = None    # peak / fp32 peak

    def as_json(self) -> dict:
        f = encode_float
        return {"dtype": self.dtype, "median_ms": f(self.median_ms, 6),
                "min_ms": f(min(self.step_ms), 6) if self.step_ms else None,
                "max_ms": f(max(self.step_ms), 6) if self.step_ms else None,
                "time_ratio_vs_fp32": f(self.time_ratio, 4), "peak_bytes": self.peak_bytes,
                "memory_ratio_vs_fp32": f(self.memory_ratio, 4),
                "skipped_updates": self.skipped_updates, "error": self.error}


@dataclass
class Speed:
    """fp32 and each passing dtype, timed the same way."""

    steps: int
    warmup: int
    memory: str              # what peak_bytes means on this device
    runs: list[SpeedRun]
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"steps": self.steps, "warmup": self.warmup, "memory": self.memory,
                "runs": [r.as_json() for r in self.runs], "notes": list(self.notes)}
