"""The writer and the replay index agree on a step record's leading fields."""

import math
from types import SimpleNamespace

import pytest

from amp_tui.core import jsonsafe
from amp_tui.recording import index as index_mod
from amp_tui.recording.format import STEP_HEAD, step_record
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.writer import SessionWriter
from amp_tui.training.probes import LayerFigures


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
    assert index_mod._STEP_HEAD.match(line), line[:200]


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
