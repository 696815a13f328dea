"""A seeded mutation fuzz of every reader of a recording.

Three real sessions (`amp-tui train` on a demo, a loop of one's own under `amp_tui.monitor`, two
ranks) are damaged in the ways a disk, a copy or a hostile hand damages a file: bit flips,
truncation, garbage lines, duplicated and swapped lines, huge and non-finite numbers, deep nesting,
bad UTF-8, a changed header version, a field of the wrong type. Each damaged copy goes through
every reader's command, in-process: `report` (plain, `--json`, `--as-at`), `replay --headless`,
`ls`, `export` (CSV, and TensorBoard) and `plot`.

A reader may read what it can (exit 0) or refuse the file with one line on stderr (exit 1); any
exception, any other status, a message over more than one line, or a `--json` output that a
strict parser refuses is a failure, reported with its seed, its mutations and the damaged file,
kept in the test's temporary folder to run the reader on again.

AMP_TUI_FUZZ_FILES sets how many damaged files (CI runs FUZZ_FILES); AMP_TUI_FUZZ_SEED where the
sequence starts (the mutations of a seed are the same on any machine; the base sessions differ
in their times).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re
import shutil
import time
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from amp_tui.cli import main

from support import DEMOS, MLP_SCRIPT, monitored_loop, train_ranks

# The suite's run: every mutation lands on each base session several times (checked below); a
# long run of its own, AMP_TUI_FUZZ_FILES=5000, draws many more.
FUZZ_FILES = int(os.environ.get("AMP_TUI_FUZZ_FILES", "160"))
FUZZ_SEED = int(os.environ.get("AMP_TUI_FUZZ_SEED", "0"))
# Drawing a figure costs far more than reading the file: in the short run every PLOT_EVERY-th
# damaged file is drawn too (every file in a long run of its own, AMP_TUI_FUZZ_PLOT_EVERY=1).
PLOT_EVERY = int(os.environ.get("AMP_TUI_FUZZ_PLOT_EVERY", "10"))
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

pytestmark = [pytest.mark.slow, pytest.mark.ranks]   # the base sessions include a run of 2 ranks


# ---- the base sessions --------------------------------------------------------------------------

def record_base_sessions(root: Path) -> dict[str, bytes]:
    """The bytes of three real recordings, made under `root`."""
    demo = root / "train"
    # Skips, an intervention of each kind the session records and a checkpoint: the events the
    # readers draw, list and count.
    assert main(["train", str(DEMOS / "loss_scale_overflow.py"), "--headless", "--steps", "10",
                 "--run-dir", str(demo), "--at", "4:scale=1024", "--at", "5:save",
                 "--at", "6:note=a note", "--at", "7:dtype=bf16"]) == 0
    monitored_loop(root / "monitor", 8, probe_every=1, bad_step=3, plan={5: "note=from the loop"})
    script = root / "mlp.py"
    script.write_text(MLP_SCRIPT, encoding="utf-8")
    done = train_ranks(script, root / "ranks", "--steps", "6")
    assert done.returncode == 0, done.stdout + done.stderr
    return {name: (root / name / "session.jsonl").read_bytes() for name in ("train", "monitor", "ranks")}


@pytest.fixture(scope="module")
def base_sessions(tmp_path_factory) -> dict[str, bytes]:
    return record_base_sessions(tmp_path_factory.mktemp("fuzz-bases"))


# ---- the mutations ------------------------------------------------------------------------------

NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
ODD_NUMBERS = (b"1e400", b"-1e400", b"1e308", b"-1.7976931348623157e308", b"1e-400", b"4.9e-324",
               b"9" * 400, b"-" + b"9" * 40, b"1" * 5000, b"NaN", b"Infinity", b"-Infinity",
               b'"NaN"', b'"Infinity"', b'"-Infinity"', b"-0.0", b"-1", b"0", b"2e19", b"1e16")
BAD_UTF8 = (b"\xff", b"\xfe\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\x80\x80", b"\x00", b"\xc0\xaf")
GARBAGE = (b"{", b"}", b"[]", b"null", b'"text"', b"0", b'{"type":"step"}', b'{"type":"event"}',
           b'{"type":"end"}', b'{"type":"header"}', b'{"type":"unknown","step":3}', b'{"type":7}',
           b'{"type":"step","step":"3"}', b'{"type":"event","step":2,"kind":null}',
           b'{"type":"step","step":-5,"loss":1,"scale":1,"skipped":false}',
           b'{"type":"event","step":1e400,"kind":"note","message":"x"}',
           b'{"type":"event","step":2,"kind":"note","message":"\\ud800 \\udfff"}')
WRONG_TYPES = (None, True, False, 0, -1, 1.5, 2 ** 70, 1e308, "", "x", "NaN", "-Infinity", "\ud800",
               "[red]markup[/]", [], [None], ["x"], {}, {"a": 1})
VERSIONS = (b"0", b"2", b"-1", b'"1"', b"1.0", b"null", b"true", b"1e400", b"9" * 30, b"[]", b"{}")


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def bit_flips(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def truncation(data: bytes, rng: random.Random) -> bytes:
    return data[:rng.randrange(len(data) + 1)]


def garbage_lines(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    for _ in range(rng.randint(1, 3)):
        line = rng.choice(GARBAGE) if rng.random() < 0.6 else rng.randbytes(rng.randint(1, 80))
        lines.insert(rng.randrange(len(lines) + 1), line)
    return b"\n".join(lines)


def duplicated_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    lines.insert(rng.randrange(len(lines) + 1), rng.choice(lines))
    return b"\n".join(lines)


def swapped_lines(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines)


def _replace_a_number(data: bytes, rng: random.Random, by: bytes) -> bytes:
    lines = _lines(data)
    i = rng.randrange(len(lines))
    found = list(NUMBER.finditer(lines[i]))
    if not found:
        return data
    m = rng.choice(found)
    lines[i] = lines[i][:m.start()] + by + lines[i][m.end():]
    return b"\n".join(lines)


def odd_numbers(data: bytes, rng: random.Random) -> bytes:
    for _ in range(rng.randint(1, 4)):
        data = _replace_a_number(data, rng, rng.choice(ODD_NUMBERS))
    return data


def deep_nesting(data: bytes, rng: random.Random) -> bytes:
    depth = rng.choice((40, 990, 1100, 5000, 100_000))
    deep = b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth
    return _replace_a_number(data, rng, deep)


def bad_utf8(data: bytes, rng: random.Random) -> bytes:
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(data) + 1)
        data = data[:i] + rng.choice(BAD_UTF8) + data[i:]
    return data


def header_version(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    choice = rng.random()
    if choice < 0.6:
        lines[0] = re.sub(rb'"version":\s*[^,}]*', b'"version":' + rng.choice(VERSIONS), lines[0])
    elif choice < 0.75:
        lines[0] = lines[0].replace(b'"amp-tui-session"', rng.choice((b'"amp-tui"', b"null", b"1")))
    elif choice < 0.9:
        del lines[0]
    else:
        lines.insert(rng.randrange(1, len(lines) + 1), lines.pop(0))
    return b"\n".join(lines)


def _paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:20]):
            yield from _paths(item, (*path, i))


def wrong_type(data: bytes, rng: random.Random) -> bytes:
    """A field (anywhere in a record, the per-layer arrays included) given a value of another type."""
    lines = _lines(data)
    i = rng.randrange(len(lines))
    try:
        record = json.loads(lines[i])
        paths = [p for p in _paths(record) if p and p != ("type",)]
    except (ValueError, RecursionError):   # a line an earlier mutation damaged or nested deep
        return data
    if not paths:
        return data
    *parent, last = rng.choice(paths)
    holder = record
    for key in parent:
        holder = holder[key]
    holder[last] = rng.choice(WRONG_TYPES)
    lines[i] = json.dumps(record).encode()
    return b"\n".join(lines)


MUTATIONS = (bit_flips, truncation, garbage_lines, duplicated_line, swapped_lines, odd_numbers,
             deep_nesting, bad_utf8, header_version, wrong_type)


def damaged(bases: dict[str, bytes], seed: int) -> tuple[str, list[str], bytes]:
    """The base and the mutations of case `seed`, and the damaged bytes: the same for a seed on
    any machine."""
    rng = random.Random(seed)
    base = rng.choice(sorted(bases))
    data = bases[base]
    names = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        mutation = rng.choice(MUTATIONS)
        data = mutation(data, rng)
        names.append(mutation.__name__)
    return base, names, data


# ---- the readers --------------------------------------------------------------------------------

def _reject_constant(token):
    raise ValueError(f"non-standard JSON token {token}")


def reader_commands(run_dir: Path, out: Path, plot: bool) -> list[tuple[list[str], bool]]:
    """(argv, whether stdout is JSON) for each reader."""
    run = str(run_dir)
    commands = [
        (["report", run], False),
        (["report", run, "--json"], True),
        (["report", run, "--as-at"], False),
        (["report", run, "--as-at", "--json"], True),
        (["replay", run, "--headless"], False),
        (["ls", str(run_dir.parent)], False),
        (["export", run, "--csv", str(out / "steps.csv"), "--layers-csv", str(out / "layers.csv"),
          "--forecasts-csv", str(out / "forecasts.csv")]
         + (["--tensorboard", str(out / "tb")] if HAS_TENSORBOARD else []), False),
    ]
    if plot and HAS_MATPLOTLIB:
        commands.append((["plot", run, "-o", str(out / "run.png")], False))
    return commands


def check_reader(argv: list[str], json_out: bool) -> str | None:
    """What went wrong when `amp-tui ARGV` read the file, or None: it read it (0) or refused it in
    one line (1)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(stdout), redirect_stderr(stderr):
            status = main(argv)
    # SystemExit too; not what stops the test itself (Ctrl+C, pytest's timeout): BaseException.
    except (Exception, SystemExit):  # noqa: BLE001 -- every exception is what this test looks for
        return traceback.format_exc()
    err = stderr.getvalue()
    for name, text in (("stdout", stdout.getvalue()), ("stderr", err)):
        try:
            text.encode("utf-8")   # what a pipe or a terminal takes: a lone surrogate raises there
        except UnicodeEncodeError as exc:
            return f"{name} is not text a terminal takes: {exc}"
    if status == 1:
        lines = err.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("amp-tui: error: "):
            return f"exit 1 with stderr {err!r}"
        return None
    if status != 0:
        return f"exit {status!r} with stderr {err[-2000:]!r}"
    if json_out:
        try:
            json.loads(stdout.getvalue(), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            return f"--json printed what a strict parser refuses ({exc}): {stdout.getvalue()[:300]!r}"
    return None


# The suite's bound, grown with a long run: a second a file is several times what a loaded machine takes.
@pytest.mark.timeout(max(1200, FUZZ_FILES))
def test_every_reader_reads_or_refuses_every_damaged_session(base_sessions, tmp_path):
    """FUZZ_FILES damaged copies, each through every reader: 0 crashes."""
    for present, reader, package in ((HAS_TENSORBOARD, "export --tensorboard", "tensorboard"),
                                     (HAS_MATPLOTLIB, "plot", "matplotlib")):
        if not present:
            warnings.warn(f"{reader} is not fuzzed: the {package} package is not installed", stacklevel=1)
    started = time.monotonic()
    failures = []
    drawn: dict[tuple[str, str], int] = {}
    for seed in range(FUZZ_SEED, FUZZ_SEED + FUZZ_FILES):
        base, mutations, data = damaged(base_sessions, seed)
        for name in mutations:
            drawn[base, name] = drawn.get((base, name), 0) + 1
        case = tmp_path / "case"
        run_dir = case / "runs" / "run"
        run_dir.mkdir(parents=True)
        (run_dir / "session.jsonl").write_bytes(data)
        for argv, json_out in reader_commands(run_dir, case, plot=seed % PLOT_EVERY == 0):
            problem = check_reader(argv, json_out)
            if problem is not None:
                kept = tmp_path / f"damaged-{seed}.jsonl"
                kept.write_bytes(data)
                failures.append(f"seed {seed} ({base}: {', '.join(mutations)}, kept in {kept}) "
                                f"amp-tui {' '.join(argv[:1] + argv[2:])}:\n{problem}")
        shutil.rmtree(case)
    elapsed = time.monotonic() - started
    print(f"reader fuzz: {FUZZ_FILES} damaged files from seed {FUZZ_SEED}, {len(failures)} failures, "
          f"{elapsed:.1f} s")
    assert not failures, f"{len(failures)} failures; the first ones:\n\n" + "\n\n".join(failures[:5])
    if FUZZ_FILES >= 160:
        rare = [(b, m.__name__) for b in base_sessions for m in MUTATIONS if drawn.get((b, m.__name__), 0) < 3]
        assert not rare, f"mutations drawn fewer than 3 times on a base: {rare}"


def test_the_mutations_are_the_same_for_a_seed_and_damage_the_file(base_sessions):
    """A seed's mutations are the same every time; and every mutation changes the bytes it is given
    (a fuzz whose mutations did nothing would find nothing)."""
    assert damaged(base_sessions, 7) == damaged(base_sessions, 7)
    data = base_sessions["train"]
    for mutation in MUTATIONS:
        assert any(mutation(data, random.Random(seed)) != data for seed in range(20)), mutation.__name__


def test_a_header_still_being_written_is_said_to_be_so_not_called_foreign(tmp_path):
    """A reader that comes as a run starts may find the header's first bytes without its newline:
    that is a run starting (SessionStarting), not a file that is no session."""
    from amp_tui.recording.format import SessionStarting
    from amp_tui.recording.reader import read_session
    path = tmp_path / "session.jsonl"
    from amp_tui.recording.index import SessionIndex
    from amp_tui.recording.report import read_digest
    for written, said in ((b"", "is empty: a run that has just started"),   # created, not yet written
                          (b'{"type":"header","format":"amp-tui-se', "no complete header yet")):
        path.write_bytes(written)
        for read in (read_session, read_digest, SessionIndex):   # the report and the replay alike
            with pytest.raises(SessionStarting, match=said):
                read(path)
