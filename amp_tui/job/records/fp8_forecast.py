"""The fp8 forecast: from the recurring what-if (`--fp8-every`), each fp8-ready layer's crest
(log2 of a tensor's max over its median, cast as torchao's default recipe casts it) followed from
one what-if to the next. A crest that climbs towards the verdict's limit (the format's normal
range less 6 bits) is what outliers growing with training look like: once past it, a tensorwise
cast flushes the tensor's bulk to zero. When the trend reaches the limit within the horizon:

- the layer trains in fp8 (`--dtype fp8`): an `alert` (reason `forecast_fp8`), which names how to
  take it out of fp8 before it gets there;
- otherwise a `forecast` event (severity `info`): the layer will stop being fp8-ready.

Once per layer and tensor, until the verdict turns or the run changes dtype.
"""

from __future__ import annotations

from amp_tui.training.fp8.whatif import RECIPE, crest_limit

POINTS = 4          # the newest what-ifs a trend is fitted on: outliers grow faster and faster
MIN_POINTS = 3      # ... and the fewest that make one
MIN_SLOPE = 1e-4    # bits a step: flatter than this is no trend


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of crest over step."""
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_c = sum(c for _, c in points) / n
    spread = sum((s - mean_s) ** 2 for s, _ in points)
    return sum((s - mean_s) * (c - mean_c) for s, c in points) / spread if spread else 0.0


class Fp8Forecast:
    def __init__(self, horizon: int):
        self.horizon = horizon
        self._crests: dict[tuple[str, str], list[tuple[int, float]]] = {}
        self._said: set[tuple[str, str]] = set()

    def reset(self) -> None:
        self._said.clear()

    def observe(self, step: int, whatif: dict) -> list[dict]:
        """The what-if of `step`; returns what to say: one dict per layer and tensor whose crest
        reaches its limit within the horizon (`module`, `tensor`, `format`, `eta`, `at_step`,
        `crest`, `limit`, `slope`, `first`: the oldest crest of the trend and its step)."""
        verdict = whatif.get("verdict") or {}
        found = []
        for row in whatif.get("rows") or []:
            tensor, module = row.get("tensor"), row.get("module")
            if row.get("op") is not None:   # a matmul outside nn.Linear: torchao trains none in fp8
                continue
            if (row.get("format"), row.get("scaling")) != RECIPE.get(tensor) or row.get("crest_bits") is None:
                continue
            key = (module, tensor)
            points = self._crests.setdefault(key, [])
            points.append((step, float(row["crest_bits"])))
            del points[:-POINTS]
            if verdict.get(module) != "fp8":
                self._said.discard(key)   # not fp8-ready now: a later return is news again
                continue
            said = self._outlook(key, points, row["format"])
            if said is not None:
                found.append(said)
        return found

    def _outlook(self, key, points, fmt: str) -> dict | None:
        if key in self._said or len(points) < MIN_POINTS:
            return None
        slope, limit, (step, crest) = _slope(points), crest_limit(fmt), points[-1]
        if slope < MIN_SLOPE or crest >= limit:
            return None
        eta = round((limit - crest) / slope)
        if eta > self.horizon:
            return None
        self._said.add(key)
        first_step, first = points[0]
        return {"module": key[0], "tensor": key[1], "format": fmt, "eta": eta, "at_step": step + eta,
                "crest": round(crest, 2), "limit": round(limit, 2), "slope": float(f"{slope:.4g}"),
                "first": round(first, 2), "first_step": first_step}


def fp8_forecast_words(said: dict, *, in_fp8: bool) -> tuple[str, str, str]:
    """The forecast as message, cause and fix."""
    module, tensor = said["module"], said["tensor"]
    message = (f"{module}'s {tensor} crest grows {said['slope']:.3g} bits a step ({said['first']:.1f} → "
               f"{said['crest']:.1f} bits since step {said['first_step']:,}): at this trend it passes "
               f"{said['limit']:.1f} bits, where {said['format']} tensorwise flushes its bulk to zero, in about "
               f"{said['eta']:,} steps (step ~{said['at_step']:,})")
    cause = ("a few of its values grow away from the rest as it trains (outlier channels, as large "
             "language models' massive activations grow), and one scale for the tensor follows the largest")
    if in_fp8:
        fix = (f"take it out of fp8 before then: fp32={module} (dashboard or ctl) or, for the next run, "
               "--fp8-filter with the filter of the what-if that keeps it; d takes the whole run to bf16")
    else:
        fix = ("nothing now: it is fp8-ready today; train it in bf16 (the filter of a later what-if keeps "
               "it there), or use rowwise or MX scaling, which follow such values per row or per block")
    return message, cause, fix
