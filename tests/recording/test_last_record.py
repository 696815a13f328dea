"""`last_record`: a session's last record of a kind, read backwards a block at a time, is the one a
whole read finds, whatever the block size (lines cut across blocks, blocks shorter than a line)."""

import pytest

from amp_tui.recording.reader import last_record, read_session

from support import write_run


@pytest.mark.parametrize("block", [1, 7, 64, 1000, 1 << 20])
def test_the_last_record_of_each_kind_is_the_one_a_whole_read_finds(tmp_path, block):
    path = tmp_path / "session.jsonl"
    write_run(path)
    with open(path, "ab") as fh:   # a torn last line after the end record
        fh.write(b'{"type":"event","step":31,"kind":"no')
    session = read_session(path)
    for kind, records in (("step", session.steps), ("event", session.events), ("end", [session.end])):
        assert last_record(path, kind, block) == records[-1], kind
    assert last_record(path, "header", block) == session.header
    assert last_record(path, "nothing", block) is None
