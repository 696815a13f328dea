"""The README's headless sample is what the command it names prints now.

The rule, line by line: a README line `…` stands for one or more output lines left out; every
other line equals its output line once what differs from run to run or machine to machine is
written the same way on both sides (VARYING), trailing blanks aside; in it the words are equal and
each number is within 1% of the output's (the last digits of a loss differ between CPUs' kernels).
The README shows the output whole apart from its cuts: from its first line to its last.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import DEMOS

README = Path(__file__).resolve().parents[2] / "README.md"
COMMAND = "amp-tui train demos/loss_scale_overflow.py --headless --steps 30 --at 20:dtype=bf16 --at 25:save"
CUT = "…"
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
RELATIVE_TOLERANCE = 0.01
VARYING = (
    (re.compile(r"runs/\d{8}-\d{6}-"), "runs/<time>-"),         # the run directory's name: its time
    (re.compile(r", \d+(?:\.\d+)?s\)"), ", <seconds>s)"),       # how long the checkpoint took to save
    (re.compile(r"^device( +).*$"), r"device\1<this machine>"),  # the summary's device row
)
RUN_TIMEOUT_S = 280   # an upper bound for a hung run, not a speed expectation


def readme_sample() -> list[str]:
    """The fenced block after the README's paragraph that names COMMAND."""
    text = README.read_text(encoding="utf-8")
    start = text.index("```\n", text.index(f"`{COMMAND}`")) + len("```\n")
    return text[start:text.index("```", start)].splitlines()


def normalized(line: str) -> str:
    line = line.rstrip()
    for pattern, replacement in VARYING:
        line = pattern.sub(replacement, line)
    return line


def same_line(documented: str, printed: str) -> bool:
    documented, printed = normalized(documented), normalized(printed)
    if NUMBER.split(documented) != NUMBER.split(printed):
        return False
    return all(math.isclose(float(a.replace(",", "")), float(b.replace(",", "")), rel_tol=RELATIVE_TOLERANCE)
               for a, b in zip(NUMBER.findall(documented), NUMBER.findall(printed)))


def matches(sample: list[str], output: list[str]) -> bool:
    """`sample` is `output` with runs of lines replaced by CUT, line by line the same."""
    if not sample:
        return not output
    if sample[0] == CUT:
        return any(matches(sample[1:], output[skip:]) for skip in range(1, len(output) + 1))
    return bool(output) and same_line(sample[0], output[0]) and matches(sample[1:], output[1:])


def test_the_rule_tells_a_number_a_word_and_a_cut_apart():
    output = ["step 0  gradients overflowed at scale 65536", "step 1  x", "step 2  x",
              "run dir  runs/20261203-195054-demo", "final loss  108868"]
    assert matches(["step 0  gradients overflowed at scale 65536", CUT,
                    "run dir  runs/20261130-131951-demo", "final loss  108863"], output)
    assert not matches(["step 0  gradients overflowed at scale 65536", CUT, *output[3:]],
                       output[:1] + output[3:])                          # a cut leaves out a line at least
    assert not matches(["step 0  gradients overflowed at scale 32768", CUT, "final loss  108868"], output)
    assert not matches(["step 0  gradients overflowed at scale 65536", CUT, "final loss  0.5 MB"], output)
    assert not matches(["step 0  gradients overflowed at scale 65536", CUT, "run dir  runs/20261203-195054-demo"],
                       output)                                           # down to its last line


@pytest.mark.slow
def test_the_readmes_headless_sample_is_what_its_command_prints(tmp_path):
    program, *arguments = shlex.split(COMMAND)
    assert program == "amp-tui"
    shutil.copytree(DEMOS, tmp_path / "demos")   # the command as written, its runs/ in tmp_path
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    # The kernels every x86 CPU has: fp16 overflows at the same steps on any of them.
    env["ATEN_CPU_CAPABILITY"] = "default"
    done = subprocess.run([sys.executable, "-m", "amp_tui", *arguments], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    output = done.stdout.splitlines()
    sample = readme_sample()
    assert CUT in sample and len(sample) < len(output)
    assert matches(sample, output), "README.md's sample differs from the run's output:\n" + done.stdout
