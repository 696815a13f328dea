"""The human output of `amp-tui compare`: the declared criteria, the scores-and-decisions table,
the flips, the speed table and one PASS/FAIL line per dtype (Rich)."""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table
from rich.text import Text

from amp_tui.compare.criteria import Criteria
from amp_tui.compare.results import DtypeResult, Speed, Validation
from amp_tui.core import precision
from amp_tui.core.numfmt import number


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


def header(console, script: Path, device_info: dict, dtypes, criteria: Criteria, warnings) -> None:
    """The script, the device (as `describe_device` gives it), script warnings, then the criteria:
    printed before any result, so they are seen to be fixed up front."""
    index = "" if device_info["index"] is None else f":{device_info['index']}"
    title = Text("amp-tui compare ", style="bold")
    title.append(str(script))
    title.append(f"   device {device_info['type']}{index} ({device_info['name']})", style="dim")
    console.print(title)
    for warning in warnings:
        console.print(Text("warning: ", style="yellow") + Text(warning))
    console.print(Text(f"criteria, declared before the run (dtypes: "
                       f"{', '.join(precision.SHORT[d] for d in dtypes)}):", style="bold"))
    for name, text in criteria.lines():
        console.print(Text(f"  {name:<21}{text}"))


def comparison(console, validation: Validation) -> None:
    """The eval set, the reference and the per-dtype table, with flips and near-ties listed."""
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
    console.print(_dtype_table(results))

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


def _dtype_table(results) -> Table:
    """Each dtype's scores and decisions against fp32, a column a dtype."""
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
    return table



def verdict(console, validation: Validation) -> None:
    """One PASS/FAIL line per dtype, naming every failed criterion."""
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


def speed_plan(console, dtypes: list[str], *, warmup: int, steps: int) -> None:
    console.print(Text(f"measuring speed: fp32, {', '.join(precision.SHORT[d] for d in dtypes)} "
                       f"({warmup} warm-up + {steps} timed steps each)…"))


def nothing_to_time(console) -> None:
    console.print(Text("speed: no dtype passed validation, nothing worth measuring"))


def speed_table(console, speed: Speed) -> None:
    """The speed table: median ms/step, peak memory, both against fp32, and skipped updates."""
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
