"""The writer and the replay index agree on a step record's leading fields."""

import math
from types import SimpleNamespace

import pytest

from amp_tui.core import jsonsafe
from amp_tui.recording.format import STEP_HEAD, step_record
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.step_lines import STEP_LINE
from amp_tui.recording.writer import SessionWriter
from amp_tui.training.probes.layer_probes import LayerFigures


def result(step: int, *, loss=0.5, scale=65536.0, figures=True, **more):
    figs = LayerFigures(act=[1.0, None], grad=[2.0, math.inf], weight=[0.5, 0.25]) if figures else None
    base = dict(step=step, loss=loss, scale=scale, skipped=False, skipped_total=0, updates_applied=step + 1,
                dtype="float16", micro_batches=1, nonfinite=None, lr=1e-3, grad_norm=0.7,
                figures=figs, next_scale=scale, duration=0.01, wall_time=1700000000.0 + step)
    base.update(more)
    return SimpleNamespace(**base)


CASES = {
    "figures": result(0),
    "no figures": result(1, figures=False),
    "non-finite loss": result(2, loss=math.nan, nonfinite="loss", skipped=True),
    "no scaler": result(3, scale=None, dtype="bfloat16"),
    "no lr or grad norm": result(4, lr=None, grad_norm=None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_record_leads_with_the_declared_fields_and_the_index_reads_it_fast(case):
    record = step_record(CASES[case])
    assert list(record)[:len(STEP_HEAD)] == list(STEP_HEAD)
    line = jsonsafe.dumps(record).encode()
    assert STEP_LINE.match(line), line[:200]


def test_every_written_step_is_indexed_without_the_full_parse(tmp_path, monkeypatch):
    path = tmp_path / "session.jsonl"
    writer = SessionWriter(path, {"layers": ["a", "b"]})
    for r in CASES.values():
        writer.write(step_record(r))
    writer.finish({"step": 5, "status": "finished"})

    full_parse = SessionIndex._slow

    def no_step_through_the_full_parse(self, raw, offset, length):
        assert not raw.startswith(b'{"type":"step"'), "a step line the writer wrote went to the full parse"
        return full_parse(self, raw, offset, length)
    monkeypatch.setattr(SessionIndex, "_slow", no_step_through_the_full_parse)
    with SessionIndex(path) as index:
        assert index.frames == len(CASES)
        assert math.isnan(index.loss_at(2)) and index.scale_at(3) is None


def _figures(rng, n):
    """Per-layer figures as the probes give them, and the awkward ones: None, NaN, +-inf, -0.0,
    whole numbers, values that round up to the next power of ten, float64's subnormals."""
    special = [None, math.nan, math.inf, -math.inf, -0.0, 0.0, 7.0, 9999.5, 99999.5, 1e4, 12345.678,
               65504.0, 1e15, 1.5e16, 5e-324, 2.2e-308, 1e-30, 1e-5, 0.00012345, 9.99951e-5, 1.0 / 3]
    out = []
    for _ in range(n):
        if rng.random() < 0.2:
            out.append(rng.choice(special))
        else:
            out.append(rng.choice((1, -1)) * 10.0 ** rng.uniform(-12, 18))
    return out


@pytest.mark.parametrize("digits", [3, 4, 5])
def test_a_figures_array_is_what_json_writes_for_the_compact_values(digits):
    import random

    from amp_tui.recording.format import compact_figure, figures_json

    rng = random.Random(digits)
    for k in range(3000):
        values = _figures(rng, rng.randrange(0, 6))
        if k % 2:   # and arrays without anything awkward, the fast path's own
            values = [abs(v) for v in values if isinstance(v, float) and math.isfinite(v) and 1e-4 < abs(v) < 999]
        assert figures_json(values, digits) == jsonsafe.dumps([compact_figure(v, digits) for v in values]), values


def test_a_step_line_is_its_record_as_json_and_the_record_holds_the_compact_values():
    import random

    from amp_tui.recording.format import compact_figure

    rng = random.Random(0)
    for k in range(500):
        n = rng.randrange(1, 8)
        figs = LayerFigures(act=_figures(rng, n), grad=_figures(rng, n), weight=_figures(rng, n),
                            underflow=[rng.random() * 0.01 for _ in range(n)] if k % 3 else None,
                            underflow_scaled=_figures(rng, n) if k % 5 == 1 else None)
        step = result(k, nonfinite="gradients" if k % 7 == 0 else None, lr=None if k % 4 == 0 else 3e-4)
        step.figures = figs
        record = step_record(step)
        assert record.line == jsonsafe.dumps(record)
        assert record["layers"]["act"] == [compact_figure(v) for v in figs.act]
        assert [repr(v) for v in record["layers"]["grad"]] == [repr(compact_figure(v)) for v in figs.grad]
        if figs.underflow is not None:
            assert record["layers"]["underflow"] == [compact_figure(v, 3) for v in figs.underflow]
    plain = step_record(result(1, figures=False))
    assert plain.line == jsonsafe.dumps(plain) and "layers" not in plain
