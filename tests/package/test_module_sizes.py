"""No module in the package grows past 500 lines: a module that long holds more than one concern
(the run controller, the monitor and the distributed code were each split when they had)."""

from pathlib import Path

import amp_tui

LIMIT = 500


def test_no_module_is_over_the_line_limit():
    root = Path(amp_tui.__file__).parent
    too_long = {str(path.relative_to(root)): n for path in sorted(root.rglob("*.py"))
                if (n := len(path.read_text(encoding="utf-8").splitlines())) > LIMIT}
    assert not too_long, f"modules over {LIMIT} lines (split them by concern): {too_long}"
