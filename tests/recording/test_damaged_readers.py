"""What the readers' fuzz (test_reader_fuzz.py) found, each case on its own: a number past float's
range, a lone surrogate, a field of the wrong type, and the exit status of a file that can't be
read. Every `--json` output is strict JSON, and a reader prints text any terminal or pipe takes."""

from __future__ import annotations

import json
import os

import pytest

from amp_tui.cli import main
from amp_tui.core.jsonsafe import output_json, read_float

from support import write_run


def strict(text: str):
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=reject)


def with_last_step(tmp_path, edit) -> str:
    """The 30-step run of support.write_run with its last step line edited by `edit`."""
    path = tmp_path / "session.jsonl"
    write_run(path)
    lines = path.read_bytes().split(b"\n")
    last = max(i for i, line in enumerate(lines) if line.startswith(b'{"type":"step"'))
    lines[last] = edit(lines[last])
    path.write_bytes(b"\n".join(lines))
    return str(tmp_path)


@pytest.mark.parametrize("number, said", [(b"1e400", "Infinity"), (b"-1e400", "-Infinity")])
def test_report_json_writes_numbers_past_floats_range_as_the_session_format_does(tmp_path, capsys,
                                                                                number, said):
    """json.loads reads 1e400 as inf, which json.dumps(allow_nan=False) refused with a traceback
    (`Out of range float values are not JSON compliant: inf`); a whole number of 400 digits could
    not be made a float at all (OverflowError)."""
    digits = b"-" * number.startswith(b"-") + b"9" * 400
    run = with_last_step(tmp_path, lambda line: line.replace(b'"loss":', b'"loss":' + digits + b',"was":', 1)
                         + b'\n{"type":"event","step":' + number + b',"kind":"note","message":"far"}')
    assert main(["report", run, "--json"]) == 0
    data = strict(capsys.readouterr().out)
    assert data["final_loss"] == said and data["steps"] == 30
    assert data["notes"] == [{"step": said, "text": "far"}]
    assert main(["report", run]) == 0
    assert f"final loss         {'inf' if said == 'Infinity' else '-inf'}" in capsys.readouterr().out


def test_output_json_writes_every_non_finite_float_as_a_string():
    text = output_json({"a": [float("inf"), {"b": float("nan")}], "c": (-float("inf"), 1.5)}, indent=2)
    assert strict(text) == {"a": ["Infinity", {"b": "NaN"}], "c": ["-Infinity", 1.5]}
    assert read_float(-(10 ** 400)) == -float("inf") and read_float(10 ** 400) == float("inf")


def test_a_lone_surrogate_escape_is_read_as_a_replacement_character(tmp_path, capsys):
    """`"\\ud800"` is valid JSON for a string no UTF-8 output can hold: printed, it raised
    UnicodeEncodeError in replay --headless, ls and export."""
    path = tmp_path / "runs" / "run" / "session.jsonl"
    path.parent.mkdir(parents=True)
    write_run(path)
    lines = path.read_bytes().split(b"\n")
    lines.insert(len(lines) - 2,   # the last event: ls shows it
                 b'{"type":"event","step":29,"kind":"note","message":"a \\ud800 b","text":"a \\udfff b"}')
    path.write_bytes(b"\n".join(lines))
    for argv in (["replay", str(path.parent), "--headless"], ["ls", str(path.parent.parent)],
                 ["report", str(path.parent)]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        out.encode("utf-8")
        assert "a \ufffd b" in out, argv
    assert main(["export", str(path.parent), "--csv", str(tmp_path / "steps.csv")]) == 0


@pytest.mark.parametrize("edit", [
    lambda line: line.replace(b'"step":29', b'"step":"29"'),
    lambda line: line.replace(b'"dtype":"bfloat16"', b'"dtype":[1]'),
], ids=["step as text", "dtype a list"])
def test_ls_and_report_take_a_step_record_with_a_field_of_the_wrong_type(tmp_path, capsys, edit):
    """`ls` did arithmetic on a step's fields as found (TypeError, KeyError)."""
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    run = with_last_step(run_dir, edit)
    assert main(["ls", str(tmp_path / "runs")]) == 0
    assert "run" in capsys.readouterr().out
    assert main(["report", run]) == 0 and main(["report", run, "--json"]) == 0


def test_report_takes_a_header_and_end_record_with_fields_of_the_wrong_type(tmp_path, capsys):
    path = tmp_path / "session.jsonl"
    write_run(path)
    lines = path.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b'"device":{', b'"device":[],"was":{')
    lines[-2] = lines[-2].replace(b'"status":"finished"', b'"status":null')
    path.write_bytes(b"\n".join(lines))
    assert main(["report", str(path)]) == 0     # a None status broke the table's rendering
    out = capsys.readouterr().out
    assert "status             ?" in out


@pytest.mark.parametrize("first_line", [
    b"",
    b'{"type":"header","format":"amp-tui-session","version":"1"}',
    b'{"type":"header","format":"amp-tui-session","version":7}',
    b'{"type":"step","step":0}',
    b"\xff\xfe garbage",
], ids=["empty", "version as text", "newer version", "no header", "bad bytes"])
@pytest.mark.parametrize("command", [["report"], ["report", "--json"], ["report", "--as-at"],
                                     ["replay", "--headless"], ["export", "--csv", "out.csv"],
                                     ["plot", "-o", "out.png"]], ids=lambda c: " ".join(c))
def test_a_session_that_cannot_be_read_is_one_line_and_exit_status_1(tmp_path, capsys, first_line, command):
    run = tmp_path / "run"
    run.mkdir()
    (run / "session.jsonl").write_bytes(first_line + b'\n{"type":"step","step":0,"loss":1}\n')
    argv = [command[0], str(run), *[str(tmp_path / a) if a.startswith("out") else a for a in command[1:]]]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("amp-tui: error: ")
    assert main([command[0], str(tmp_path / "missing"), *argv[2:]]) == 2   # the path names no session


def test_export_takes_probed_steps_whose_dtype_is_not_text(tmp_path):
    """The headroom's dtype was looked up as found: a dict there raised TypeError (unhashable)."""
    path = tmp_path / "session.jsonl"
    write_run(path)
    path.write_bytes(path.read_bytes().replace(b'"dtype":"bfloat16"', b'"dtype":{"a":1}'))
    assert main(["export", str(path), "--layers-csv", str(tmp_path / "layers.csv"),
                 "--tensorboard", str(tmp_path / "tb")]) == 0
    rows = (tmp_path / "layers.csv").read_text().splitlines()
    assert len(rows) > 1 + 20 * 3    # every probed step's layers, the damaged ones with no dtype


def test_a_step_whose_nonfinite_and_an_intervention_whose_source_are_not_text(tmp_path, capsys):
    """Both were looked up in a dict or a set as found: a list there raised TypeError (unhashable)
    in every reader of the index, and in report --as-at."""
    path = tmp_path / "session.jsonl"
    write_run(path)
    assert main(["report", str(path), "--as-at"]) == 0
    intact = capsys.readouterr().out
    data = path.read_bytes()
    assert b'"nonfinite":"loss"' in data and b'"source":"at"' in data
    path.write_bytes(data.replace(b'"nonfinite":"loss"', b'"nonfinite":["loss"]')
                     .replace(b'"source":"at"', b'"source":["at"]'))
    assert main(["replay", str(path), "--headless"]) == 0
    assert "step 25" in capsys.readouterr().out
    assert main(["report", str(path), "--as-at"]) == 0
    assert capsys.readouterr().out == intact      # a source that names none is the user's


@pytest.mark.parametrize("name, make, shows", [
    ("/dev/zero", None, "can't be read"),
    ("../outside.json", lambda p: p.write_text('{"closest":[{"op":"aten.elsewhere"}]}'), "can't be read"),
    ("xray-step-0000029.json", lambda p: os.mkfifo(p), "can't be read"),
    ("xray-step-0000029.json", lambda p: p.symlink_to("/dev/zero"), "can't be read"),
    ("xray-step-0000029.json", lambda p: p.write_text('{"closest":' + "[" * 100_000 + "]" * 100_000 + "}"),
     "nested too deep"),
    ("xray-step-0000029.json", lambda p: p.write_text('{"closest":[1,"x",{"op":"aten.mm","headroom_bits":3}]}'),
     "3.0 bits  aten.mm"),
], ids=["a device", "outside the run", "a pipe", "a link to a device", "nested deep", "rows not objects"])
def test_report_reads_an_xray_only_from_a_file_of_the_run(tmp_path, capsys, name, make, shows):
    """The X-ray's path comes from the session: /dev/zero or a pipe was read forever, a file
    nested deep raised RecursionError, a row that is not an object AttributeError."""
    path = tmp_path / "session.jsonl"
    write_run(path)
    lines = path.read_bytes().split(b"\n")
    lines.insert(len(lines) - 2, b'{"type":"event","step":29,"kind":"xray","message":"x","path":"'
                 + name.encode() + b'"}')
    path.write_bytes(b"\n".join(lines))
    if make is not None:
        make(tmp_path / name)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "last X-ray" in out and shows in out and "aten.elsewhere" not in out


@pytest.mark.parametrize("name, make, shows", [
    ("/dev/zero", None, "can't be read"),
    ("../outside.json", lambda p: p.write_text('{"rows":[],"verdict":{"elsewhere":"fp8"}}'), "can't be read"),
    ("fp8-step-0000029.json", lambda p: os.mkfifo(p), "can't be read"),
    ("fp8-step-0000029.json", lambda p: p.write_text('{"rows":[1,"x"],"verdict":{"fc":3,"head":"fp8"}}'),
     "1 of 2 Linear layers fp8-ready"),
], ids=["a device", "outside the run", "a pipe", "verdicts not text"])
def test_report_reads_an_fp8_whatif_only_from_a_file_of_the_run(tmp_path, capsys, name, make, shows):
    """As the X-ray's: the what-if's path comes from the session, its verdict from a file."""
    path = tmp_path / "session.jsonl"
    write_run(path)
    lines = path.read_bytes().split(b"\n")
    lines.insert(len(lines) - 2, b'{"type":"event","step":29,"kind":"fp8","message":"x","path":"'
                 + name.encode() + b'","filter":"fp8-filter-step-0000029.py"}')
    path.write_bytes(b"\n".join(lines))
    if make is not None:
        make(tmp_path / name)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "last fp8 what-if" in out and shows in out and "elsewhere" not in out


def test_replay_headless_takes_an_end_scale_past_floats_range(tmp_path, capsys):
    """A storm of skips up to the last step is told with the end record's scale: a whole number
    of 400 digits there raised OverflowError."""
    path = tmp_path / "session.jsonl"
    write_run(path, steps=3)   # steps 0-2 overflow: the storm runs to the end
    lines = path.read_bytes().split(b"\n")
    assert lines[-2].startswith(b'{"type":"end"')
    lines[-2] = lines[-2].replace(b'"scale":', b'"scale":' + b"9" * 400 + b',"was":', 1)
    path.write_bytes(b"\n".join(lines))
    assert main(["replay", str(path), "--headless"]) == 0
    assert "inf" in capsys.readouterr().out
