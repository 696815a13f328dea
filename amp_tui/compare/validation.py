"""Validation: the fp32 reference on a fixed eval set, then each AMP dtype judged against it.

The method is the one docs/compare.md describes: the same weights (one eval-mode copy) and the
same batches for every dtype, only the autocast dtype changing, so that a difference can be put
down to precision and nothing else.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from amp_tui.compare.criteria import DEFAULT_EVAL_BATCHES, REL_FLOOR, Criteria
from amp_tui.compare.decisions import (
    as_scores,
    decide,
    decision_kind,
    default_predict,
    find_labels,
    near_ties,
)
from amp_tui.compare.results import DtypeResult, Reference, Validation
from amp_tui.core import precision
from amp_tui.training.devices import move_to_device
from amp_tui.training.script import ScriptError, TrainSetup, describe_exception
from amp_tui.training.step.autocast import autocast, unsupported_reason

# How many flip / near-tie sample indices are listed (all are counted).
SHOW = 10


def eval_set(setup: TrainSetup, default_count: int, script: Path) -> tuple[list, str]:
    """The fixed evaluation set (host side): the script's eval_batches, or the first batches."""
    if setup.eval_batches is not None:
        try:
            batches = list(setup.eval_batches)
        except Exception as exc:  # noqa: BLE001 - user code
            raise ScriptError(f"iterating 'eval_batches' from {script.name} failed: "
                              f"{describe_exception(exc, script)}") from None
        if not batches:
            raise ScriptError(f"'eval_batches' from {script.name} is empty")
        return batches, "eval_batches"
    try:
        batches = list(itertools.islice(setup.batches, default_count))
    except Exception as exc:  # noqa: BLE001
        raise ScriptError(f"iterating 'batches' from {script.name} failed: "
                          f"{describe_exception(exc, script)}") from None
    if not batches:
        raise ScriptError(f"'batches' from {script.name} is empty")
    return batches, "batches"


class _PredictFailed(Exception):
    """predict raised or returned no tensor; the caller names the batch and dtype."""

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
        scores = as_scores(raw)
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
    host_batches, source = eval_set(setup, eval_batches_default, script)
    predict = setup.predict or default_predict
    what = (f"predict in {script.name}" if setup.predict is not None
            else "the model (default predict: the model's output)")
    model = copy.deepcopy(setup.model).to(device).eval()
    tallies: dict[str, _DtypeTally] = {}
    results: dict[str, DtypeResult] = {}
    for dtype in dtypes:
        reason = unsupported_reason(device, dtype)
        if reason:
            results[dtype] = DtypeResult(dtype, "unsupported", reason=reason)
        else:
            tallies[dtype] = _DtypeTally(dtype, criteria)
    ref = _ReferenceTally(criteria)
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


class _ReferenceTally:
    """The fp32 reference, batch by batch: finiteness, decisions, near-ties, label accuracy."""

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


class _DtypeTally:
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
        r = self.r
        if self.error:
            return DtypeResult(self.dtype, "error", failed=["error"], reason=self.error)
        r.finite = r.nonfinite == 0
        r.mean_abs = self.sum_abs / r.elements if r.elements else 0.0
        r.mean_rel = self.sum_rel / r.elements if r.elements else 0.0
        r.agreement = 1.0 - (r.flips + r.near_tie_flips) / r.samples if r.samples else 1.0
        if r.samples and self.all_labelled:
            r.accuracy = self.correct / r.samples
        r.failed = self.criteria.failures(r)
        r.status = "fail" if r.failed else "pass"
        return r


def _sample_index(batch_index: int, index: tuple) -> list[int]:
    """A sample's name: its eval batch, then its position inside it."""
    return [batch_index, *[int(i) for i in index]]


def _unravel(flat: int, shape: torch.Size) -> list[int]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return list(reversed(index))
