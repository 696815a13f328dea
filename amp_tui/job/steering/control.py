"""The control channel: a Unix domain socket through which other terminals steer a running job.

Owner-only by construction: the socket is created 0600 inside a 0700 folder, the server checks each
peer's uid with SO_PEERCRED, and the client refuses a socket whose owner or permission bits are
wrong. No network port is ever opened.

Protocol: one JSON object per line. The client sends {"command": "dtype=bf16"} (any `--at` action,
or "status"); the server answers {"ok": bool, "message": str, ...} once the job has applied or
refused the command at its next step boundary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import socket
import stat
import struct
import threading
from pathlib import Path

from amp_tui.core.commands import CommandError, Outcome, parse_action
from amp_tui.core.precision import short_name
from amp_tui.core.text import plural
from amp_tui.job.run_context import RunContext

SOCKET_NAME = "control.sock"
POINTER_NAME = "control.path"   # holds the socket's path when it had to live elsewhere
MAX_SOCKET_PATH = 100           # AF_UNIX paths are limited to ~108 bytes
REPLY_TIMEOUT = 60.0
JOIN_TIMEOUT = 10.0             # an upper bound: our threads end as soon as close() wakes them


class ControlError(Exception):
    """Why a command could not reach the job; worded for the user."""


def _runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "amp-tui" if base else Path("/tmp") / f"amp-tui-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.lstat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077 or not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"{folder} is not a private folder of this user; refusing to use it")
    return folder


def socket_path(run_dir: Path) -> Path:
    """Where the job's socket lives: in the run dir, or a per-user runtime dir if the path is long."""
    pointer = Path(run_dir) / POINTER_NAME
    if pointer.is_file():
        return Path(pointer.read_text(encoding="utf-8").strip())
    return Path(run_dir) / SOCKET_NAME


def check_socket_permissions(path: Path) -> None:
    """Refuse a socket that isn't ours alone: another owner, or group/other permission bits."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise ControlError(f"no job is running there (no control socket at {path})") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlError(f"{path} is not a socket")
    if st.st_uid != os.getuid():
        raise ControlError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): refused")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ControlError(f"{path} is accessible to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                           "refused: only an owner-only (0600) socket is trusted")


def _peer(conn: socket.socket) -> dict:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return {"pid": pid, "uid": uid, "user": user}


class ControlServer:
    """Serves a Run's control socket on background threads until `close()`, which joins them.

    No thread of ours may outlive the run: each one references the Run, so the last to end frees
    its model and tensors. Freed on a thread while the interpreter shuts down, torch's tensor
    teardown gives up the GIL, and Python ends that thread inside C++ code: the process aborts
    ("terminate called without an active exception", exit 134) after a clean finish.
    """

    def __init__(self, run: RunContext, run_dir: Path):
        self.run = run
        self.run_dir = Path(run_dir)
        self.path = self._choose_path()
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._handlers: set[threading.Thread] = set()
        self._connections: set[socket.socket] = set()
        self._waiting: list[tuple[threading.Event, list]] = []  # commands not yet applied

    def _choose_path(self) -> Path:
        inside = self.run_dir / SOCKET_NAME
        if len(str(inside.resolve())) <= MAX_SOCKET_PATH:
            return inside
        digest = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]
        return _runtime_dir() / f"{digest}.sock"

    def start(self) -> None:
        self._remove_stale()
        os.chmod(self.run_dir, 0o700)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(8)
        sock.settimeout(0.5)
        self._sock = sock
        if self.path.parent != self.run_dir:
            (self.run_dir / POINTER_NAME).write_text(str(self.path), encoding="utf-8")
        self._thread = threading.Thread(target=self._serve, name="amp-tui-control", daemon=True)
        self._thread.start()

    def _remove_stale(self) -> None:
        if not self.path.exists():
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink(missing_ok=True)  # a killed job's socket: nobody listens
            return
        finally:
            probe.close()
        raise ControlError(f"another job is already running in {self.run_dir}")

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                handler = threading.Thread(target=self._handle, args=(conn,), name="amp-tui-control-client",
                                           daemon=True)
                self._handlers.add(handler)
                self._connections.add(conn)
            handler.start()

    def _wake_accept(self) -> None:
        """Connect to ourselves: the accept() returns at once and the loop sees it is closed
        (shutdown() does not wake an accept() on a Unix socket)."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)  # a full backlog: the accept() ends on its own timeout anyway
        with contextlib.suppress(OSError):
            probe.connect(str(self.path))
        probe.close()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._converse(conn)
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._handlers.discard(threading.current_thread())

    def _converse(self, conn: socket.socket) -> None:
        with conn:
            try:
                peer = _peer(conn)
                if peer["uid"] != os.getuid():
                    self._reply(conn, {"ok": False, "message": "refused: not the job's owner"})
                    return
                conn.settimeout(10)
                line = conn.makefile("r", encoding="utf-8").readline(65536)
                if not line and self._closed.is_set():
                    self._reply(conn, {"ok": False, "message": "the run has ended"})
                    return
                request = json.loads(line)
                text = str(request.get("command", "")).strip()
                self._reply(conn, self.answer(text, peer))
            except (OSError, ValueError, AttributeError) as exc:
                with contextlib.suppress(OSError):
                    self._reply(conn, {"ok": False, "message": f"bad request: {exc}"})

    def answer(self, text: str, peer: dict) -> dict:
        if text == "status":
            status = self.run.status()
            return {"ok": True, "message": status_text(status), "status": status}
        try:
            command = parse_action(text, source=f"ctl pid={peer['pid']} user={peer['user']}")
        except CommandError as exc:
            return {"ok": False, "message": str(exc)}
        command.client = peer
        done = threading.Event()
        outcome: list = []
        command.on_done = lambda o: (outcome.append(o), done.set())
        with self._lock:
            if self._closed.is_set():
                return {"ok": False, "message": "the run has ended"}
            self._waiting.append((done, outcome))
        try:
            self.run.submit(command)
            if not done.wait(REPLY_TIMEOUT):
                return {"ok": False, "message": f"no answer within {REPLY_TIMEOUT:.0f}s (is a step hanging?)"}
        finally:
            with self._lock:
                self._waiting.remove((done, outcome))
        return {"ok": outcome[0].ok, "message": outcome[0].message}

    @staticmethod
    def _reply(conn: socket.socket, payload: dict) -> None:
        conn.sendall((json.dumps(payload, allow_nan=False) + "\n").encode("utf-8"))

    def close(self) -> None:
        """Stop serving, answer the commands the run will never apply, and join every thread."""
        with self._lock:
            self._closed.set()
            waiting, connections = list(self._waiting), list(self._connections)
        for done, outcome in waiting:
            if not done.is_set():
                outcome.append(Outcome(False, "the run ended before applying it"))
                done.set()
        for conn in connections:  # a client that connected but sent nothing: wake its read
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        if self._sock is not None:
            self._wake_accept()
        with self._lock:
            threads = [self._thread, *self._handlers]
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(JOIN_TIMEOUT)
        self._thread = None
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()   # only now: no thread is left polling its descriptor
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            (self.run_dir / POINTER_NAME).unlink()


def status_text(status: dict) -> str:
    """A job's `status` as one line: "running at step 12/100: fp16, scale 65536, ..."."""
    scale = "-" if status["scale"] is None else f"{status['scale']:g}"
    total = f"/{status['steps']}" if status["steps"] else ""
    return (f"{status['state']} at step {status['step']}{total}: {short_name(status['dtype'])}, "
            f"scale {scale}, {plural(status['updates'], 'update')} applied, {status['skipped']} skipped, "
            f"loss {status['loss']}{probes_text(status.get('probes'))}")


def probes_text(probes: list | None) -> str:
    """The probe schedule in `status`'s line: ", probes auto 1/9 (0.8% of the time)"."""
    if not probes:
        return ""
    if probes[0] == "auto":
        return f", probes auto 1/{probes[1]} ({probes[2]:g}% of the time)"
    if probes[0] == "every":
        return f", probes every step ({probes[1]})"
    return f", probes every {probes[1]} steps"


def send(run_dir: Path, text: str, *, timeout: float = REPLY_TIMEOUT + 5) -> dict:
    """Send one command to the job running in `run_dir`; returns its answer."""
    path = socket_path(run_dir)
    check_socket_permissions(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                path.unlink()  # stale: the job was killed and left its socket behind
            raise ControlError(f"the job in {run_dir} is not running any more (its socket was stale "
                               "and has been removed)") from None
        sock.sendall((json.dumps({"command": text}) + "\n").encode("utf-8"))
        line = sock.makefile("r", encoding="utf-8").readline()
    except socket.timeout:
        raise ControlError(f"the job in {run_dir} did not answer within {timeout:.0f}s") from None
    finally:
        sock.close()
    if not line:
        raise ControlError(f"the job in {run_dir} closed the connection without an answer")
    return json.loads(line)


def job_alive(run_dir: Path) -> bool:
    path = socket_path(run_dir)
    if not path.exists():
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()
