"""A session as CSV: one row per step (`StepsCsv`), or one row per step and layer (`LayersCsv`).

Both take records one at a time (like a run's observers), so a recording of any length is
written without being held. The files read with `pandas.read_csv(path)` and no options: a comma
between fields, a header row, `True`/`False` for flags, `nan`, `inf` and `-inf` for non-finite
numbers, an empty field for a value the step has none of (not measured, no scaler, no clipping).
The columns are in `STEP_COLUMNS` and `LAYER_COLUMNS` (docs/export.md says what each holds); a
session of several ranks adds `rank_loss_<r>` and `rank_step_time_<r>` per rank to the steps' file.
"""

from __future__ import annotations

import csv
import functools
import io
import os
import re
from itertools import repeat
from pathlib import Path

import numpy as np

from amp_tui.core.records import world_size_of
from amp_tui.recording.figures import InForceTracker, layer_figures

STEP_COLUMNS = ("step", "loss", "scale", "next_scale", "scale_floor", "skipped", "skipped_total", "updates",
                "dtype", "fp32_modules", "micro_batches", "lr", "grad_norm", "nonfinite", "min_headroom_bits",
                "min_headroom_layer", "time", "duration")
LAYER_COLUMNS = ("step", "layer", "dtype", "fp32", "max_abs_act", "max_abs_grad", "max_abs_weight",
                 "headroom_bits", "underflow", "underflow_scaled")
_TOKENS = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}
_LINE_TOKENS = {f'"{k}"': v for k, v in _TOKENS.items()}
_NUMBER_START = frozenset("-0123456789")
# The arrays of a step line's layers object, in the order the writer writes them.
LINE_ARRAYS = ("act", "grad", "weight", "underflow", "underflow_scaled")
_LAYERS_AT_END = re.compile(rb'"layers":\{"act":\[([^\]]*)\],"grad":\[([^\]]*)\],"weight":\[([^\]]*)\]'
                            rb'(?:,"underflow":\[([^\]]*)\])?(?:,"underflow_scaled":\[([^\]]*)\])?'
                            rb'(?:,"eta":\[[^\]]*\])?\}\}$')   # the forecast's ETAs: not a CSV column
_NUMBERS = {float, int}
BUFFER_BYTES = 1 << 20


def number_text(value) -> str:
    """A recorded number as CSV text: `nan`/`inf`/`-inf` for the non-finite ones, empty when
    there is none (null, missing, or not a number: a bool is not one)."""
    kind = type(value)
    if kind is float or kind is int:
        return str(value)
    if kind is str:
        return _TOKENS.get(value, "")
    return ""


def bits_text(value: float) -> str:
    """Headroom bits with 4 significant digits; empty when nothing was measured (NaN)."""
    return "" if value != value else f"{value:.4g}"


def bits_texts(bits: np.ndarray) -> list[str]:
    if np.isnan(bits).any():
        return [bits_text(v) for v in bits.tolist()]
    return list(map(format, bits.tolist(), repeat(".4g")))


def line_columns(line: bytes, n: int) -> list[list[str]] | None:
    """The per-layer arrays of a step line (LINE_ARRAYS; an absent one as empty fields) as CSV
    fields, copied from the line as the writer wrote them; None when the line is not laid out
    as format.step_record writes it (then the parsed record is formatted instead).

    A step record ends with its `layers` object; an unescaped `"layers":{"act":[` can't occur
    inside a JSON string, and the line parsed as JSON, so each array found is one of valid JSON
    values (numbers, or "NaN"/"Infinity"/"-Infinity"/null as the writer writes them)."""
    m = _LAYERS_AT_END.search(line)
    if m is None:
        return None
    out = []
    for segment in m.groups():
        if segment is None:
            out.append([""] * n)
            continue
        text = segment.decode("ascii", "replace")
        fields = text.split(",") if text else []
        if len(fields) != n:
            return None
        if segment.translate(None, b"0123456789.eE+-,"):   # not only numbers: map each token
            fields = [f if f[:1] in _NUMBER_START else _LINE_TOKENS.get(f, "") for f in fields]
        out.append(fields)
    return out


def column_texts(values, n: int) -> list[str]:
    """A recorded per-layer list as `n` CSV fields."""
    if isinstance(values, list) and len(values) == n and set(map(type, values)) <= _NUMBERS:
        return list(map(str, values))
    if not isinstance(values, list):
        return [""] * n
    out = [number_text(v) for v in values[:n]]
    return out + [""] * (n - len(out))


@functools.lru_cache(maxsize=4096)
def quoted(text: str) -> str:
    """`text` as one CSV field (quoted when it holds a comma, a quote or a line break)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="").writerow([text])
    return buf.getvalue()


class _CsvSink:
    """A CSV file written as `PATH.partial` and renamed to PATH by `finish()`, so that it appears
    whole or not at all."""

    def __init__(self, path: str | Path, columns: tuple[str, ...]):
        self.path = Path(path)
        self.rows = 0
        self.columns = columns
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._fh = open(self._partial, "w", encoding="utf-8", newline="", buffering=BUFFER_BYTES)
        self._started = False

    def _start(self) -> None:
        """The header row, once the columns are known (the session's header can add some)."""
        if not self._started:
            self._fh.write(",".join(self.columns) + "\n")
            self._started = True

    def finish(self) -> None:
        self._start()
        self._fh.close()
        os.replace(self._partial, self.path)

    def discard(self) -> None:
        self._fh.close()
        self._partial.unlink(missing_ok=True)


class StepsCsv(_CsvSink):
    """One row per step record (STEP_COLUMNS)."""

    def __init__(self, path: str | Path):
        super().__init__(path, STEP_COLUMNS)
        self._names: list[str] = []
        self._ranks = 1
        self._in_force = InForceTracker()
        self._in_force_text: tuple = (None, "", "")   # (in force, its floor's field, its modules' field)

    def write(self, record: dict, line: bytes | None = None) -> None:
        kind = record.get("type")
        self._in_force.observe(record)
        if kind == "header" and not self._started:
            layers = record.get("layers")
            self._names = [str(n) for n in layers] if isinstance(layers, list) else []
            self._ranks = world_size_of(record)
            if self._ranks > 1:
                self.columns = STEP_COLUMNS + tuple(f"rank_loss_{r}" for r in range(self._ranks)) \
                    + tuple(f"rank_step_time_{r}" for r in range(self._ranks))
            return
        if kind != "step":
            return
        self._start()
        r = record
        least, where = "", ""
        figures = layer_figures(r, len(self._names), self._in_force.fp32)
        if figures is not None:
            i = least_index(figures.headroom)
            if i is not None:
                least, where = bits_text(float(figures.headroom[i])), self._names[i]
        floor, fp32 = self._in_force_fields()
        skipped = r.get("skipped")
        dtype = r.get("dtype")
        nonfinite = r.get("nonfinite")
        fields = [
            number_text(r.get("step")), number_text(r.get("loss")), number_text(r.get("scale")),
            number_text(r.get("next_scale")), floor, str(skipped) if isinstance(skipped, bool) else "",
            number_text(r.get("skipped_total")), number_text(r.get("updates")),
            quoted(dtype) if isinstance(dtype, str) else "", fp32, number_text(r.get("micro_batches")),
            number_text(r.get("lr")), number_text(r.get("grad_norm")),
            quoted(nonfinite) if isinstance(nonfinite, str) else "", least, quoted(where) if where else "",
            number_text(r.get("time")), number_text(r.get("duration")),
        ]
        if self._ranks > 1:
            fields += self._per_rank(r.get("rank_loss")) + self._per_rank(r.get("rank_step_time"))
        self._fh.write(",".join(fields) + "\n")
        self.rows += 1


    def _in_force_fields(self) -> tuple[str, str]:
        """The scale floor and the fp32 modules (space-separated) in force, as CSV fields."""
        in_force = self._in_force.in_force
        if self._in_force_text[0] != in_force:
            self._in_force_text = (in_force, repr(in_force.scale_floor),
                                   quoted(" ".join(in_force.fp32_modules)) if in_force.fp32_modules else "")
        return self._in_force_text[1], self._in_force_text[2]

    def _per_rank(self, values) -> list[str]:
        """One field per rank; empty where the step has no such figure (not gathered)."""
        if not isinstance(values, list) or len(values) != self._ranks:
            return [""] * self._ranks
        return [number_text(v) for v in values]


class LayersCsv(_CsvSink):
    """One row per probed step record and layer (LAYER_COLUMNS), in model order."""

    def __init__(self, path: str | Path):
        super().__init__(path, LAYER_COLUMNS)
        self._names: list[str] = []
        self._dtypes: dict = {}
        self._in_force = InForceTracker()
        self._fp32_fields: tuple = (None, [])   # (the fp32 mask, its `fp32` fields)

    def write(self, record: dict, line: bytes | None = None) -> None:
        """Write the rows of one record; `line`, the step's line as recorded, lets the figures be
        copied as they were written instead of formatted again (much faster)."""
        self._start()
        self._in_force.observe(record)
        kind = record.get("type")
        if kind == "header":
            layers = record.get("layers")
            self._names = [quoted(str(n)) for n in layers] if isinstance(layers, list) else []
            return
        if kind != "step" or not isinstance(record.get("layers"), dict):
            return
        n = len(self._names)
        fp32 = self._in_force.fp32
        figures = layer_figures(record, n, fp32)
        if figures is None:
            return
        if self._fp32_fields[0] is not fp32 or len(self._fp32_fields[1]) != n:
            self._fp32_fields = (fp32, [str(bool(fp32 is not None and i < len(fp32) and fp32[i])) for i in range(n)])
        layers = record["layers"]
        dtype = record.get("dtype")
        dtype = dtype if isinstance(dtype, str) else None   # a damaged record: any JSON value
        dtype_text = self._dtypes.get(dtype)
        if dtype_text is None:
            dtype_text = self._dtypes.setdefault(dtype, "" if dtype is None else quoted(dtype))
        step = number_text(record.get("step"))
        empty = [""] * n
        written = line_columns(line, n) if line is not None else None
        if written is None:
            written = [column_texts(layers.get(name), n) if name in layers else empty for name in LINE_ARRAYS]
        act, grad, weight, under, under_scaled = written
        self._fh.write("\n".join(map(",".join, zip(
            [step] * n, self._names, [dtype_text] * n, self._fp32_fields[1], act, grad, weight,
            bits_texts(figures.headroom),
            under, under_scaled))))
        self._fh.write("\n")
        self.rows += n


def least_index(bits: np.ndarray) -> int | None:
    """The layer with the least headroom (NaN: not measured); None when none was measured."""
    nan = np.isnan(bits)
    if not nan.any():
        return int(bits.argmin())
    if nan.all():
        return None
    return int(np.where(nan, np.inf, bits).argmin())
