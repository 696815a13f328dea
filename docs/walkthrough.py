"""Walk through every demo in a real terminal (tmux), as a new user would, and save the key screens.

    python docs/walkthrough.py                      # every walk, SVGs into docs/images/
    python docs/walkthrough.py --only attention     # one walk (names: see WALKS)
    python docs/walkthrough.py --text /tmp/screens  # also keep each screen as plain text

Each walk starts `amp-tui` in a private tmux server at a fixed 160x48, presses the keys a user
would, waits on what the screen (or the run's session) says rather than on a fixed time, and turns
the chosen screens into SVGs with Rich (`docs/images/walkthrough-*.svg`, shown in
docs/walkthrough.md). The runs are recorded in a scratch directory that holds a link to `demos/`,
so the screens show `demos/…` paths, as they would from a checkout. Needs tmux; several minutes on
a laptop's CPU (the fp16 demos are slow there).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.text import Text

REPO = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 160, 48


class Walk:
    """One tmux terminal running one command, and the screens taken of it."""

    def __init__(self, workdir: Path, images: Path, text_dir: Path | None):
        self.workdir = workdir
        self.images = images
        self.text_dir = text_dir
        self.started = 0
        self.server = self.server_named(0)
        self.target = "walk:0.0"

    @staticmethod
    def server_named(number: int) -> list[str]:
        return ["tmux", "-L", f"amp-tui-walk-{os.getpid()}-{number}", "-f", os.devnull]

    def tmux(self, *args: str) -> str:
        return subprocess.run([*self.server, *args], check=True, capture_output=True,
                              text=True, timeout=10).stdout

    def start(self, command: str) -> None:
        self.close()
        self.started += 1     # a fresh server each time: the last one may still be going away
        self.server = self.server_named(self.started)
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               "TERM": "xterm-256color", "COLORTERM": "truecolor"}
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        shell = f"cd {shlex.quote(str(self.workdir))} && export {exports} && {command}"
        # One tmux command line, so the size holds from the start (no client ever attaches).
        self.tmux("new-session", "-d", "-s", "walk", "-x", str(WIDTH), "-y", str(HEIGHT),
                  "bash", "-c", shell, ";",
                  "set-option", "-g", "window-size", "manual", ";",
                  "set-option", "-g", "remain-on-exit", "on", ";",
                  "resize-window", "-t", "walk", "-x", str(WIDTH), "-y", str(HEIGHT))

    def press(self, *keys: str) -> None:
        # One key at a time: Escape straight before another key reads as Alt+that key.
        for key in keys:
            self.tmux("send-keys", "-t", self.target, key)
            time.sleep(0.5)

    def screen(self, colours: bool = False) -> str:
        return self.tmux("capture-pane", "-p", *(["-e"] if colours else []), "-t", self.target)

    def dead(self) -> bool:
        return self.tmux("display-message", "-p", "-t", self.target, "#{pane_dead}").strip() == "1"

    def wait(self, what: str | Callable[[str], bool], timeout: float = 120.0) -> str:
        """Wait until the screen shows `what` (text, or a test of the screen's text)."""
        test = (lambda s: what in s) if isinstance(what, str) else what
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if test(screen):
                return screen
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:g}s for {what!r}; the screen:\n{screen}")
            time.sleep(0.2)

    def settle(self, seconds: float = 1.0) -> None:
        """Let the dashboard redraw after a key (its refresh is a few times a second)."""
        time.sleep(seconds)

    def shot(self, name: str, title: str) -> Path:
        captured = self.screen(colours=True)
        if self.text_dir is not None:
            self.text_dir.mkdir(parents=True, exist_ok=True)
            (self.text_dir / f"{name}.txt").write_text(self.screen())
        console = Console(record=True, width=WIDTH, file=open(os.devnull, "w"),
                          force_terminal=True, color_system="truecolor")
        lines = captured.rstrip("\n").split("\n")[:HEIGHT]
        console.print(Text("\n").join(Text.from_ansi(line) for line in lines), crop=True,
                      overflow="crop", no_wrap=True)
        path = self.images / f"walkthrough-{name}.svg"
        console.save_svg(str(path), title=title)
        print(f"  {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
        return path

    def newest_run(self) -> Path:
        runs = sorted((self.workdir / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        return runs[-1]

    def amp_tui(self, *args: str) -> str:
        done = subprocess.run(["amp-tui", *args], cwd=self.workdir, capture_output=True,
                              text=True, timeout=120)
        return done.stdout + done.stderr

    def close(self) -> None:
        subprocess.run([*self.server, "kill-server"], capture_output=True, timeout=10)


def status_line(screen: str) -> str:
    return screen.split("\n", 2)[1] if screen.count("\n") >= 2 else ""


def figure_shown(screen: str, name: str) -> int:
    """A whole number the status bar shows after `name` (`skipped 5`); -1 when none."""
    words = status_line(screen).split()
    for word, value in zip(words, words[1:]):
        if word == name and value.isdigit():
            return int(value)
    return -1


def step_shown(screen: str) -> int:
    """The step in the status bar (`step 531` or `step 9/2000`); -1 before there is one."""
    words = status_line(screen).split()
    if len(words) < 2 or words[0] != "step":
        return -1
    number = words[1].split("/")[0]
    return int(number) if number.isdigit() else -1


def fix_answered(screen: str) -> bool:
    """The run's answer to `f` is on screen: the fix applied (`now in fp32`, `fp16 → bf16`)."""
    return "now in fp32" in screen or "fp16 → bf16" in screen


def healthy(w: Walk) -> None:
    w.start("amp-tui train demos/healthy.py")
    w.wait(lambda s: "RUNNING" in s and step_shown(s) >= 300)
    w.settle(3)
    w.shot("healthy-running", "amp-tui train demos/healthy.py")
    w.press("?")
    w.wait("amp-tui keys")
    w.shot("healthy-help", "amp-tui train demos/healthy.py: ? (help)")
    w.press("Escape", "Space")
    w.wait("PAUSED")
    w.press("f")
    w.wait("fix refused")
    w.press("c")
    w.wait("checkpoint saved")
    w.press("r")
    w.wait("Restore a checkpoint")
    w.settle()
    w.shot("healthy-restore", "amp-tui train demos/healthy.py: paused, c (save), r (restore)")
    w.press("Escape", "q")
    w.wait(lambda s: "refused commands" in s or w.dead(), timeout=60)
    w.settle(2)
    w.shot("healthy-summary", "amp-tui train demos/healthy.py: q (the summary)")


def activation(w: Walk) -> None:
    w.start("amp-tui train demos/activation_overflow.py --dtype fp16 --steps 200")
    w.wait("PAUSED")
    w.settle(3)
    w.shot("activation-paused", "amp-tui train demos/activation_overflow.py --dtype fp16")
    w.press("f")
    w.wait(fix_answered)
    w.press("Space")
    w.wait("RUNNING")
    w.settle(4)
    w.shot("activation-fixed", "amp-tui train demos/activation_overflow.py: f (apply the fix), space")
    w.press("q")
    w.wait(lambda s: "final dtype" in s, timeout=60)


def loss_scale(w: Walk) -> None:
    w.start("amp-tui train demos/loss_scale_overflow.py --dtype fp16 --steps 20000")
    w.wait(lambda s: figure_shown(s, "skipped") >= 5)
    w.press("Space")
    w.wait("PAUSED")
    w.settle(3)
    w.shot("loss-scale-paused", "amp-tui train demos/loss_scale_overflow.py --dtype fp16: space (pause)")
    w.press("f")
    w.wait(lambda s: fix_answered(s) or "fix refused" in s)
    w.press("Space")
    w.wait("RUNNING")
    w.settle(5)
    w.shot("loss-scale-fixed", "amp-tui train demos/loss_scale_overflow.py: f (apply the fix), space")
    w.press("q")
    w.wait(lambda s: "final dtype" in s, timeout=60)


def attention(w: Walk) -> None:
    w.start("amp-tui train demos/attention_overflow.py --dtype fp16 --steps 200")
    w.wait("PAUSED")
    w.settle(3)
    w.shot("attention-paused", "amp-tui train demos/attention_overflow.py --dtype fp16")
    w.press("f")
    w.wait(fix_answered)
    w.settle(2)
    w.shot("attention-fix-applied", "amp-tui train demos/attention_overflow.py: f (apply the fix)")
    w.press("f")
    w.wait("refused")
    w.press("x", "Space")
    w.wait("X-ray of step")
    w.settle()
    w.shot("attention-xray", "amp-tui train demos/attention_overflow.py: x (X-ray), space (resume)")
    w.press("Escape", "q")
    w.wait(lambda s: "final dtype" in s, timeout=60)
    w.settle(2)
    w.shot("attention-summary", "amp-tui train demos/attention_overflow.py: q (the summary)")


def bf16_pretrained(w: Walk) -> None:
    w.start("amp-tui train demos/bf16_pretrained.py --dtype fp16 --steps 20000")
    w.wait(lambda s: "scale 0." in status_line(s))
    w.press("Space")
    w.wait("PAUSED")
    w.settle(3)
    w.shot("bf16-pretrained-paused", "amp-tui train demos/bf16_pretrained.py --dtype fp16: space (pause)")
    w.press("f")
    w.wait(lambda s: fix_answered(s) or "fix refused" in s)
    w.press("Space")
    w.wait("RUNNING")
    w.settle(5)
    w.shot("bf16-pretrained-fixed", "amp-tui train demos/bf16_pretrained.py: f (apply the fix), space")
    w.press("q")
    w.wait(lambda s: "final dtype" in s, timeout=60)


def own_loop(w: Walk) -> None:
    w.start("amp-tui run -- python demos/own_loop.py --epochs 100")
    w.wait("reached its floor")   # the loop's GradScaler, halved on every skip, held at the floor
    w.settle(2)
    w.shot("own-loop-overflow", "amp-tui run -- python demos/own_loop.py")
    w.press("d")
    w.wait(lambda s: "bf16" in s.split("\n", 1)[0])
    w.settle(5)
    w.shot("own-loop-bf16", "amp-tui run -- python demos/own_loop.py: d (bf16)")
    w.press("q")
    w.wait(lambda s: w.dead(), timeout=90)


def replay(w: Walk) -> None:
    runs = [p for p in (w.workdir / "runs").glob("*attention_overflow*")]
    if not runs:
        attention(w)
        runs = [p for p in (w.workdir / "runs").glob("*attention_overflow*")]
    run = max(runs, key=lambda p: p.stat().st_mtime)
    w.start(f"amp-tui replay runs/{run.name}")
    w.wait("replay (read-only)")
    w.settle(3)
    w.shot("replay", f"amp-tui replay runs/{run.name}")
    w.press("f")
    w.settle(2)
    w.shot("replay-f", f"amp-tui replay runs/{run.name}: f")
    w.press("q")


WALKS = {"healthy": healthy, "activation": activation, "loss-scale": loss_scale,
         "attention": attention, "bf16-pretrained": bf16_pretrained, "own-loop": own_loop,
         "replay": replay}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(WALKS), help="the walks to take")
    parser.add_argument("--images", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--text", type=Path, help="also write each screen as text here")
    parser.add_argument("--workdir", type=Path, help="where the runs are recorded (a scratch one)")
    args = parser.parse_args()
    if shutil.which("tmux") is None or shutil.which("amp-tui") is None:
        parser.error("needs tmux and amp-tui on the PATH")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="amp-tui-walk-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "demos").exists():
        (workdir / "demos").symlink_to(REPO / "demos")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    walk = Walk(workdir, args.images, args.text)
    try:
        for name in args.only or WALKS:
            print(f"{name}:", flush=True)
            WALKS[name](walk)
    finally:
        walk.close()
    print(f"runs recorded in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
