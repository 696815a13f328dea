"""`amp-tui compare`: validate AMP dtypes against an fp32 reference, then measure what they buy.

The method (seed 004): fix the pass criteria before the trial; run the model in eval mode in fp32
on a fixed evaluation set as the reference (and check that the reference itself is finite); run
the *same* weights on the *same* batches under `torch.autocast` for each dtype; compare the scores
(finite, absolute and relative differences, elementwise tolerance) AND the decisions they lead to
(argmax flips), keeping apart the flips of near-ties, which a within-tolerance wobble of the
scores can legitimately turn; report a quality metric (agreement with the reference decisions).
Only then, and only for the dtypes that passed, `--speed` times lean training steps (no probes, no
host syncs of our own) and measures peak memory against fp32 with the same shapes and batches.

Everything here is usable as a library: `validate()` and `measure_speed()` take a `TrainSetup`.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import gc
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from amp_tui.cli import argtypes

from amp_tui.core import precision
from amp_tui.core.numfmt import number
from amp_tui.core.jsonsafe import encode_float
from amp_tui.training.autocast import autocast, unsupported_reason
from amp_tui.training.script import ScriptError, TrainSetup, describe_exception

# ---- defaults, all documented in docs/compare.md -------------------------------------------
DEFAULT_DTYPES = ("float16", "bfloat16")
DEFAULT_EVAL_BATCHES = 4
DEFAULT_ATOL = 1e-2
DEFAULT_RTOL = 1e-2
DEFAULT_MAX_FLIPS = "0"
DEFAULT_MIN_AGREEMENT = 0.95
DEFAULT_SPEED_STEPS = 20
DEFAULT_WARMUP = 3
# Relative difference = |amp - fp32| / max(|fp32|, REL_FLOOR): a reference score that happens to
# sit near zero does not make the relative figure explode.
REL_FLOOR = 1e-3
# How many flip / near-tie sample indices are listed (all are counted).
SHOW = 10
# Distinct training batches the speed runs cycle through (moved to the device once).
SPEED_BATCHES = 8
# Label keys looked for in dict batches (for the optional accuracy figure).
LABEL_KEYS = ("labels", "label", "targets", "target", "y")


# ---- criteria --------------------------------------------------------------------------------
@dataclass(frozen=True)
class MaxFlips:
    """--max-flips: a count (N) or a share of the eval samples (0.01, 1%)."""

    count: int | None = 0
    share: float | None = None

    def allowed(self, samples: int) -> float:
        return float(self.count) if self.share is None else self.share * samples

    def describe(self) -> str:
        if self.share is None:
            return f"≤ {self.count}"
        return f"≤ {self.share:.4g} of the samples"

    def as_json(self) -> dict:
        return {"count": self.count, "share": self.share}


@dataclass(frozen=True)
class Criteria:
    """Every pass criterion, fixed before the run."""

    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    max_flips: MaxFlips = field(default_factory=MaxFlips)
    tie_margin: float | None = None    # None: "inside the tolerance" (see near_tie_rule)
    min_agreement: float = DEFAULT_MIN_AGREEMENT

    def tolerance(self, ref: torch.Tensor) -> torch.Tensor:
        return self.atol + self.rtol * ref.abs()

    def near_tie_rule(self, decision: str = "argmax") -> str:
        if self.tie_margin is not None:
            what = "top-2 gap" if decision == "argmax" else "|score|"
            return f"reference {what} ≤ {self.tie_margin:g}"
        if decision == "sign":
            return "reference |score| ≤ atol + rtol·|score| (within tolerance of the threshold 0)"
        return "reference top-2 gap ≤ the two scores' tolerances added (atol + rtol·|s| each)"

    def lines(self, decision: str | None = None) -> list[tuple[str, str]]:
        return [
            ("finite outputs", "required (no inf/NaN in any score)"),
            ("scores", f"|amp − fp32| ≤ {self.atol:g} + {self.rtol:g}·|fp32| for every element"),
            ("decision flips", f"{self.max_flips.describe()}, near-ties not counted"),
            ("near-tie", self.near_tie_rule(decision or "argmax")),
            ("agreement with fp32", f"≥ {self.min_agreement:g} of the decisions (near-ties included)"),
        ]

    def as_json(self) -> dict:
        return {"finite": True, "atol": self.atol, "rtol": self.rtol, "rel_floor": REL_FLOOR,
                "max_flips": self.max_flips.as_json(), "tie_margin": self.tie_margin,
                "tie_margin_rule": "fixed" if self.tie_margin is not None else "tolerance",
                "min_agreement": self.min_agreement}


# ---- results ---------------------------------------------------------------------------------
@dataclass
class Reference:
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
    if sample is None:
        return None
    return {k: encode_float(v) if isinstance(v, float) else v for k, v in sample.items()}


@dataclass
class Validation:
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


# ---- scores and decisions --------------------------------------------------------------------
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


def _as_scores(out: Any) -> torch.Tensor | None:
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


def _sample_index(batch_index: int, index: tuple) -> list[int]:
    return [batch_index, *[int(i) for i in index]]


# ---- validation ------------------------------------------------------------------------------
def _take(iterable, count: int | None) -> list:
    out = []
    for item in iterable:
        out.append(item)
        if count is not None and len(out) >= count:
            break
    return out


def eval_set(setup: TrainSetup, default_count: int, script: Path) -> tuple[list, str]:
    """The fixed evaluation set (host side): the script's eval_batches, or the first batches."""
    if setup.eval_batches is not None:
        try:
            batches = _take(setup.eval_batches, None)
        except Exception as exc:  # noqa: BLE001 - user code
            raise ScriptError(f"iterating 'eval_batches' from {script.name} failed: "
                              f"{describe_exception(exc, script)}") from None
        if not batches:
            raise ScriptError(f"'eval_batches' from {script.name} is empty")
        return batches, "eval_batches"
    try:
        batches = _take(setup.batches, default_count)
    except Exception as exc:  # noqa: BLE001
        raise ScriptError(f"iterating 'batches' from {script.name} failed: "
                          f"{describe_exception(exc, script)}") from None
    if not batches:
        raise ScriptError(f"'batches' from {script.name} is empty")
    return batches, "batches"


class _PredictFailed(Exception):
    def __init__(self, exc: BaseException):
        super().__init__(exc)
        self.exc = exc


def _predict_scores(model, batch, predict, device: torch.device, dtype: str) -> torch.Tensor:
    """predict(model, batch) in eval, under no_grad, with autocast in `dtype` (off for fp32);
    the scores come back as float32."""
    with torch.no_grad(), autocast(device.type, dtype):
        try:
            raw = predict(model, batch)
        except Exception as exc:  # noqa: BLE001 - reported by the caller with the batch index
            raise _PredictFailed(exc) from None
        scores = _as_scores(raw)
        if scores is None:
            raise _PredictFailed(TypeError(f"returned a {type(raw).__name__}; return a tensor of scores"))
        return scores.detach().to(torch.float32)


@dataclass
class _RefBatch:
    """What each dtype is compared against, for one eval batch."""

    scores: torch.Tensor
    decisions: torch.Tensor
    near: torch.Tensor
    gap: torch.Tensor
    labels: torch.Tensor | None


def validate(setup: TrainSetup, device: torch.device, dtypes: list[str], criteria: Criteria, *,
             script: Path, eval_batches_default: int = DEFAULT_EVAL_BATCHES) -> Validation:
    """The fp32 reference, then each dtype against it, one eval batch at a time (so only one
    batch's scores are held per dtype). Script problems raise ScriptError."""
    from amp_tui.training.devices import move_to_device

    host_batches, source = eval_set(setup, eval_batches_default, script)
    predict = setup.predict or default_predict
    what = (f"predict in {script.name}" if setup.predict is not None
            else "the model (default predict: the model's output)")
    model = copy.deepcopy(setup.model).to(device).eval()
    tallies: dict[str, _Tally] = {}
    results: dict[str, DtypeResult] = {}
    for dtype in dtypes:
        reason = unsupported_reason(device, dtype)
        if reason:
            results[dtype] = DtypeResult(dtype, "unsupported", reason=reason)
        else:
            tallies[dtype] = _Tally(dtype, criteria)
    ref = _RefTally(criteria)
    try:
        for b, host in enumerate(host_batches):
            batch = move_to_device(host, device)
            try:
                scores = _predict_scores(model, batch, predict, device, "float32")
            except _PredictFailed as failed:  # a broken reference is a script problem: exit 2
                raise ScriptError(f"{what} failed on eval batch {b} in fp32: "
                                  f"{describe_exception(failed.exc, script)}") from None
            reference = ref.add(b, scores, batch)
            if not ref.finite:
                continue  # nothing can be judged against a non-finite reference
            for dtype, tally in tallies.items():
                if tally.error:
                    continue
                try:
                    amp = _predict_scores(model, batch, predict, device, dtype)
                except _PredictFailed as failed:
                    tally.error = (f"{what} failed on eval batch {b} under {precision.SHORT[dtype]} "
                                   f"autocast: {describe_exception(failed.exc, script)}")
                    continue
                tally.add(b, reference, amp)
    finally:
        del model
    if ref.samples == 0:
        raise ScriptError(f"{what} returned empty scores")
    reference_info = ref.result()
    if reference_info.finite:
        results.update({dtype: tally.result() for dtype, tally in tallies.items()})
    return Validation(criteria, device, source, len(host_batches),
                      "script" if setup.predict is not None else "default", reference_info,
                      [results[d] for d in dtypes if d in results], host_batches)


class _RefTally:
    def __init__(self, criteria: Criteria):
        self.criteria = criteria
        self.kind: str | None = None
        self.nonfinite = self.elements = self.samples = 0
        self.near_count = 0
        self.near_samples: list[list[int]] = []
        self.correct = 0
        self.all_labelled = True

    @property
    def finite(self) -> bool:
        return self.nonfinite == 0

    def add(self, b: int, scores: torch.Tensor, batch) -> _RefBatch:
        kind = decision_kind(scores)
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            raise ScriptError(f"eval batch {b} gives scores of shape {tuple(scores.shape)}, unlike "
                              f"batch 0 ({self.kind} decisions): every batch needs the same kind of output")
        self.nonfinite += int((~torch.isfinite(scores)).sum())
        self.elements += scores.numel()
        decisions = decide(scores, kind)
        near, gap = near_ties(scores, kind, self.criteria)
        self.samples += decisions.numel()
        self.near_count += int(near.sum())
        for index in near.nonzero().tolist()[:max(0, SHOW - len(self.near_samples))]:
            self.near_samples.append(_sample_index(b, tuple(index)))
        labels = find_labels(batch, decisions.shape)
        if labels is None:
            self.all_labelled = False
        else:
            labels = labels.to(decisions.device, decisions.dtype)
            self.correct += int((decisions == labels).sum())
        return _RefBatch(scores, decisions, near, gap, labels)

    def result(self) -> Reference:
        accuracy = self.correct / self.samples if self.samples and self.all_labelled else None
        return Reference(finite=self.finite, nonfinite=self.nonfinite, elements=self.elements,
                         samples=self.samples, decision=self.kind or "argmax",
                         near_ties=self.near_count, near_tie_samples=self.near_samples,
                         accuracy=accuracy)


class _Tally:
    """One dtype's running comparison with the reference."""

    def __init__(self, dtype: str, criteria: Criteria):
        self.dtype = dtype
        self.criteria = criteria
        self.r = DtypeResult(dtype, "pass", max_abs=0.0, max_rel=0.0)
        self.sum_abs = self.sum_rel = 0.0
        self.correct = 0
        self.all_labelled = True
        self.error: str | None = None

    def add(self, b: int, ref: _RefBatch, amp: torch.Tensor) -> None:
        r, crit = self.r, self.criteria
        if amp.shape != ref.scores.shape:
            self.error = (f"scores under {precision.SHORT[self.dtype]} have shape {tuple(amp.shape)} on "
                          f"eval batch {b}, fp32 gave {tuple(ref.scores.shape)}")
            return
        finite = torch.isfinite(amp)
        r.nonfinite += int((~finite).sum())
        r.elements += amp.numel()
        diff = torch.where(finite, (amp - ref.scores).abs(), torch.full_like(amp, math.inf))
        rel = diff / ref.scores.abs().clamp_min(REL_FLOOR)
        r.out_of_tolerance += int((diff > crit.tolerance(ref.scores)).sum())
        if diff.numel():
            flat = int(diff.reshape(-1).argmax())
            batch_max = float(diff.reshape(-1)[flat])
            if r.worst is None or batch_max > r.max_abs:
                r.worst = {"index": _sample_index(b, tuple(_unravel(flat, diff.shape))),
                           "fp32": float(ref.scores.reshape(-1)[flat]),
                           "amp": float(amp.reshape(-1)[flat]), "abs": batch_max}
            r.max_abs = max(r.max_abs, batch_max)
            r.max_rel = max(r.max_rel, float(rel.max()))
            self.sum_abs += float(diff.sum())
            self.sum_rel += float(rel.sum())

        decisions = decide(amp, decision_kind(ref.scores))
        changed = decisions != ref.decisions
        r.samples += decisions.numel()
        for mask, listed, counter in ((changed & ~ref.near, r.flip_samples, "flips"),
                                      (changed & ref.near, r.near_tie_flip_samples, "near_tie_flips")):
            setattr(r, counter, getattr(r, counter) + int(mask.sum()))
            for index in mask.nonzero().tolist()[:max(0, SHOW - len(listed))]:
                i = tuple(index)
                listed.append({"index": _sample_index(b, i), "fp32": int(ref.decisions[i]),
                               "amp": int(decisions[i]), "margin": float(ref.gap[i])})
        if ref.labels is None:
            self.all_labelled = False
        else:
            self.correct += int((decisions == ref.labels).sum())

    def result(self) -> DtypeResult:
        r, crit = self.r, self.criteria
        if self.error:
            return DtypeResult(self.dtype, "error", failed=["error"], reason=self.error)
        r.finite = r.nonfinite == 0
        r.mean_abs = self.sum_abs / r.elements if r.elements else 0.0
        r.mean_rel = self.sum_rel / r.elements if r.elements else 0.0
        r.agreement = 1.0 - (r.flips + r.near_tie_flips) / r.samples if r.samples else 1.0
        if r.samples and self.all_labelled:
            r.accuracy = self.correct / r.samples
        if not r.finite:
            r.failed.append("finite")
        if r.out_of_tolerance:
            r.failed.append("tolerance")
        if r.flips > crit.max_flips.allowed(r.samples):
            r.failed.append("flips")
        if r.agreement < crit.min_agreement:
            r.failed.append("agreement")
        r.status = "fail" if r.failed else "pass"
        return r


def _unravel(flat: int, shape: torch.Size) -> list[int]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return list(reversed(index))


# ---- speed and memory ------------------------------------------------------------------------
@dataclass
class SpeedRun:
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
    steps: int
    warmup: int
    memory: str              # what peak_bytes means on this device
    runs: list[SpeedRun]
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"steps": self.steps, "warmup": self.warmup, "memory": self.memory,
                "runs": [r.as_json() for r in self.runs], "notes": list(self.notes)}


class PeakMemory:
    """Peak memory a training run adds on top of what was in use before it.

    CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus the memory
    allocated before the run's copies were built (exact, for tensors through PyTorch's allocator).
    CPU (Linux): the process's resident-set high-water mark (VmHWM), reset through
    /proc/self/clear_refs at the start of the timed steps, minus the resident size before the
    copies were built, after handing freed heap back with malloc_trim so earlier runs don't
    lend their freed pages to later ones. It counts everything the process touched (allocator
    slack and caches included): compare it against fp32's figure, not against a tensor count.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.base: int | None = None
        self._libc = None
        if device.type == "cuda":
            self.kind = "cuda max_memory_allocated during the timed steps, minus memory in use before"
            self.available = True
        else:
            self.available = _read_status("VmHWM") is not None and _can_reset_hwm()
            self.kind = ("peak resident set size (VmHWM) during the timed steps, minus resident size "
                         "before the run" if self.available else
                         "unavailable: peak resident memory needs Linux /proc/self/clear_refs")
            path = ctypes.util.find_library("c")
            try:
                self._libc = ctypes.CDLL(path) if path else None
            except OSError:
                self._libc = None

    def _trim(self) -> None:
        gc.collect()
        if self._libc is not None and hasattr(self._libc, "malloc_trim"):
            self._libc.malloc_trim(0)

    def before_run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.available:
            self._trim()
            self.base = _read_status("VmRSS")

    def start_timing(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.available:
            if self._libc is not None and hasattr(self._libc, "malloc_trim"):
                self._libc.malloc_trim(0)
            _reset_hwm()

    def peak(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
        hwm = _read_status("VmHWM")
        return None if hwm is None else max(0, hwm - self.base)


def _read_status(key: str) -> int | None:
    """A /proc/self/status figure in bytes (Linux), or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # "reset the peak resident set size to the current one" (Linux >= 4.0)
        return True
    except OSError:
        return False


def _can_reset_hwm() -> bool:
    return _reset_hwm()


def _training_batches(setup: TrainSetup, device: torch.device, fallback: list) -> list:
    from amp_tui.training.devices import move_to_device
    try:
        batches = _take(setup.batches, SPEED_BATCHES)
    except Exception:  # noqa: BLE001 - validation already iterated it; fall back to the eval set
        batches = []
    return [move_to_device(b, device) for b in (batches or fallback)]


def lean_steps(model, optimizer, loss_fn, batches: list, device: torch.device, dtype: str, *,
               steps: int, warmup: int, accumulate: int = 1, max_grad_norm: float | None = None,
               memory: PeakMemory | None = None) -> SpeedRun:
    """Time `steps` training steps after `warmup`: autocast forward, scaled backward, (unscale_ and
    clip when the script clips), scaler.step, update. No finite checks, no probes, no .item():
    on CUDA the per-step times come from CUDA events read once at the end."""
    run = SpeedRun(dtype)
    use_scaler = precision.uses_scaler(dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    cuda = device.type == "cuda"
    model.train()
    scales: list[torch.Tensor] = []
    events: list[tuple] = []
    host_ms: list[float] = []
    feed = 0

    def one_step():
        nonlocal feed
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            batch = batches[feed % len(batches)]
            feed += 1
            with autocast(device.type, dtype):
                loss = loss_fn(model, batch)
            if accumulate > 1:
                loss = loss / accumulate
            scaler.scale(loss).backward()
        if max_grad_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        scaler.step(optimizer)
        scaler.update()

    for _ in range(warmup):
        one_step()
    if memory is not None:
        memory.start_timing()
    elif cuda:
        torch.cuda.synchronize(device)
    if use_scaler:
        scales.append(_scale_snapshot(scaler))
    stream = torch.cuda.current_stream(device) if cuda else None
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            one_step()
            end.record(stream)
            events.append((start, end))
        else:
            t0 = time.perf_counter()
            one_step()
            host_ms.append((time.perf_counter() - t0) * 1000.0)
        if use_scaler:
            scales.append(_scale_snapshot(scaler))
    if cuda:
        torch.cuda.synchronize(device)
        host_ms = [s.elapsed_time(e) for s, e in events]
    run.step_ms = host_ms
    run.median_ms = statistics.median(host_ms) if host_ms else None
    if len(scales) > 1:
        values = [float(s) for s in scales]  # the host reads, after the timed steps
        run.skipped_updates = sum(1 for a, b in zip(values, values[1:]) if b < a)
    if memory is not None:
        run.peak_bytes = memory.peak()
    return run


def _scale_snapshot(scaler: torch.amp.GradScaler):
    """The live loss scale without a host sync: a device-side copy (or the initial float before
    the first scale() created it)."""
    live = getattr(scaler, "_scale", None)
    return live.detach().clone() if live is not None else float(scaler.get_scale())


def measure_speed(setup: TrainSetup, device: torch.device, dtypes: list[str], *, steps: int,
                  warmup: int, script: Path, eval_fallback: list | None = None) -> Speed:
    """fp32 first, then each dtype: fresh deep copies of the script's model AND optimizer
    (copied together, so the copy steps the copied parameters with the script's hyperparameters
    and any state it holds), the same training batches, the same step count.

    One unmeasured step per dtype comes first, so one-time process costs (kernel and library
    caches, autograd threads) land on no measured run -- otherwise fp32, measured first, would
    carry them all."""
    batches = _training_batches(setup, device, eval_fallback or [])
    memory = PeakMemory(device)
    speed = Speed(steps, warmup, memory.kind, [])
    if setup.scheduler is not None:
        speed.notes.append("the script's LR scheduler is not stepped while timing")
    order = ["float32", *dtypes]
    for dtype in order:
        try:
            _speed_run(setup, device, dtype, batches, steps=0, warmup=1, memory=None)
        except Exception:  # noqa: BLE001 - the measured run below reports it
            pass
    for dtype in order:
        memory.before_run()
        try:
            run = _speed_run(setup, device, dtype, batches, steps=steps, warmup=warmup,
                             memory=memory if memory.available else None)
        except Exception as exc:  # noqa: BLE001 - the user's loss_fn or a kernel; reported per dtype
            run = SpeedRun(dtype, error=describe_exception(exc, script))
        speed.runs.append(run)
    busy = _busy_note()
    if busy:
        speed.notes.append(busy)
    base = speed.runs[0]
    for run in speed.runs:
        if run.median_ms is not None and base.median_ms:
            run.time_ratio = run.median_ms / base.median_ms
        if run.peak_bytes is not None and base.peak_bytes:
            run.memory_ratio = run.peak_bytes / base.peak_bytes
    return speed


def _busy_note() -> str | None:
    """Timings from a machine with more runnable work than cores are noisy: say so."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"load average {load:.1f} on {cores} CPU cores while timing: other work competed for the "
            f"CPU, so the times are noisy (torch intra-op threads: {torch.get_num_threads()})")


def _speed_run(setup: TrainSetup, device, dtype, batches, *, steps, warmup, memory) -> SpeedRun:
    model, optimizer = copy.deepcopy((setup.model, setup.optimizer))
    model.to(device)
    try:
        return lean_steps(model, optimizer, setup.loss_fn, batches, device, dtype, steps=steps,
                          warmup=warmup, accumulate=setup.accumulate,
                          max_grad_norm=setup.max_grad_norm, memory=memory)
    finally:
        del model, optimizer


# ---- command line ----------------------------------------------------------------------------
def _dtype_list(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            name = precision.canonical(part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if name == "float32":
            raise argparse.ArgumentTypeError("fp32 is the reference: list fp16 and/or bf16")
        if name not in out:
            out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("name at least one dtype: fp16, bf16 or fp16,bf16")
    return out





def _max_flips(text: str) -> MaxFlips:
    """A whole number is a count; a decimal in [0, 1] or a percentage is a share of the samples."""
    text = text.strip()
    if text.isdigit():
        return MaxFlips(count=int(text))
    share = argtypes.unit_share(text)
    return MaxFlips(count=None, share=share)


def add_parser(sub) -> argparse.ArgumentParser:

    p = sub.add_parser(
        "compare", help="validate fp16/bf16 against an fp32 reference on a fixed eval set",
        description="Run SCRIPT's model in eval mode in fp32 (the reference) and under each AMP dtype "
                    "on a fixed evaluation set, and judge scores and decisions against criteria "
                    "declared up front. Exit 0: every dtype passed; 1: a criterion failed; 2: bad "
                    "command line or script. Arguments after -- go to the script.")
    p.add_argument("script", type=Path, help="a Python file with a setup() function")
    p.add_argument("--dtypes", type=_dtype_list, default=list(DEFAULT_DTYPES), metavar="LIST",
                   help="AMP dtypes to validate, comma-separated (default fp16,bf16)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--eval-batches", type=argtypes.positive_int, default=DEFAULT_EVAL_BATCHES, metavar="N",
                   help="when the script has no eval_batches: use the first N of its batches "
                        f"(default {DEFAULT_EVAL_BATCHES})")
    crit = p.add_argument_group("criteria (fixed before the run)")
    crit.add_argument("--atol", type=argtypes.nonnegative, default=DEFAULT_ATOL, metavar="X",
                      help=f"absolute score tolerance (default {DEFAULT_ATOL:g})")
    crit.add_argument("--rtol", type=argtypes.nonnegative, default=DEFAULT_RTOL, metavar="X",
                      help=f"relative score tolerance: each element within atol + rtol·|fp32| "
                           f"(default {DEFAULT_RTOL:g})")
    crit.add_argument("--max-flips", type=_max_flips, default=_max_flips(DEFAULT_MAX_FLIPS),
                      metavar="N|SHARE",
                      help="decisions allowed to change, near-ties excluded: a count (default 0) "
                           "or a share of the samples (0.01 or 1%%)")
    crit.add_argument("--tie-margin", type=argtypes.nonnegative, default=None, metavar="X",
                      help="a sample is a near-tie when the reference's top-2 score gap (|score| for "
                           "a single output) is ≤ X (default: within the score tolerance)")
    crit.add_argument("--min-agreement", type=argtypes.unit_share, default=DEFAULT_MIN_AGREEMENT, metavar="X",
                      help="minimum share of decisions equal to fp32's, near-ties included "
                           f"(default {DEFAULT_MIN_AGREEMENT:g})")
    sp = p.add_argument_group("speed and memory (after validation, passing dtypes only)")
    sp.add_argument("--speed", action="store_true",
                    help="time training steps and measure peak memory against fp32")
    sp.add_argument("--speed-steps", type=argtypes.positive_int, default=DEFAULT_SPEED_STEPS, metavar="N",
                    help=f"timed training steps per dtype (default {DEFAULT_SPEED_STEPS})")
    sp.add_argument("--warmup", type=argtypes.nonnegative_int, default=DEFAULT_WARMUP, metavar="N",
                    help=f"untimed steps first (default {DEFAULT_WARMUP})")
    p.add_argument("--json", action="store_true", help="machine-readable output (strict JSON)")
    return p


def criteria_from_args(args) -> Criteria:
    return Criteria(atol=args.atol, rtol=args.rtol, max_flips=args.max_flips,
                    tie_margin=args.tie_margin, min_agreement=args.min_agreement)


def cmd_compare(args, script_argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.text import Text

    from amp_tui.cli import _error
    from amp_tui.training.devices import DeviceError, describe_device, resolve_device
    from amp_tui.training.script import load_script

    script_argv = list(script_argv or [])
    criteria = criteria_from_args(args)
    console = Console(highlight=False, stderr=False)
    try:
        device = resolve_device(args.device)
        setup = load_script(args.script, device=str(device), argv=script_argv, dtype="float32")
    except (ScriptError, DeviceError) as exc:
        return _error(str(exc))
    if not args.json:
        _print_header(console, args.script, device, args.dtypes, criteria, setup.warnings)
    try:
        validation = validate(setup, device, args.dtypes, criteria, script=args.script,
                              eval_batches_default=args.eval_batches)
    except ScriptError as exc:
        return _error(str(exc))
    if not args.json:
        render(validation, console)
    speed = None
    passing = [r.dtype for r in validation.results if r.passed]
    if args.speed and passing:
        if not args.json:
            console.print(Text(f"measuring speed: fp32, {', '.join(precision.SHORT[d] for d in passing)} "
                               f"({args.warmup} warm-up + {args.speed_steps} timed steps each)…"))
        speed = measure_speed(setup, device, passing, steps=args.speed_steps, warmup=args.warmup,
                              script=args.script, eval_fallback=validation.batches)
        if not args.json:
            render_speed(speed, console)
    elif args.speed and not args.json and validation.reference.finite:
        console.print(Text("speed: no dtype passed validation, nothing worth measuring"))
    status = 0 if validation.passed else 1
    if args.json:
        from amp_tui.core.jsonsafe import dumps
        data = {"script": str(args.script), "script_argv": script_argv,
                "device": describe_device(device), "dtypes": list(args.dtypes),
                **validation.as_json(),
                "speed": speed.as_json() if speed else None,
                "speed_requested": bool(args.speed), "exit_status": status}
        print(dumps(data))
    else:
        render_verdict(validation, console)
    return status


# ---- human output ----------------------------------------------------------------------------
def _fmt(x: float | None, digits: int = 3) -> str:
    return number(x, digits, missing="–")


def _bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _idx(sample: dict) -> str:
    return "(" + ", ".join(str(i) for i in sample["index"]) + ")"


def _print_header(console, script: Path, device, dtypes, criteria: Criteria, warnings) -> None:
    from rich.text import Text

    from amp_tui.training.devices import describe_device

    info = describe_device(device)
    title = Text("amp-tui compare ", style="bold")
    title.append(str(script))
    title.append(f"   device {info['type']}{'' if info['index'] is None else ':' + str(info['index'])} "
                 f"({info['name']})", style="dim")
    console.print(title)
    for warning in warnings:
        console.print(Text("warning: ", style="yellow") + Text(warning))
    console.print(Text(f"criteria, declared before the run (dtypes: "
                       f"{', '.join(precision.SHORT[d] for d in dtypes)}):", style="bold"))
    for name, text in criteria.lines():
        console.print(Text(f"  {name:<21}{text}"))


def render(validation: Validation, console) -> None:
    """The eval set, the reference and the per-dtype table, with flips and near-ties listed."""
    from rich.table import Table
    from rich.text import Text

    ref = validation.reference
    source = ("the script's eval_batches" if validation.eval_source == "eval_batches"
              else f"the first {validation.eval_batches} of the script's batches")
    predict = "the script's predict()" if validation.predict == "script" else "the model's output"
    console.print(Text(f"eval set     {validation.eval_batches} batches, {ref.samples} samples "
                       f"({source}); scores from {predict}; decisions by "
                       f"{'argmax over the last dim' if ref.decision == 'argmax' else 'sign (score > 0)'}"))
    near = f"{ref.near_ties} near-tie{'s' if ref.near_ties != 1 else ''}"
    if ref.near_tie_samples:
        near += " at " + ", ".join(_idx({"index": s}) for s in ref.near_tie_samples)
        near += " …" if ref.near_ties > len(ref.near_tie_samples) else ""
    acc = "" if ref.accuracy is None else f", label accuracy {ref.accuracy:.4f}"
    ref_state = "finite" if ref.finite else f"{ref.nonfinite} NON-FINITE scores"
    console.print(Text(f"fp32 ref     {ref_state}, {near}{acc}"))
    if not ref.finite:
        console.print(Text("FAIL  the fp32 reference has non-finite outputs: fix the model before "
                           "comparing dtypes against it", style="bold red"))
        return

    results = validation.results
    table = Table(title="scores and decisions against fp32", title_justify="left")
    table.add_column("", style="bold")
    for r in results:
        table.add_column(precision.SHORT[r.dtype], justify="right")

    def row(label, fn):
        table.add_row(label, *[Text(fn(r)) if r.status in ("pass", "fail") else Text("–")
                               for r in results])

    row("finite outputs", lambda r: "yes" if r.finite else f"NO ({r.nonfinite})")
    row("max |diff|", lambda r: _fmt(r.max_abs))
    row("mean |diff|", lambda r: _fmt(r.mean_abs))
    row("max rel diff", lambda r: _fmt(r.max_rel))
    row("mean rel diff", lambda r: _fmt(r.mean_rel))
    row("out of tolerance", lambda r: f"{r.out_of_tolerance} / {r.elements}")
    row("decision flips", lambda r: str(r.flips))
    row("near-tie flips", lambda r: str(r.near_tie_flips))
    row("agreement", lambda r: f"{r.agreement:.4f}")
    if any(r.accuracy is not None for r in results):
        row("label accuracy", lambda r: _fmt(r.accuracy, 4))
    table.add_row("result", *[_status_text(r) for r in results])
    console.print(table)

    for r in results:
        name = precision.SHORT[r.dtype]
        if r.worst is not None and r.max_abs and math.isfinite(r.max_abs):
            w = r.worst
            console.print(Text(f"{name}: largest difference at {_idx(w)}: fp32 {_fmt(w['fp32'], 6)}, "
                               f"{name} {_fmt(w['amp'], 6)}"))
        if r.flip_samples:
            more = " …" if r.flips > len(r.flip_samples) else ""
            console.print(Text(f"{name}: decision flips at " + ", ".join(
                f"{_idx(s)} {s['fp32']}→{s['amp']} (margin {_fmt(s['margin'])})" for s in r.flip_samples)
                + more))
        if r.near_tie_flip_samples:
            more = " …" if r.near_tie_flips > len(r.near_tie_flip_samples) else ""
            console.print(Text(f"{name}: near-tie flips (not counted) at " + ", ".join(
                f"{_idx(s)} {s['fp32']}→{s['amp']} (margin {_fmt(s['margin'])})"
                for s in r.near_tie_flip_samples) + more))


def render_verdict(validation: Validation, console) -> None:
    """One PASS/FAIL line per dtype, naming every failed criterion."""
    from rich.text import Text

    for r in validation.results:
        name = precision.SHORT[r.dtype]
        if r.status == "pass":
            console.print(Text(f"PASS  {name}", style="bold green"))
        elif r.status == "unsupported":
            console.print(Text(f"FAIL  {name}: unsupported here ({r.reason})", style="bold red"))
        elif r.status == "error":
            console.print(Text(f"FAIL  {name}: ", style="bold red") + Text(r.reason or "error"))
        else:
            console.print(Text(f"FAIL  {name}: {_why(r, validation.criteria)}", style="bold red"))


def _status_text(r: DtypeResult):
    from rich.text import Text
    return {"pass": Text("PASS", style="bold green"), "fail": Text("FAIL", style="bold red"),
            "unsupported": Text("unsupported", style="yellow"),
            "error": Text("error", style="bold red")}[r.status]


def _why(r: DtypeResult, crit: Criteria) -> str:
    parts = []
    for name in r.failed:
        if name == "finite":
            parts.append(f"{r.nonfinite} non-finite scores")
        elif name == "tolerance":
            parts.append(f"{r.out_of_tolerance} scores outside {crit.atol:g} + {crit.rtol:g}·|fp32| "
                         f"(max |diff| {_fmt(r.max_abs)})")
        elif name == "flips":
            parts.append(f"{r.flips} decision flip{'s' if r.flips != 1 else ''} "
                         f"(allowed {crit.max_flips.describe()})")
        elif name == "agreement":
            parts.append(f"agreement {r.agreement:.4f} < {crit.min_agreement:g}")
    return "; ".join(parts)


def render_speed(speed: Speed, console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"training step, median of {speed.steps} after {speed.warmup} warm-up",
                  title_justify="left")
    for col in ("dtype", "median ms/step", "vs fp32", "peak memory", "vs fp32", "skipped updates"):
        table.add_column(col, justify="left" if col == "dtype" else "right")
    for run in speed.runs:
        if run.error:
            table.add_row(precision.SHORT[run.dtype], Text("error: " + run.error), "", "", "", "")
            continue
        table.add_row(precision.SHORT[run.dtype], _fmt(run.median_ms, 4),
                      "1.00×" if run.dtype == "float32" else f"{_fmt(run.time_ratio)}×",
                      _bytes(run.peak_bytes),
                      "" if run.memory_ratio is None else
                      ("1.00×" if run.dtype == "float32" else f"{_fmt(run.memory_ratio)}×"),
                      str(run.skipped_updates))
    console.print(table)
    console.print(Text(f"memory: {speed.memory}", style="dim"))
    for note in speed.notes:
        console.print(Text(note, style="dim"))
