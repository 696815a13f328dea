"""One GEMM's tensors cast to fp8 and fp4 (casts.py) and measured against the precision they ran
in: a row per tensor, format and scaling (docs/session-format.md, `fp8`), with the SQNR of the
GEMM's output computed from the cast operands."""

from __future__ import annotations

import math

import torch

from amp_tui.training.fp8.casts import CASTS, Cast, cast, cast_both_ways, fits

# The values of a tensor its casts are measured on, at most: a larger one is measured on a sample
# of its rows (evenly spread, and the row that holds its largest value), each cast with the scale
# the whole tensor gives it. Its range and crest are the whole tensor's.
SAMPLE_VALUES = 1 << 14


class Reference:
    """A tensor as its casts are measured against it, what does not depend on the cast computed
    once: in float32, as (rows, channels), each channel's energy, its nonzero values, its range
    and crest. `sampled`: measured on a sample of its rows (`sample`), for a tensor of more than
    SAMPLE_VALUES."""

    def __init__(self, x: torch.Tensor, *, sampled: bool = False):
        self.x, self.shape = x, x.shape
        whole = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
        self.amax = whole.abs().max() if whole.numel() else whole.new_zeros(())
        self.spread = spread_bits(whole)
        self.sample = sample_rows(whole) if sampled else None
        self.flat = whole if self.sample is None else whole[self.sample]
        self.channel_signal = self.flat.square().sum(0)
        self.signal = math.sqrt(float(self.channel_signal.sum()))
        self.nonzero = int(torch.count_nonzero(self.flat))

    def cast(self, fmt: str, scaling: str) -> Cast:
        return cast(self.flat, fmt, scaling, tensor_amax=self.amax)

    def casts(self, casts: list[tuple[str, str]]) -> list[Cast]:
        """Each of `casts`, an fp8 format's tensorwise and rowwise casts made together."""
        return cast_all(self.flat, casts, self.amax)

    def rows(self, tensor: str, casts: list[tuple[str, str]], done: list[Cast], output_db: list) -> list[dict]:
        """One row per cast of `casts` (`done`, in that order), the figures of all of them
        computed together: a few ops, and one read, for the six."""
        values = torch.stack([d.values.reshape(self.flat.shape) for d in done])
        channel_noise = (values - self.flat).square().sum(1)            # (casts, channels)
        # nanmedian of signal/noise per cast: a channel of zeros (0/0) is no channel.
        figures = torch.stack([channel_noise.sum(1).sqrt(), torch.count_nonzero(values, dim=(1, 2)).float(),
                               (self.channel_signal / channel_noise).nanmedian(dim=1).values]).tolist()
        numel = self.flat.numel()
        out = []
        for (fmt, scaling), cast_done, noise, kept, median, output in zip(casts, done, *figures, output_db):
            # A cast keeps zeros zero: the zeros it adds are the values it flushed.
            out.append({"tensor": tensor, "format": fmt, "scaling": scaling,
                        "sqnr_db": _rounded(_db(self.signal, noise)),
                        "channel_sqnr_db": _rounded(median_db(median)),
                        "underflow": (self.nonzero - int(kept)) / self.nonzero if self.nonzero else 0.0,
                        "saturation": cast_done.saturated / numel if numel else 0.0,
                        **self.spread, "output_sqnr_db": output})
        return out


def cast_all(flat: torch.Tensor, casts: list[tuple[str, str]], tensor_amax: torch.Tensor) -> list[Cast]:
    done: dict[tuple[str, str], Cast] = {}
    for fmt, scaling in casts:
        if (fmt, scaling) in done:
            continue
        if scaling in ("tensorwise", "rowwise") and {(fmt, "tensorwise"), (fmt, "rowwise")} <= set(casts):
            done[fmt, "tensorwise"], done[fmt, "rowwise"] = cast_both_ways(flat, fmt, tensor_amax=tensor_amax)
        else:
            done[fmt, scaling] = cast(flat, fmt, scaling, tensor_amax=tensor_amax)
    return [done[c] for c in casts]


def median_db(median: float) -> float | None:
    """A median of per-channel signal/noise energy ratios in dB (None: most channels exact)."""
    if math.isnan(median) or math.isinf(median):
        return None
    return 10 * math.log10(median) if median > 0 else -math.inf


def output_dbs(reference: torch.Tensor, a: list[torch.Tensor], a_shape, bt: list[torch.Tensor],
               bt_shape) -> list[float | None]:
    """sqnr_db against `reference` of each GEMM a[i] @ bt[i]^T (their flat forms, as `_matmul`
    takes them), the GEMMs of one matrix `bt` made as one batched GEMM."""
    if len(bt_shape) == 2:
        approx = torch.bmm(torch.stack(a), torch.stack(bt).transpose(1, 2))
    else:
        approx = torch.stack([_matmul(x, a_shape, y, bt_shape) for x, y in zip(a, bt)])
    noise = (approx - reference).square().flatten(1).sum(1).sqrt()
    figures = torch.cat([reference.square().sum().sqrt().reshape(1), noise]).tolist()
    return [_rounded(_db(figures[0], n)) for n in figures[1:]]


def _db(signal: float, noise: float) -> float | None:
    if noise == 0:
        return None
    return 20 * math.log10(signal / noise) if signal > 0 and math.isfinite(noise) else -math.inf


def sample_rows(flat: torch.Tensor) -> torch.Tensor | None:
    """The rows a tensor of (rows, channels) is measured on: all of them (None) up to
    SAMPLE_VALUES values; else evenly spread ones, with the row of its largest value."""
    rows, width = flat.shape
    keep = max(1, SAMPLE_VALUES // max(width, 1))
    if rows <= keep:
        return None
    spread = torch.linspace(0, rows - 1, keep - 1, device=flat.device).round().long()
    top = flat.abs().amax(-1).argmax().reshape(1)
    return torch.unique(torch.cat([spread, top]))


def forward_rows(a: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """The rows of a GEMM's two operands, output = a @ b, both cast along the reduction dimension
    (a's last, b's next to last; leading dimensions batch, as matmul broadcasts them). For an
    nn.Linear, `a` is its input and `b` its weight transposed: rows `input` and `weight`.

    With `b` one matrix, a large operand is measured on a sample of its rows, and the output on
    the entries those rows make; a batched GEMM's operands are measured whole."""
    matrix = b.dim() == 2
    a_ref, bt_ref = Reference(a, sampled=matrix), Reference(b.transpose(-1, -2), sampled=matrix)
    reference = _matmul(a_ref.flat, a.shape, bt_ref.flat, bt_ref.shape)
    casts = [(fmt, scaling) for fmt, scaling in CASTS if fits(fmt, scaling, a.shape[-1])]
    qa, qbt = a_ref.casts(casts), bt_ref.casts(casts)
    output = output_dbs(reference, [x.values for x in qa], a.shape, [y.values for y in qbt], bt_ref.shape)
    return a_ref.rows("input", casts, qa, output) + bt_ref.rows("weight", casts, qbt, output)


def gradient_rows(grad_output: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """The rows of a GEMM's output gradient: grad_a = grad_output @ b^T, both cast along b's last
    dimension (an nn.Linear's output features, `b` its weight transposed; the second operand in
    e4m3 beside an e5m2 gradient, as torchao's recipe has it)."""
    matrix = b.dim() == 2
    go_ref = Reference(grad_output, sampled=matrix)
    b_flat = b.detach().to(torch.float32).reshape(-1, b.shape[-1])
    b_amax = b_flat.abs().max()
    if matrix and (kept := sample_rows(b_flat)) is not None:
        b_flat = b_flat[kept]   # the entries of grad_a the sampled rows of both make
    reference = _matmul(go_ref.flat, grad_output.shape, b_flat, b.shape)
    casts = [(fmt, scaling) for fmt, scaling in CASTS if fits(fmt, scaling, grad_output.shape[-1])]
    # The second operand in e4m3 serves both fp8 formats' gradient rows.
    keys = [("e4m3" if fmt == "e5m2" else fmt, scaling) for fmt, scaling in casts]
    unique = list(dict.fromkeys(keys))
    operands = {key: done.values for key, done in zip(unique, cast_all(b_flat, unique, b_amax))}
    qgo = go_ref.casts(casts)
    output = output_dbs(reference, [q.values for q in qgo], grad_output.shape, [operands[key] for key in keys],
                        b.shape)
    return go_ref.rows("grad_output", casts, qgo, output)


def _matmul(a: torch.Tensor, a_shape, bt: torch.Tensor, bt_shape) -> torch.Tensor:
    """a @ bt^T, from their flat (rows, reduction) forms, in the shapes `a_shape` and `bt_shape`
    (leading dimensions batch)."""
    if len(bt_shape) == 2:   # one matrix (a Linear's weight): a's rows flat, as they are
        return a @ bt.t()
    return a.reshape(a_shape) @ bt.reshape(bt_shape).transpose(-1, -2)


CREST_SAMPLE = 4096   # the values whose median stands for a tensor's typical one


def spread_bits(x: torch.Tensor) -> dict:
    """How a tensor's magnitudes spread, over its finite nonzero values: `range_bits`,
    log2(max |x| / min |x|), and `crest_bits`, log2(max |x| / median |x|): how far below its largest
    value its typical one sits. The median is of an evenly strided sample of at most CREST_SAMPLE
    values (a full median costs 40x more on the CPU)."""
    magnitude = x.detach().abs().to(torch.float32).flatten()
    if not magnitude.numel():
        return {"range_bits": None, "crest_bits": None}
    top, bottom = float(magnitude.max()), float(torch.where(magnitude > 0, magnitude, math.inf).min())
    if not math.isfinite(top):   # rare: the inf/NaN of a broken step, left out as the others are
        live = torch.isfinite(magnitude) & (magnitude > 0)
        top = float(torch.where(live, magnitude, 0.0).max())
        bottom = float(torch.where(live, magnitude, math.inf).min())
    if top == 0 or not math.isfinite(bottom):
        return {"range_bits": None, "crest_bits": None}
    sample = magnitude[::max(1, magnitude.numel() // CREST_SAMPLE)]
    sample = sample[(sample > 0) & (sample <= top)]
    crest = math.log2(top / float(sample.median())) if sample.numel() else None
    return {"range_bits": _rounded(math.log2(top / bottom)), "crest_bits": _rounded(crest)}


def _rounded(value: float | None) -> float | None:
    if value is None:
        return None
    return round(value, 2) if math.isfinite(value) else (-999.0 if value < 0 else 999.0)
