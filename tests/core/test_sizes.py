"""Sizes for people: a small checkpoint is not "0.0 MB"."""

import re

from amp_tui.cli import main
from amp_tui.core.numfmt import byte_size
from amp_tui.recording.reader import read_session


def test_byte_size_picks_the_unit_that_keeps_three_digits():
    assert byte_size(0) == "0 B"
    assert byte_size(999) == "999 B"
    assert byte_size(1_500) == "1.5 kB"
    assert byte_size(48_213) == "48.2 kB"
    assert byte_size(999_499) == "999 kB"
    assert byte_size(999_500) == "1 MB"     # not "1e+03 kB"
    assert byte_size(3_140_000) == "3.14 MB"
    assert byte_size(2_500_000_000) == "2.5 GB"


def test_a_small_checkpoint_is_announced_in_a_unit_that_shows_its_size(mlp_script, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", str(mlp_script), "--headless", "--steps", "2", "--run-dir", str(run_dir),
                 "--checkpoint-every", "2"]) == 0
    saved = [e for e in read_session(run_dir).events if e["kind"] == "checkpoint_saved"]
    assert saved and saved[0]["bytes"] < 50_000, "the model must be small enough for the old 0.0 MB"
    size = re.search(r"\((\S+ \S*B),", saved[0]["message"]).group(1)
    assert size == byte_size(saved[0]["bytes"]) and not size.startswith("0.0")
