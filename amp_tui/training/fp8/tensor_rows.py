"""GEMMs' tensors cast to fp8 and fp4 (casts.py) and measured against the precision they ran in:
a row per tensor, format and scaling (docs/session-format.md, `fp8`), with the SQNR of the GEMM's
output computed from the cast operands.

GEMMs of one shape are measured together (`forward_groups`, `gradient_groups`): the layers of a
model repeat their shapes, and the per-op cost, not the arithmetic, is what a small layer's
figures cost. Each is measured as it would be alone.
"""

from __future__ import annotations

import math

import torch

from amp_tui.training.fp8.casts import CASTS, cast_both_ways, cast_groups, db, fits, median_db

# The values of a tensor its casts are measured on, at most: a larger one is measured on a sample
# of its rows (evenly spread, and the row that holds its largest value), each cast with the scale
# the whole tensor gives it. Its range and crest are the whole tensor's.
SAMPLE_VALUES = 1 << 13
CREST_SAMPLE = 4096   # the values whose median stands for a tensor's typical one


class Reference:
    """Tensors of one shape as their casts are measured against them, what does not depend on the
    cast computed once: in float32, as (tensors, rows, channels), each tensor's largest |value|,
    each channel's energy, the nonzero values, the range and crest. `sampled`: measured on a sample
    of its rows, for a tensor of more than SAMPLE_VALUES."""

    def __init__(self, xs: list[torch.Tensor], *, sampled: bool = False):
        self.shape = xs[0].shape
        whole = torch.stack([x.detach().reshape(-1, x.shape[-1]) for x in xs]).to(torch.float32)
        magnitude = whole.abs()
        self.amax = magnitude.amax((1, 2))
        self.spread = spread_groups(magnitude, self.amax)
        self.sample = sample_rows(magnitude) if sampled else None
        self.flat = whole if self.sample is None else _take_rows(whole, self.sample)
        self.channel_signal = self.flat.square().sum(1)                       # (tensors, channels)
        signal, nonzero = torch.stack([self.channel_signal.sum(1).sqrt(),
                                       torch.count_nonzero(self.flat, dim=(1, 2)).float()]).tolist()
        self.signal, self.nonzero = signal, [int(n) for n in nonzero]

    def casts(self, casts: list[tuple[str, str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return cast_all(self.flat, casts, self.amax)

    def rows(self, tensor: str, casts: list[tuple[str, str]], values: torch.Tensor, saturated: list,
             output_db: list[list]) -> list[list[dict]]:
        """Per tensor, one row per cast of `casts`: `values` (casts, tensors, rows, channels) and
        `saturated` (per cast, per tensor) in that order; the figures of all of them computed
        together and read at once."""
        channel_noise = (values - self.flat).square().sum(2)                  # (casts, tensors, channels)
        # nanmedian of signal/noise per cast and tensor: a channel of zeros (0/0) is no channel.
        noise, kept, median, saturated = torch.stack([
            channel_noise.sum(2).sqrt(), torch.count_nonzero(values, dim=(2, 3)).float(),
            (self.channel_signal / channel_noise).nanmedian(dim=2).values,
            torch.stack(saturated).float()]).tolist()
        numel = self.flat[0].numel()
        out = []
        for t in range(len(self.signal)):
            rows, nonzero = [], self.nonzero[t]
            for c, (fmt, scaling) in enumerate(casts):
                # A cast keeps zeros zero: the zeros it adds are the values it flushed.
                rows.append({"tensor": tensor, "format": fmt, "scaling": scaling,
                             "sqnr_db": _rounded(db(self.signal[t], noise[c][t])),
                             "channel_sqnr_db": _rounded(median_db(median[c][t])),
                             "underflow": (nonzero - int(kept[c][t])) / nonzero if nonzero else 0.0,
                             "saturation": saturated[c][t] / numel if numel else 0.0,
                             **self.spread[t], "output_sqnr_db": output_db[t][c]})
            out.append(rows)
        return out


def sample_rows(magnitude: torch.Tensor) -> torch.Tensor | None:
    """The rows each of the tensors (tensors, rows, channels) is measured on: all of them (None)
    up to SAMPLE_VALUES values; else evenly spread ones and, in place of the last, the row of its
    largest value (which may be one of the others already: counted twice, a small weight)."""
    count, rows, width = magnitude.shape
    keep = max(1, SAMPLE_VALUES // max(width, 1))
    if rows <= keep:
        return None
    spread = torch.linspace(0, rows - 1, keep, device=magnitude.device).round().long().expand(count, -1).clone()
    spread[:, -1] = magnitude.amax(-1).argmax(-1)
    return spread


def _take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, 1, rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def cast_all(flat: torch.Tensor, casts: list[tuple[str, str]], amax: torch.Tensor) -> list:
    """Each of `casts` of the tensors `flat`, an fp8 format's tensorwise and rowwise made together."""
    done: dict[tuple[str, str], tuple] = {}
    for fmt, scaling in casts:
        if (fmt, scaling) in done:
            continue
        if scaling in ("tensorwise", "rowwise") and {(fmt, "tensorwise"), (fmt, "rowwise")} <= set(casts):
            done[fmt, "tensorwise"], done[fmt, "rowwise"] = cast_both_ways(flat, fmt, amax)
        else:
            done[fmt, scaling] = cast_groups(flat, fmt, scaling, amax)
    return [done[c] for c in casts]


def forward_rows(a: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """The rows of one GEMM's two operands, output = a @ b, both cast along the reduction
    dimension (a's last, b's next to last; leading dimensions batch, as matmul broadcasts them).
    For an nn.Linear, `a` is its input and `b` its weight transposed: rows `input` and `weight`."""
    return forward_groups([(a, b)])[0]


def gradient_rows(grad_output: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """The rows of one GEMM's output gradient: grad_a = grad_output @ b^T, both cast along b's
    last dimension (the second operand in e4m3 beside an e5m2 gradient, as torchao's recipe has it)."""
    return gradient_groups([(grad_output, b)])[0]


def forward_groups(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[dict]]:
    """`forward_rows` of GEMMs whose operands all have one shape, measured together. With `b` one
    matrix, a large operand is measured on a sample of its rows, and the output on the entries
    those rows make; a batched GEMM's operands are measured whole (and alone)."""
    a0, b0 = pairs[0]
    matrix = b0.dim() == 2
    a_ref = Reference([a for a, _ in pairs], sampled=matrix)
    bt_ref = Reference([b.transpose(-1, -2) for _, b in pairs], sampled=matrix)
    casts = [(fmt, scaling) for fmt, scaling in CASTS if fits(fmt, scaling, a0.shape[-1])]
    qa, qbt = a_ref.casts(casts), bt_ref.casts(casts)
    a_values, bt_values = torch.stack([v for v, _ in qa]), torch.stack([v for v, _ in qbt])
    output = output_dbs(a_ref.flat, a0.shape, bt_ref.flat, bt_ref.shape, a_values, bt_values)
    inputs = a_ref.rows("input", casts, a_values, [s for _, s in qa], output)
    weights = bt_ref.rows("weight", casts, bt_values, [s for _, s in qbt], output)
    return [i + w for i, w in zip(inputs, weights)]


def gradient_groups(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[dict]]:
    """`gradient_rows` of GEMMs whose operands all have one shape, measured together."""
    go0, b0 = pairs[0]
    matrix = b0.dim() == 2
    go_ref = Reference([go for go, _ in pairs], sampled=matrix)
    b_flat = torch.stack([b.detach().reshape(-1, b.shape[-1]) for _, b in pairs]).to(torch.float32)
    magnitude = b_flat.abs()
    b_amax = magnitude.amax((1, 2))
    if matrix and (kept := sample_rows(magnitude)) is not None:
        b_flat = _take_rows(b_flat, kept)   # the entries of grad_a the sampled rows of both make
    casts = [(fmt, scaling) for fmt, scaling in CASTS if fits(fmt, scaling, go0.shape[-1])]
    # The second operand in e4m3 serves both fp8 formats' gradient rows.
    keys = [("e4m3" if fmt == "e5m2" else fmt, scaling) for fmt, scaling in casts]
    unique = list(dict.fromkeys(keys))
    operands = {key: values for key, (values, _) in zip(unique, cast_all(b_flat, unique, b_amax))}
    qgo = go_ref.casts(casts)
    go_values = torch.stack([v for v, _ in qgo])
    output = output_dbs(go_ref.flat, go0.shape, b_flat, b0.shape, go_values, torch.stack([operands[k] for k in keys]))
    return go_ref.rows("grad_output", casts, go_values, [s for _, s in qgo], output)


def output_dbs(a: torch.Tensor, a_shape, bt: torch.Tensor, bt_shape, qa: torch.Tensor,
               qbt: torch.Tensor) -> list[list]:
    """Per tensor and cast, the SQNR of the GEMM a @ bt^T made from the casts (`qa[c]`, `qbt[c]`)
    against the one made from `a` and `bt` (flat forms, (tensors, rows, reduction)), all at once."""
    reference = _matmul(a, a_shape, bt, bt_shape)                                # (tensors, ...)
    approx = _matmul(qa, a_shape, qbt, bt_shape)                                 # (casts, tensors, ...)
    noise = (approx - reference).square().flatten(2).sum(2).sqrt()                # (casts, tensors)
    signal = reference.square().flatten(1).sum(1).sqrt()                          # (tensors,)
    figures = torch.cat([signal.unsqueeze(0), noise]).tolist()
    return [[_rounded(db(figures[0][t], figures[1 + c][t])) for c in range(qa.shape[0])]
            for t in range(len(figures[0]))]


def _matmul(a: torch.Tensor, a_shape, bt: torch.Tensor, bt_shape) -> torch.Tensor:
    """a @ bt^T from flat forms (..., rows, reduction), leading dimensions stacked tensors (and
    casts); a GEMM whose second operand is batched in its own shapes `a_shape` and `bt_shape`."""
    if len(bt_shape) == 2:   # one matrix (a Linear's weight): a's rows flat, as they are
        return a @ bt.transpose(-1, -2)
    lead = a.shape[:-2]
    product = a.reshape(*lead, *a_shape) @ bt.reshape(*bt.shape[:-2], *bt_shape).transpose(-1, -2)
    return product.reshape(*lead, -1, product.shape[-1])


def spread_bits(x: torch.Tensor) -> dict:
    """How a tensor's magnitudes spread, over its finite nonzero values: `range_bits`,
    log2(max |x| / min |x|), and `crest_bits`, log2(max |x| / median |x|): how far below its largest
    value its typical one sits. The median is of an evenly strided sample of at most CREST_SAMPLE
    values (a full median costs 40x more on the CPU)."""
    magnitude = x.detach().abs().to(torch.float32).reshape(1, 1, -1)
    return spread_groups(magnitude, magnitude.amax((1, 2)))[0]


def spread_groups(magnitude: torch.Tensor, amax: torch.Tensor) -> list[dict]:
    """`spread_bits` of each of the tensors `magnitude` (tensors, rows, channels), with their amax."""
    count = magnitude.shape[0]
    flat = magnitude.reshape(count, -1)
    if not flat.shape[1]:
        return [{"range_bits": None, "crest_bits": None}] * count
    if not bool(torch.isfinite(amax).all()):   # rare: the inf/NaN of a broken step, left out
        flat = torch.where(torch.isfinite(flat), flat, 0.0)
        amax = flat.amax(1)
    bottom = torch.where(flat > 0, flat, math.inf).amin(1)
    sample = flat[:, ::max(1, flat.shape[1] // CREST_SAMPLE)]
    median = torch.where(sample > 0, sample, math.nan).nanmedian(1).values
    out = []
    for top, low, typical in zip(*torch.stack([amax, bottom, median]).tolist()):
        if not top > 0 or not math.isfinite(low):
            out.append({"range_bits": None, "crest_bits": None})
            continue
        crest = math.log2(top / typical) if typical > 0 else None
        out.append({"range_bits": _rounded(math.log2(top / low)), "crest_bits": _rounded(crest)})
    return out


def _rounded(value: float | None) -> float | None:
    if value is None:
        return None
    return round(value, 2) if math.isfinite(value) else (-999.0 if value < 0 else 999.0)
