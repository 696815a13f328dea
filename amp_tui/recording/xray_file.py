"""An X-ray's file: the step a run traced op by op on request (`xray`), kept as JSON in the run
directory next to the session (`xray-step-0000123.json`; its event names it, docs/session-format.md).
Its name, reading it back, and its closest ops in words, for the event, the report and the
dashboard alike."""

from __future__ import annotations

from pathlib import Path

from amp_tui.recording.run_files import read_run_json

CLOSEST_SHOWN = 5   # the closest ops a report lists
def xray_file_name(step: int) -> str:
    return f"xray-step-{step:07d}.json"


def read_xray(run_dir: str | Path, relative: str) -> dict:
    """The X-ray an event's `path` names (relative to the run directory), read as
    run_files.read_run_json reads: OSError for a file that can't be read, ValueError for one that
    is not an X-ray."""
    data = read_run_json(run_dir, relative, "X-ray")
    if not isinstance(data.get("closest"), list):
        raise ValueError(f"{relative} is not an X-ray (no 'closest' list)")
    return data


def module_words(module: str | None) -> str:
    """A module as the X-ray names it: None is outside the model (the loss), "" the model's own
    forward."""
    if module is None:
        return "the loss (outside the model)"
    return module or "the model's own forward"


def bits_words(bits) -> str:
    return f"{bits:.1f} bits" if isinstance(bits, (int, float)) else "? bits"


def xray_message(step: int, xray: dict) -> str:
    """The X-ray's event in words: the op with the least headroom, and how little it has."""
    closest = xray.get("closest") or []
    if not closest:
        return f"X-ray of step {step}: {xray.get('ops_traced', 0)} ops traced, none with a finite nonzero output"
    first = closest[0]
    return (f"X-ray of step {step}: closest to {first.get('dtype')}'s max: {first.get('op')} in "
            f"{module_words(first.get('module'))}, {bits_words(first.get('headroom_bits'))}")


def closest_lines(xray: dict, limit: int | None = None) -> list[str]:
    """One line per op, least headroom first: "1.7 bits  aten.mm (backward, float16) in blocks.0"."""
    rows = [r for r in (xray.get("closest") or []) if isinstance(r, dict)][:limit]
    return [f"{bits_words(r.get('headroom_bits'))}  {r.get('op')} ({r.get('phase')}, {r.get('dtype')}) "
            f"in {module_words(r.get('module'))}" for r in rows]
