"""The default schedule's lines of bench/monitor_overhead.py (amp_tui.monitor in a loop of the
user's own) and bench/integration_overhead.py (the Hugging Face callback), checked on tiny models
and a few rounds: that `probe_every="auto"` runs through the same measuring code and gives every
figure. No assertion on speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import monitor_overhead  # noqa: E402
from bench.models import MlpSpec  # noqa: E402


def test_both_scripts_measure_the_default_schedule_beside_the_fixed_ones():
    from bench import integration_overhead

    for module in (monitor_overhead, integration_overhead):
        assert module.EVERY == (1, 10, "auto")
        assert module.TARGETS["auto"] == 0.99   # at most 1% with the defaults
    assert monitor_overhead.probes_label("auto") == "auto (default)"


@pytest.mark.parametrize("every", [1, "auto"])
def test_the_monitor_line_gives_every_figure(every):
    r = monitor_overhead.measure(MlpSpec(depth=2, width=16, batch=4), "float32", every, rounds=4, warmup=4,
                                 block=3)
    assert r["probe_every"] == every and r["rounds"] == 4 and r["block"] == 3
    assert r["bare_step_ms"] > 0 and r["monitored_step_ms"] > 0 and r["steps_per_s_ratio"] > 0
    lo, hi = r["ratio_90ci"]
    assert lo <= r["steps_per_s_ratio"] <= hi
    assert 0 <= r["probed_share"] <= 1 and r["schedule_interval"] >= 1
    if every == 1:
        assert r["probed_share"] == 1 and r["schedule_interval"] == 1


def test_the_callback_line_runs_the_default_schedule():
    pytest.importorskip("transformers")
    from bench import integration_overhead

    spec = integration_overhead.Gpt2Spec(layers=1, d_model=16, heads=2, vocab=64, seq=8, batch=2)
    r = integration_overhead.measure(spec, "fp32", "auto", rounds=3, warmup=3, block=2)
    assert r["probe_every"] == "auto" and r["target"] == 0.99 and (r["rounds"], r["block"]) == (3, 2)
    assert r["bare_step_ms"] > 0 and r["watched_step_ms"] > 0 and r["steps_per_s_ratio"] > 0
    assert 0 <= r["probed_share"] <= 1 and r["schedule_interval"] >= 1


def test_the_bare_loop_runs_none_of_the_monitors_hooks_on_the_shared_model(tmp_path):
    import copy

    import torch

    from bench.models import build

    model, batches, loss_fn, _ = build(MlpSpec(depth=2, width=16, batch=4), "cpu")
    shared = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(shared.parameters(), lr=1e-4)
    watched = monitor_overhead.Loop(shared, batches, loss_fn, "float16", monitor_every="auto",
                                    run_dir=tmp_path / "run", optimizer=optimizer)

    def hooks():
        return (len(shared._forward_pre_hooks) + len(shared._forward_hooks),
                len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks),
                sorted(k for k in ("step", "unscale_") if k in watched.scaler.__dict__))

    on = hooks()
    assert on[0] > 0 and on[1] > 0 and on[2] == ["step", "unscale_"]
    for _ in range(2):
        watched.set_aside()
        watched.set_aside()
        assert hooks() == (0, 0, [])
        watched.put_back()
        watched.put_back()
        assert hooks() == on   # back once, not twice
        watched.step()
    watched.close()
