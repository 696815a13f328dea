"""docs/session-format.md is the writer's contract: its tables list every record kind, field,
event kind and intervention action the writer writes, and nothing it never writes.

Real runs drive every one of them (policies, every action from --at and from ctl, a restore
refused and one done, a fallback, a script error, a resume); every key written is compared
with the doc's tables. A new field needs its row in the doc, and a row needs a writer.
"""

import re
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # the forecasts' acceptance cases live with the benchmark that reuses them
    sys.path.insert(0, str(ROOT))

from autopilot_cases import ATTENTION  # noqa: E402

import amp_tui  # noqa: E402
from amp_tui.cli import main  # noqa: E402
from amp_tui.core.commands import Command  # noqa: E402
from amp_tui.job.steering.control import send  # noqa: E402
from amp_tui.training.step.guards import GuardConfig  # noqa: E402
from bench import forecast_cases  # noqa: E402

from support import DEMOS, REPO, strict_lines, train_run  # noqa: E402

DOC = REPO / "docs" / "session-format.md"

# Batch 3 of 4 is scaled far past fp16's range: every 4th step's loss overflows in fp16 (first
# non-finite output: layer "0"), and never in bf16 or fp32. A scheduler and clipping are set so
# that `lr` and `grad_norm` are written. FAIL_AFTER makes loss_fn raise once it was called that
# many times (the pre-flight counts), so the script fails within the first steps.
SCRIPT = '''
import torch
from torch import nn

FAIL_AFTER = None

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = torch.randn(64, 8)
    ys = xs.sum(1, keepdim=True)
    batches = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]
    batches[3] = (batches[3][0] * 1e5, batches[3][1])
    calls = [0]
    def loss_fn(model, batch):
        calls[0] += 1
        if FAIL_AFTER is not None and calls[0] > FAIL_AFTER:
            raise ValueError("this batch is broken")
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches,
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5), "max_grad_norm": 1.0}
'''


# ---- the doc's tables ---------------------------------------------------------------------------

def doc_sections() -> dict[str, str]:
    out, title = {}, None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            out[title] = ""
        elif title is not None:
            out[title] += line + "\n"
    return out


def tables(body: str) -> list[list[list[str]]]:
    """The markdown tables of a section: rows of cells, the heading row first."""
    found, rows = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif rows:
            found.append(rows)
            rows = []
    return found


def names(cell: str) -> list[str]:
    return [n for n in re.findall(r"`([^`]+)`", cell) if re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?", n)]


def section(title_start: str) -> str:
    return next(body for title, body in doc_sections().items() if title.startswith(title_start))


def field_table(title_start: str) -> list[str]:
    """The names in the first column of the section's `field | meaning` table, in table order."""
    table = next(t for t in tables(section(title_start)) if t[0][0] == "field")
    return [n for row in table[1:] for n in names(row[0])]


def event_kinds() -> dict[str, set[str]]:
    table = next(t for t in tables(section("Event record")) if t[0][:2] == ["kind", "fields"])
    return {names(row[0])[0]: set(names(row[1])) for row in table[1:]}


def intervention_actions() -> set[str]:
    table = next(t for t in tables(section("Event record")) if t[0][0] == "action")
    return {n for row in table[1:] for n in names(row[0])}


# ---- what the writer writes ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("session_doc")
    script = folder / "train_script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    out: list[dict] = []

    def train(name, *flags, status=None):
        run_dir = folder / name
        code = main(["train", str(script), "--headless", "--run-dir", str(run_dir), *flags])
        if status is not None:
            assert code == status, name
        out.extend(strict_lines(run_dir / "session.jsonl"))
        return run_dir

    # Every --at action (a note and an X-ray too), a refused restore (a `refused` event), an alert, a pause on
    # a non-finite loss answered over the control socket (step, then resume: the `client` field; an undo this
    # run refuses), underflow shares on every probe.
    steered = folder / "steered"
    run = train_run(
        script, steered, steps=14, underflow_every=1, on_nonfinite="pause", guard=GuardConfig(min_scale=2048.0),
        at=["1:save", "1:scale=1024", "2:fp32=0", "6:restore=latest", "6:restore=nothing-here.safetensors",
            "8:dtype=bf16", "9:dtype=fp16", "10:pause", "11:note=shard 3 → 4: lr=1e-4", "13:stop",
            "1:probe=every", "4:xray", "5:fp8"])
    answers: list[dict] = []
    pauses = []

    def on_record(record):
        if record.get("kind") == "paused" or (record.get("action") == "pause"
                                              and record.get("after", {}).get("state") == "paused"):
            commands = (["step", "note=answered over ctl", "probe=auto", "xray", "fp8", "undo", "resume"] if not pauses
                        else ["resume"])
            pauses.append(record)
            threading.Thread(target=lambda: answers.extend(send(steered, c) for c in commands)).start()
    run.observers.append(on_record)
    # A program's command that its handler raises on (no parser lets this value through): an error.
    run.submit(Command("scale", "not a number", "api"))
    assert run.run() == 0
    # Every answer is yes but the undo's, refused (this run has no autopilot): a `refused` event.
    assert len(pauses) >= 2 and [a["ok"] for a in answers].count(False) == 1, answers
    out.extend(strict_lines(steered / "session.jsonl"))

    # The ladder moving on its own, --rollback without a checkpoint; a stop on a non-finite loss;
    # the script raising; a resume.
    train("fallback", "--steps", "6", "--on-nonfinite", "fallback", "--fallback-after", "1",
          "--rollback", status=0)
    train("stop", "--steps", "10", "--on-nonfinite", "stop", status=3)
    # fp8: the what-if that chooses the layers, the fp8_layers event, the fp8 layers' amax.
    assert main(["train", str(DEMOS / "fp8_outliers.py"), "--headless", "--run-dir", str(folder / "fp8"),
                 "--dtype", "fp8", "--steps", "3", "--probe-every", "1"]) == 0
    out.extend(strict_lines(folder / "fp8" / "session.jsonl"))
    # The autopilot: the attention isolated in fp32 on a replay of its failing step, then undone.
    attention = folder / "attention.py"
    attention.write_text(ATTENTION, encoding="utf-8")
    assert main(["train", str(attention), "--headless", "--run-dir", str(folder / "isolate"), "--dtype", "fp16",
                 "--steps", "3", "--on-nonfinite", "isolate", "--at", "2:undo"]) == 0
    out.extend(strict_lines(folder / "isolate" / "session.jsonl"))
    script.write_text(SCRIPT.replace("FAIL_AFTER = None", "FAIL_AFTER = 3"), encoding="utf-8")
    # A start above GradScaler's default (no calibration): step 0's gradient overflow is replayed,
    # and the replay meets the script's error (`op_trace_error`).
    train("error", "--steps", "5", "--init-scale", "1048576", status=1)
    script.write_text(SCRIPT, encoding="utf-8")
    code = main(["train", str(script), "--headless", "--resume", str(steered), "--steps", "2"])
    assert code == 0
    out.extend(r for r in strict_lines(steered / "session.jsonl") if r.get("kind") == "resumed")
    out.extend(monitored_overflow(folder / "monitored"))
    out.extend(monitored_held_back(folder / "held_back"))

    # The forecasts, in monitored loops that show them (bench/forecast_cases.py): a scale growth
    # that overflows, forecast and checked; the layers' ETAs of attention logits that grow, and
    # their alert (at step 74 under the horizon of 100).
    near = forecast_cases.near_half(folder / "near_half", steps=forecast_cases.GROWTH_INTERVAL + 2)
    logits = forecast_cases.growing_logits(folder / "logits", steps=80)
    out.extend(r for r in near + logits if r["type"] in ("step", "event"))
    return out


def monitored_overflow(run_dir) -> list[dict]:
    """A loop of the user's own whose fp16 forward overflows: its replay's fields."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.fill_(3000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=run_dir, announce=False)
    with monitor.step() as step:
        with monitor.autocast():
            out = model(torch.full((2, 8), 10.0))
        step.loss = loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    return strict_lines(run_dir / "session.jsonl")


def monitored_held_back(run_dir) -> list[dict]:
    """A loop of the user's own without a GradScaler whose loss is NaN: the update held back."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = amp_tui.monitor(model, opt, dtype="fp32", run_dir=run_dir, announce=False, control=False)
    with monitor.step() as step:
        step.loss = loss = model(torch.ones(2, 4)).mean() * float("nan")
        loss.backward()
        opt.step()
    monitor.close()
    return strict_lines(run_dir / "session.jsonl")


def keys(records: list[dict], *, nested: bool) -> set[str]:
    """Every field written; with `nested`, the fields of object-valued fields too, as `a.b`."""
    found = set()
    for record in records:
        for key, value in record.items():
            found.add(key)
            if nested and isinstance(value, dict):
                found |= {f"{key}.{sub}" for sub in value}
    return found


def of_type(records, kind):
    return [r for r in records if r["type"] == kind]


def test_the_record_kinds_are_the_documented_ones(records):
    documented = {m.group(1) for m in map(re.compile(r'"type": "(\w+)"').search, doc_sections()) if m}
    assert {r["type"] for r in records} == documented == {"header", "step", "event", "end"}


@pytest.mark.parametrize("kind, title, nested", [
    ("header", "Header", True), ("step", "Step record", True), ("end", "End record", False)])
def test_every_field_written_is_documented_and_every_documented_one_is_written(records, kind, title, nested):
    written = keys(of_type(records, kind), nested=nested)
    documented = set(field_table(title))
    assert not written - documented, f"{kind} fields written but not in the doc: {sorted(written - documented)}"
    assert not documented - written, f"{kind} fields in the doc but never written: {sorted(documented - written)}"


def test_step_fields_come_in_the_documented_order(records):
    order = [n for n in field_table("Step record") if "." not in n]
    for record in of_type(records, "step"):
        written = list(record)
        assert written == sorted(written, key=order.index), written


def test_every_event_kind_and_its_fields_are_documented(records):
    events = of_type(records, "event")
    common = set(field_table("Event record"))
    kinds = event_kinds()
    assert {e["kind"] for e in events} == set(kinds), "event kinds written vs documented"
    for kind, documented in kinds.items():
        written = keys([e for e in events if e["kind"] == kind], nested=False)
        assert common <= written, f"{kind}: a common field is missing"
        extra = written - common
        assert extra == documented, (f"{kind}: written but not documented {sorted(extra - documented)}, "
                                     f"documented but never written {sorted(documented - extra)}")


def test_every_intervention_action_is_documented(records):
    written = {e["action"] for e in of_type(records, "event") if e["kind"] == "intervention"}
    assert written == intervention_actions()
