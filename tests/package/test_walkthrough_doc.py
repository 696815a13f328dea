"""docs/walkthrough.md shows exactly the screens docs/walkthrough.py takes, and each one is there."""

import re

from support import REPO


def test_the_walkthrough_page_shows_every_screen_the_script_takes():
    page = (REPO / "docs" / "walkthrough.md").read_text()
    script = (REPO / "docs" / "walkthrough.py").read_text()
    shown = re.findall(r"\(images/walkthrough-([\w-]+)\.svg\)", page)
    taken = re.findall(r'w\.shot\("([\w-]+)"', script)
    assert shown and sorted(shown) == sorted(taken)
    for name in shown:
        assert (REPO / "docs" / "images" / f"walkthrough-{name}.svg").is_file(), name
    assert "(docs/walkthrough.md)" in (REPO / "README.md").read_text()
