"""The pass criteria of `amp-tui compare`, fixed before the run, and their defaults.

No torch here: the command line builds these before anything is loaded, and `tolerance` works on
whatever tensor it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The defaults are documented in docs/compare.md.
DEFAULT_ATOL = 1e-2
DEFAULT_RTOL = 1e-2
DEFAULT_MIN_AGREEMENT = 0.95
# The eval set is fixed before the run too: this many of the script's batches when it has no
# eval_batches of its own.
DEFAULT_EVAL_BATCHES = 4
# Relative difference = |amp - fp32| / max(|fp32|, REL_FLOOR): a reference score that happens to
# sit near zero does not make the relative figure explode.
REL_FLOOR = 1e-3


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

    def tolerance(self, ref):
        """How far each element of `ref` (a tensor) may move: atol + rtol·|ref|."""
        return self.atol + self.rtol * ref.abs()

    def failures(self, result) -> list[str]:
        """The criteria a dtype's figures (a DtypeResult) fail, in the order they are reported."""
        failed = []
        if not result.finite:
            failed.append("finite")
        if result.out_of_tolerance:
            failed.append("tolerance")
        if result.flips > self.max_flips.allowed(result.samples):
            failed.append("flips")
        if result.agreement < self.min_agreement:
            failed.append("agreement")
        return failed

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
