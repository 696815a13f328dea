"""`amp-tui report` reads a recording in one pass through the replay index (`read_digest`)
instead of loading every record: the summary is the one the whole session gives, on runs that
end or don't, are resumed, hold damage, unknown records, a torn last line, or a step line damaged
past the fields the index reads."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from amp_tui.cli import main
from amp_tui.recording.format import SessionFormatError
from amp_tui.recording.reader import read_session
from amp_tui.recording.report import read_digest, summarize

from support import write_run


def both(path):
    return summarize(read_session(path)).as_json(), summarize(read_digest(path)).as_json()


def recorded(tmp_path, *, end=True) -> list[bytes]:
    path = tmp_path / "session.jsonl"
    write_run(path, end=end)
    return path.read_bytes().split(b"\n")


def written(tmp_path, lines: list[bytes], name="session.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines))
    return path


def damaged_after_the_head(line: bytes) -> bytes:
    """A step line whose leading fields read well and whose per-layer arrays don't parse."""
    assert b'"layers":{"act":[' in line
    return line.replace(b'"act":[', b'"act":[,', 1)


CASES = {
    "finished": lambda lines: lines,
    "no end record": lambda lines: [x for x in lines if not x.startswith(b'{"type":"end"')],
    "resumed (two ends, steps after the first)": lambda lines: lines[:-1] + lines[5:12] + lines[-2:],
    "damaged and unknown lines": lambda lines: [lines[0], b"garbage{", *lines[1:9], b'{"type":"mystery","x":1}',
                                                b'{"type":"step","step":', *lines[9:]],
    "torn last line": lambda lines: lines[:-1] + [lines[-2][:40]],
    "last step damaged past its head": lambda lines: (lambda i: lines[:i] + [damaged_after_the_head(lines[i])]
                                                      + lines[i + 1:])(
        max(k for k, x in enumerate(lines) if x.startswith(b'{"type":"step"') and b'"layers"' in x)),
    "an error event with a long message": lambda lines: lines[:-2] + [
        json.dumps({"type": "event", "step": 30, "kind": "error", "message": "E" * 30_000, "during": "step"},
                   separators=(",", ":")).encode()] + lines[-2:],
    "header only": lambda lines: lines[:1] + [b""],
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_digest_summarizes_as_the_whole_session_does(tmp_path, case):
    path = written(tmp_path, CASES[case](recorded(tmp_path, end=case != "no end record")))
    whole, digest = both(path)
    assert digest == whole


def test_the_cli_report_is_unchanged(tmp_path, capsys):
    path = written(tmp_path, CASES["damaged and unknown lines"](recorded(tmp_path)))
    expected = summarize(read_session(path)).as_json()
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected


@pytest.mark.parametrize("content", [b"", b"not json\n", b'{"type":"header","format":"other"}\n'])
def test_a_file_that_is_no_session_is_refused_in_the_same_words(tmp_path, content):
    path = tmp_path / "session.jsonl"
    path.write_bytes(content)
    with pytest.raises(SessionFormatError) as whole:
        read_session(path)
    with pytest.raises(SessionFormatError) as digest:
        read_digest(path)
    assert str(digest.value) == str(whole.value)


def test_report_holds_no_step_records(tmp_path, capsys):
    """What `amp-tui report` holds grows by the index's few dozen bytes a step, not by the records
    (well over a kilobyte of Python objects a step of this recording when they are all loaded)."""
    lines = recorded(tmp_path)
    steps = [x for x in lines if x.startswith(b'{"type":"step"') and b'"layers"' in x]

    def recording(n: int):
        body = [lines[0]] + [steps[k % len(steps)].replace(b'"step":', b'"step":%d,"was":' % k, 1)
                             for k in range(n)]
        return written(tmp_path, [*body, b""], f"{n}.jsonl")

    def report(path):
        assert main(["report", str(path), "--json"]) == 0

    def peak(read, path) -> int:
        tracemalloc.start()
        try:
            read(path)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    small, large = recording(6000), recording(12000)   # both over the index's 1 MiB chunks
    grows_by = {read.__name__: (peak(read, large) - peak(read, small)) / 6000 for read in (report, read_session)}
    assert grows_by["report"] < 150 < 1000 < grows_by["read_session"], grows_by
    assert '"steps": 12000,' in capsys.readouterr().out
