"""A run's fp8 what-ifs over time (recording/fp8_file.py, `trend_lines`): a layer whose input's
outliers grow turns from fp8 to bf16, and the report says at which step."""

from __future__ import annotations

import json

from amp_tui.recording.fp8_file import trend_lines


def whatif(crest: float, verdict: str) -> dict:
    row = {"module": "fc2", "tensor": "input", "format": "e4m3", "scaling": "tensorwise", "crest_bits": crest}
    return {"rows": [row], "verdict": {"fc1": "fp8", "fc2": verdict}}


def test_a_layer_whose_crest_grows_turns_to_bf16_at_the_step_it_did(tmp_path):
    events = []
    grown = ((100, 4.0, "fp8"), (200, 7.5, "fp8"), (300, 10.2, "bf16: crest"), (400, 12.0, "bf16: crest"))
    for step, crest, verdict in grown:
        name = f"fp8-step-{step:07d}.json"
        (tmp_path / name).write_text(json.dumps(whatif(crest, verdict)), encoding="utf-8")
        events.append({"kind": "fp8", "step": step, "path": name})
    events.append({"kind": "fp8", "step": 500, "path": "missing.json"})   # left out
    assert trend_lines(tmp_path, events) == ["4 what-ifs, steps 100 to 400",
                                             "fc2: fp8 at step 100, bf16 from step 300 (input crest 4.0 -> 12.0 bits)"]
    assert trend_lines(tmp_path, events[:1]) == []
    assert trend_lines(tmp_path, events[:2])[-1] == "no layer's verdict turned"
