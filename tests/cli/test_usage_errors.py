"""Usage errors: one line that names the command's --help, and exit status 2, for every command;
an `--at` step written negative is told as such."""

import pytest

from amp_tui.cli import build_parser, main
from amp_tui.cli.argv import joined_step_values

COMMANDS = sorted(build_parser().commands)


def usage_error(argv, capsys) -> str:
    """stderr of `amp-tui ARGV`, which must stop with argparse's status 2 and print nothing else."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    return err.strip()


def test_every_command_is_covered():
    assert {"train", "run", "report", "replay", "export", "plot", "compare", "ctl", "attach", "ls"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_option_is_one_line_naming_the_command_help(command, capsys):
    err = usage_error([command, "--no-such-option"], capsys)
    assert err.startswith(f"amp-tui {command}: error: ")
    assert err.endswith(f"(see amp-tui {command} --help)")
    assert "usage:" not in err


def test_no_command_names_the_top_level_help(capsys):
    assert usage_error([], capsys) == \
        "amp-tui: error: the following arguments are required: COMMAND (see amp-tui --help)"


@pytest.mark.parametrize("flags, expected", [
    (["--steps", "-1"], "argument --steps: must be a positive integer, got -1"),
    (["--steps", "ten"], "argument --steps: must be a positive integer, got 'ten'"),
    (["--dtype", "fp4"], "argument --dtype: unknown dtype 'fp4'"),
    (["--init-scale", "-4"], "argument --init-scale: must be a positive finite number, got -4"),
    (["--at", "-3:save"], "argument --at: the step must be 0 or more, got -3 in '-3:save'"),
    (["--at=-3:save"], "argument --at: the step must be 0 or more, got -3 in '-3:save'"),
    (["--at", "10:save", "--at", "-1:dtype=bf16"], "argument --at: the step must be 0 or more, got -1"),
    (["--at", "ten:save"], "argument --at: 'ten' is not a step number"),
    (["--at", "3:explode"], "argument --at: unknown action"),
])
def test_train_names_the_bad_value_in_one_line(flags, expected, tmp_path, capsys):
    run_dir = tmp_path / "run"
    err = usage_error(["train", "script.py", "--headless", "--run-dir", str(run_dir), *flags], capsys)
    assert err.startswith(f"amp-tui train: error: {expected}")
    assert err.endswith("(see amp-tui train --help)")
    assert not run_dir.exists()


def test_only_an_at_value_is_joined_to_its_option():
    assert joined_step_values(["s.py", "--at", "-3:save", "--steps", "-1", "--at", "4:save"]) == \
        ["s.py", "--at=-3:save", "--steps", "-1", "--at", "4:save"]
    # an option after --at stays an option (argparse says --at lacks its value)
    assert joined_step_values(["--at", "--headless"]) == ["--at", "--headless"]
