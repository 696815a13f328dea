"""bench/overhead.py, the per-step benchmark, checked on a tiny model and two rounds: each
contender runs its steps in blocks, paired step for step with the bare loop's, and `run/auto`
gives the schedule's figures beside the benchmark's. No assertion on speed."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import overhead  # noqa: E402
from bench.models import MlpSpec  # noqa: E402


def test_each_contender_runs_blocks_of_consecutive_steps_paired_with_the_bare_loops(monkeypatch):
    spec = MlpSpec(depth=2, width=16, batch=4)
    seen: dict[str, list[int]] = {}
    real = overhead.make_contenders

    def spying(*args, **kwargs):
        contenders = real(*args, **kwargs)
        for name, c in contenders.items():
            step = c.step

            def counted(step=step, name=name):
                seen.setdefault("order", []).append(name)
                return step()
            c.step = counted
        return contenders

    monkeypatch.setattr(overhead, "make_contenders", spying)
    r = overhead.measure(spec, "float32", names=("bare", "run/auto"), rounds=2, min_rounds=2,
                         warmup=1, block=4, log=lambda *a: None)
    assert (r["rounds"], r["block"]) == (2, 4)
    measured = seen["order"][2:]   # after the warm-up round's one step each
    assert len(measured) == 16
    runs = [measured[i:i + 4] for i in range(0, 16, 4)]
    assert all(len(set(block)) == 1 for block in runs)   # 4 steps of one contender in a row
    auto = r["contenders"]["run/auto"]
    assert {"overhead_pct", "overhead_pct_90ci", "probed_share", "schedule_share_pct",
            "bench_share_pct"} <= set(auto)
    assert 0 < auto["probed_share"] <= 1
