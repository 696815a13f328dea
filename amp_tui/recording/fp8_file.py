"""An fp8 what-if's files: the JSON of one step's Linear layers cast to fp8 and fp4
(`fp8-step-0000123.json`) and the filter it implies for torchao (`fp8-filter-step-0000123.py`),
both in the run directory next to the session, named by the `fp8` event (docs/session-format.md).
Their names, the filter's source, reading the JSON back, and the verdict in words, for the event,
the report and the dashboard alike."""

from __future__ import annotations

from pathlib import Path

from amp_tui.core.precision import FP8_SHAPE_MULTIPLE
from amp_tui.recording.run_files import read_run_json

SHOWN = 5   # the layers kept in bf16 that a report lists


def fp8_file_name(step: int) -> str:
    return f"fp8-step-{step:07d}.json"


def fp8_filter_name(step: int) -> str:
    return f"fp8-filter-step-{step:07d}.py"


def read_fp8(run_dir: str | Path, relative: str) -> dict:
    """The what-if an event's `path` names (relative to the run directory), read as
    run_files.read_run_json reads: OSError for a file that can't be read, ValueError for one that
    is not a what-if."""
    data = read_run_json(run_dir, relative, "fp8 what-if")
    if not isinstance(data.get("rows"), list) or not isinstance(data.get("verdict"), dict):
        raise ValueError(f"{relative} is not an fp8 what-if (no 'rows' list and 'verdict')")
    return data


def verdicts(whatif: dict, key: str = "verdict") -> dict[str, str]:
    """The verdict per layer (or, `key="op_verdict"`, per matmul outside nn.Linear), as text (a
    file made by hand may hold anything there)."""
    given = whatif.get(key)
    return {str(m): v if isinstance(v, str) else "bf16: ?" for m, v in given.items()} if isinstance(given, dict) else {}


def ready(whatif: dict) -> list[str]:
    return [m for m, v in verdicts(whatif).items() if v == "fp8"]


def kept(whatif: dict) -> dict[str, str]:
    """The layers the verdict keeps in bf16, with why (the text after "bf16: ")."""
    return {m: v.split(":", 1)[1].strip() if ":" in v else v for m, v in verdicts(whatif).items() if v != "fp8"}


def fp8_message(step: int, whatif: dict) -> str:
    """The what-if's event in words: how many layers are fp8-ready, and the first one kept."""
    fp8, held = ready(whatif), kept(whatif)
    total = len(fp8) + len(held)
    if total == 0:
        return f"fp8 what-if of step {step}: no nn.Linear ran in the step"
    words = f"fp8 what-if of step {step}: {len(fp8)} of {total} Linear layers fp8-ready"
    if held:
        module, why = next(iter(held.items()))
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        words += f"; keep {module} in bf16{more}: {why}"
    ops = verdicts(whatif, "op_verdict")
    if ops:
        words += (f"; matmuls outside nn.Linear: {sum(v == 'fp8' for v in ops.values())} of {len(ops)} "
                  "fp8-ready")
    return words


def filter_source(whatif: dict, *, step: int, run: str) -> str:
    """A Python file defining `module_filter_fn(module, fqn)` for torchao's
    `convert_to_float8_training`: the layers the what-if found fp8-ready, and of those only the
    ones whose weight's dimensions are multiples of 16 (torchao's shape rule)."""
    fp8 = sorted(ready(whatif))
    held = kept(whatif)
    run = run.replace("\\", "/").replace('"', "'")   # it goes in the docstring
    ready_lines = "".join(f"    {name!r},\n" for name in fp8)
    ready_block = f"FP8_READY = {{\n{ready_lines}}}" if fp8 else "FP8_READY: set[str] = set()"
    held_lines = "".join(f"    {name!r}: {why!r},\n" for name, why in sorted(held.items()))
    return f'''"""Which nn.Linear layers to train in fp8, from amp-tui's what-if of step {step} of {run}.

    from torchao.float8 import convert_to_float8_training
    convert_to_float8_training(model, module_filter_fn=module_filter_fn)

A layer converts when the what-if found its input, weight and output gradient fp8-ready, cast as
torchao's default recipe casts them:
    {_recipe_words(whatif)}
and both dimensions of its weight are multiples of {FP8_SHAPE_MULTIPLE}. Layers the what-if did not see
(no forward ran them in that step) stay in high precision.
"""

import torch

{ready_block}

# Kept in high precision, and why.
KEEP_BF16 = {{
{held_lines}}}


def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
    if not isinstance(module, torch.nn.Linear) or fqn not in FP8_READY:
        return False
    out_features, in_features = module.weight.shape
    return out_features % {FP8_SHAPE_MULTIPLE} == 0 and in_features % {FP8_SHAPE_MULTIPLE} == 0
'''


def _recipe_words(whatif: dict) -> str:
    recipe = whatif.get("recipe") or {}
    return ", ".join(f"{tensor} {how}" for tensor, how in recipe.items()) or "tensorwise"


def verdict_lines(whatif: dict, shown: int = SHOWN) -> list[str]:
    """The verdict in lines for a report: the count, then the layers kept in bf16 and why."""
    held = kept(whatif)
    fp8 = ready(whatif)
    lines = [f"{len(fp8)} of {len(fp8) + len(held)} Linear layers fp8-ready"]
    lines += [f"keep {module} in bf16: {why}" for module, why in list(held.items())[:shown]]
    if len(held) > shown:
        lines.append(f"... and {len(held) - shown} more kept in bf16")
    return lines


# The columns of a what-if's layer table (dashboard and report): (key, heading). The casts are the
# default recipe's (input and weight in e4m3, the gradient in e5m2, tensorwise), MX beside them.
SUMMARY_COLUMNS = (("module", "layer"), ("verdict", "verdict"), ("input_db", "input dB"),
                   ("input_channel_db", "in ch dB"), ("weight_db", "weight dB"), ("grad_db", "grad dB"),
                   ("output_db", "out dB"), ("input_underflow", "in underflow"), ("input_crest", "in crest"),
                   ("input_mx_db", "in MX dB"), ("why", "why"))


def _row(rows: list[dict], module: str, tensor: str, fmt: str, scaling: str, op: str | None = None) -> dict:
    return next((r for r in rows if r.get("module") == module and r.get("op") == op and r.get("tensor") == tensor
                 and r.get("format") == fmt and r.get("scaling") == scaling), {})


def layer_summaries(whatif: dict) -> list[dict]:
    """One line per layer, then per matmul outside nn.Linear (`blocks.0.attn:matmul#0`): the
    verdict, and the figures it was judged on."""
    rows = [r for r in whatif.get("rows", []) if isinstance(r, dict)]
    ops = whatif.get("ops") if isinstance(whatif.get("ops"), dict) else {}
    out = []
    for kind in ("verdict", "op_verdict"):
        for name, verdict in verdicts(whatif, kind).items():
            where = ops.get(name) if kind == "op_verdict" and isinstance(ops.get(name), dict) else {}
            module, op = (where.get("module"), where.get("op")) if where else (name, None)
            out.append(_summary(rows, name, verdict, module, op))
    return out


def _summary(rows: list[dict], name: str, verdict: str, module: str, op: str | None) -> dict:
    def tensorwise(tensor, fmt="e4m3", scaling="tensorwise"):
        return _row(rows, module, tensor, fmt, scaling, op)

    inp, grad = tensorwise("input"), tensorwise("grad_output", "e5m2")
    return {"module": name, "verdict": "fp8" if verdict == "fp8" else "bf16",
            "input_db": inp.get("sqnr_db"), "input_channel_db": inp.get("channel_sqnr_db"),
            "weight_db": tensorwise("weight").get("sqnr_db"),
            "grad_db": grad.get("sqnr_db"), "output_db": inp.get("output_sqnr_db"),
            "input_underflow": inp.get("underflow"), "input_crest": inp.get("crest_bits"),
            "input_mx_db": tensorwise("input", "mxfp8", "block32").get("sqnr_db"),
            "why": verdict.split(":", 1)[1].strip() if verdict != "fp8" and ":" in verdict else ""}


def summary_cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "input_underflow" and isinstance(value, (int, float)):
        return f"{value:.2%}"
    if key == "input_crest" and isinstance(value, (int, float)):
        return f"{value:.1f} b"
    if isinstance(value, (int, float)):
        return f"{value:.1f}"
    return str(value)


TREND_FILES = 50   # the most recent what-ifs a report reads to tell a trend


def trend_lines(run_dir: str | Path, events: list[dict]) -> list[str]:
    """How each layer fared over a run's what-ifs (the last TREND_FILES; none with fewer than
    two): a layer whose verdict turned, with the step, and how far its input's crest moved. Files
    that can't be read are left out."""
    seen: list[tuple[int, dict]] = []
    for event in events[-TREND_FILES:]:
        try:
            seen.append((int(event.get("step", 0)), read_fp8(run_dir, str(event.get("path", "")))))
        except (OSError, ValueError, TypeError):
            continue
    if len(seen) < 2:
        return []
    lines = [f"{len(seen)} what-ifs, steps {seen[0][0]:,} to {seen[-1][0]:,}"]
    first_step, first = seen[0]
    for module, verdict in verdicts(first).items():
        history = [(step, verdicts(w).get(module)) for step, w in seen]
        turned = next((step for step, v in history if v is not None and (v == "fp8") != (verdict == "fp8")), None)
        crest = [_input_crest(w, module) for _, w in seen]
        crest = [c for c in crest if c is not None]
        moved = f" (input crest {crest[0]:.1f} -> {crest[-1]:.1f} bits)" if len(crest) >= 2 else ""
        if turned is not None:
            now = "fp8" if verdict != "fp8" else "bf16"
            lines.append(f"{module}: {'fp8' if verdict == 'fp8' else 'bf16'} at step {first_step:,}, "
                         f"{now} from step {turned:,}{moved}")
    if len(lines) == 1:
        lines.append("no layer's verdict turned")
    return lines


def _input_crest(whatif: dict, module: str):
    crest = _row([r for r in whatif.get("rows", []) if isinstance(r, dict)], module, "input", "e4m3",
                 "tensorwise").get("crest_bits")
    return crest if isinstance(crest, (int, float)) else None
