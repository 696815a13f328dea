"""`r`: pick one of the run's checkpoints (newest first) or type the path of any .safetensors."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from amp_tui.core.precision import short_name
from amp_tui.ui.text import literal


def checkpoint_label(info, run_dir: Path | None) -> Text:
    text = Text()
    if info.step is not None:
        text.append(f"step {info.step:>7}", style="bold")
        text.append(f"  {short_name(info.dtype):<5}")
    else:
        text.append(f"{'weights only':<12}  {'':<5}", style="bold")
    path = Path(info.path)
    if run_dir is not None:
        try:
            path = path.relative_to(run_dir)
        except ValueError:
            pass
    text.append("  ")
    text.append_text(literal(str(path), "dim"))
    return text


def check_path(text: str, run_dir: Path | None) -> Path:
    """The file a typed path names (relative to the run directory when not found here)."""
    raw = text.strip()
    if not raw:
        raise ValueError("type the path of a .safetensors file")
    path = Path(raw).expanduser()
    if not path.is_absolute() and not path.exists() and run_dir is not None and (run_dir / path).exists():
        path = run_dir / path
    if path.suffix != ".safetensors":
        raise ValueError(f"{raw} is not a .safetensors file")
    if not path.is_file():
        raise ValueError(f"{raw}: no such file")
    return path


class RestoreDialog(ModalScreen[str | None]):
    DEFAULT_CSS = """
    RestoreDialog {
        align: center middle;
    }
    RestoreDialog > Vertical {
        width: 90;
        height: auto;
        max-height: 90%;
        border: thick $primary;
        background: $surface;
        padding: 1 2;
    }
    RestoreDialog .title {
        text-style: bold;
        margin-bottom: 1;
    }
    RestoreDialog OptionList {
        height: auto;
        max-height: 12;
        margin-bottom: 1;
    }
    RestoreDialog #restore-error {
        color: $error;
        height: auto;
    }
    RestoreDialog .hint {
        color: $text-muted;
        margin-top: 1;
    }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel", id="restore.cancel")]

    def __init__(self, checkpoints: list, run_dir: Path | None) -> None:
        super().__init__()
        self.checkpoints = checkpoints
        self.run_dir = run_dir

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Restore a checkpoint", classes="title")
            if self.checkpoints:
                yield OptionList(*[Option(checkpoint_label(c, self.run_dir), id=str(i))
                                   for i, c in enumerate(self.checkpoints)], id="checkpoints")
            else:
                yield Static(Text("This run has no checkpoint yet (c saves one).", style="italic"))
            yield Label("or the path of any .safetensors file:")
            yield Input(placeholder="path/to/checkpoint.safetensors", id="restore-path")
            yield Static("", id="restore-error")
            yield Static("Enter restores  ·  Tab switches  ·  Esc cancels", classes="hint")

    def on_mount(self) -> None:
        if self.checkpoints:
            options = self.query_one(OptionList)
            options.highlighted = 0
            options.focus()
        else:
            self.query_one(Input).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(str(self.checkpoints[int(event.option.id)].path))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            path = check_path(event.value, self.run_dir)
        except ValueError as exc:
            self.query_one("#restore-error", Static).update(literal(exc))
            return
        self.dismiss(str(path))

    def action_cancel(self) -> None:
        self.dismiss(None)
