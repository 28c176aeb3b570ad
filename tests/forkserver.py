"""``python -m tierstream`` processes for the tests, forked from one that has imported it.

The suite starts about 400 brokers and 250 other CLI processes, and each spent about 0.45
CPU-s importing pyarrow, numpy, typer and tierstream before doing anything: a sixth of the
suite's CPU on two cores. A fork server per test worker imports them once; each command is a
child forked from it, which runs ``tierstream.cli.main`` with the command's argv,
environment, working directory and stdin/stdout/stderr (passed over a Unix socket), exactly
as a process started from scratch would. Its pid is the real one (signals reach it, a kill
is a crash); its exit status comes back over the socket, the server being its parent.

Only ``python -m tierstream ...`` is forked; anything else (a command under ``ip netns
exec`` or ``prlimit``) is started by :class:`subprocess.Popen` as before, and
``TIERSTREAM_TEST_SPAWN=1`` turns the server off.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any

__all__ = ["ForkServer", "ForkedProcess", "popen", "run", "start", "stop"]

_MAX_MESSAGE = 1 << 20


def _serve(sock: socket.socket) -> None:
    """The server: preload, then fork a child per request and report each child's exit."""
    import pyarrow.compute
    import pyarrow.flight  # noqa: F401

    import tierstream.broker.run
    import tierstream.cli

    gc.collect()
    gc.freeze()  # what the children inherit stays out of their collections: fewer copied pages
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                sock.send(json.dumps({"exit": pid,
                                      "code": os.waitstatus_to_exitcode(status)}).encode())
        if sock in readable:
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            if not message:  # the test process is gone: so are its commands
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                _child(request, fds, tierstream.cli.main)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())


def _child(request: dict[str, Any], fds: list[int], main: Any) -> None:
    """Become the command: its standard streams, directory, environment and argv."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["tierstream", *request["args"]]
        try:
            from tierstream.util import faults

            faults.arm()  # read from the environment as the module was imported
            main(request["args"])
            code = 0
        except SystemExit as exc:
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


class ForkedProcess:
    """What the tests use of :class:`subprocess.Popen`, for a child of the fork server."""

    def __init__(self, server: ForkServer, args: list[str]) -> None:
        self.args = args
        self.pid = 0
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self._server = server
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input``, read stdout and stderr to their ends, wait for the exit."""
        out: dict[str, Any] = {}

        def drain(name: str, stream: IO[Any] | None) -> None:
            if stream is not None:
                with stream:
                    out[name] = stream.read()

        readers = [threading.Thread(target=drain, args=(n, s), daemon=True)
                   for n, s in (("stdout", self.stdout), ("stderr", self.stderr))]
        for r in readers:
            r.start()
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError), self.stdin:
                if input:
                    self.stdin.write(input)
        self.wait(timeout)
        for r in readers:
            r.join(timeout)
        return out.get("stdout"), out.get("stderr")

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        self.wait()


class ForkServer:
    """One fork server for this test process, and :meth:`popen` to start commands from it."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = mine
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"import socket, sys; sys.path.insert(0, {root!r}); "
             "from tests.forkserver import _serve; "
             f"_serve(socket.socket(fileno={theirs.fileno()}))"],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        ready = json.loads(self._sock.recv(_MAX_MESSAGE) or b"{}")
        if "ready" not in ready:
            raise RuntimeError("the fork server did not start")
        self._lock = threading.Lock()
        self._next = 0
        self._pending: dict[int, tuple[threading.Event, list[int]]] = {}
        self._running: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the pid's reply was read
        threading.Thread(target=self._listen, name="forkserver", daemon=True).start()

    def _listen(self) -> None:
        with contextlib.suppress(OSError):  # closed: the session is over
            self._read_events()

    def _read_events(self) -> None:
        while message := self._sock.recv(_MAX_MESSAGE):
            event = json.loads(message)
            with self._lock:
                if "exit" in event:
                    proc = self._running.pop(event["exit"], None)
                    if proc is None:
                        self._early[event["exit"]] = event["code"]
                    else:
                        proc._exit(event["code"])
                else:
                    done, slot = self._pending.pop(event["id"])
                    slot.append(event["pid"])
                    done.set()

    def popen(self, cmd: list[str], *, stdin: Any = None, stdout: Any = None,
              stderr: Any = None, text: bool = False, env: dict[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """Like :class:`subprocess.Popen` for ``[sys.executable, "-m", "tierstream", ...]``
        (forked), and :class:`subprocess.Popen` itself for any other command or option."""
        if cmd[:3] != [sys.executable, "-m", "tierstream"] or kwargs:
            return subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                    env=env, cwd=cwd, **kwargs)
        proc = ForkedProcess(self, cmd)
        theirs: list[int] = []
        mine_to_close: list[int] = []
        for index, (spec, name) in enumerate(((stdin, "stdin"), (stdout, "stdout"),
                                              (stderr, "stderr"))):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                child_end, parent_end = (r, w) if index == 0 else (w, r)
                mode = ("w" if index == 0 else "r") + ("" if text else "b")
                setattr(proc, name, open(parent_end, mode))  # noqa: SIM115 (closed by its user)
                theirs.append(child_end)
                mine_to_close.append(child_end)
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                mine_to_close.append(fd)
            elif spec == subprocess.STDOUT and index == 2:
                theirs.append(theirs[1])
            elif spec is None:
                theirs.append(index)
            else:
                theirs.append(spec if isinstance(spec, int) else spec.fileno())
        request = {"args": cmd[3:], "env": dict(os.environ if env is None else env),
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd()}
        done = threading.Event()
        slot: list[int] = []
        try:
            with self._lock:
                self._next += 1
                request["id"] = self._next
                self._pending[self._next] = (done, slot)
                socket.send_fds(self._sock, [json.dumps(request).encode()], theirs)
        finally:
            for fd in mine_to_close:
                os.close(fd)
        if not done.wait(60):
            raise RuntimeError("the fork server did not answer")
        with self._lock:
            proc.pid = slot[0]
            if proc.pid in self._early:
                proc._exit(self._early.pop(proc.pid))
            else:
                self._running[proc.pid] = proc
        return proc

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the listening thread; the server sees EOF
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10)


_server: ForkServer | None = None  # this test process's, from its first command on
_enabled = False
_starting = threading.Lock()


def start() -> None:
    """Fork the commands of this process from now on (the server starts with the first)."""
    global _enabled
    _enabled = True


def stop() -> None:
    global _server, _enabled
    _enabled = False
    if _server is not None:
        _server.close()
        _server = None


def popen(cmd: list[str], **kwargs: Any) -> Any:
    """:meth:`ForkServer.popen` of this process's server, :class:`subprocess.Popen` without."""
    global _server
    if not _enabled:
        return subprocess.Popen(cmd, **kwargs)
    with _starting:
        if _server is None:
            _server = ForkServer()
    return _server.popen(cmd, **kwargs)


def run(cmd: list[str], *, input: Any = None, capture_output: bool = False, text: bool = False,
        timeout: float | None = None, env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` for the options the tests use, through :func:`popen`."""
    pipe = subprocess.PIPE if capture_output else None
    proc = popen(cmd, stdin=subprocess.PIPE if input is not None else None, stdout=pipe,
                 stderr=pipe, text=text, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.wait(), out, err)
