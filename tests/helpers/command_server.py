"""The real command, forked from a process that has already imported what every command imports.

A command spends most of its CPU importing torch and Lightning (7-8 s of some 9.5 s for a one-step
run on 2 cores), and the suite starts some 300 of them. The server is started once per test process,
like the command (`python -m tests.helpers.command_server SOCKET`, the command's environment), imports
torch, Lightning, Hydra and OmegaConf, and no module of the project. For each request it forks a
child that takes the test's stdin, stdout and stderr, working directory, environment and arguments
and runs `python -m <module> <args>` as the interpreter would: runpy's `_run_module_as_main` in a
new `__main__`, the working directory first on sys.path, SystemExit and uncaught exceptions turned
into the exit status, non-daemon threads joined and atexit handlers run before it exits. The command launches its ranks from there
as it does from a fresh process.

What a forked command cannot show stays with fresh processes (`run_fresh`, the fixture
`lightfleet_fresh`): what the command imports before a refusal, warnings printed while a library is
imported, signals sent from a terminal, the wheel. A forked command takes the environment the test
gives it, but for the variables read while an interpreter starts (`read_at_start`): where a test
sets one of those, the command starts fresh. `LIGHTFLEET_TESTS_FRESH=1` runs every command of the
suite in a fresh process.

Test side: `run_module(module, args, cwd, timeout)`, which returns what subprocess.run(...,
capture_output=True, text=True) would.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import locale
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import List, Optional

from tests.helpers.commands import PROJECT_ROOT, command_env

FRESH = "LIGHTFLEET_TESTS_FRESH"
REQUEST_BYTES = 1 << 20
START_VARIABLES = ("PYTHON", "LD_", "OMP_", "KMP_", "MKL_", "GOMP_", "CUDA_", "TORCH", "PYTORCH_", "NCCL_")


# --------------------------------------------------------------------------- test side


class CommandServer:
    """One server process and the socket it listens on; started on first use, ended with this process."""

    def __init__(self) -> None:
        self.env = command_env(PYTHONUNBUFFERED="1")
        self.folder = tempfile.mkdtemp(prefix="lightfleet-commands-")
        self.socket_path = os.path.join(self.folder, "socket")
        self.log = os.path.join(self.folder, "server.log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, self.socket_path], cwd=PROJECT_ROOT,
                                            env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.close)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the command server did not start:\n{Path(self.log).read_text()}")
            time.sleep(0.05)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def run(self, module: str, args: List[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", module, *args]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null, \
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.connect(self.socket_path)
            request = json.dumps({"module": module, "args": args, "cwd": str(cwd), "env": env}).encode()
            socket.send_fds(connection, [request], [null.fileno(), out.fileno(), err.fileno()])
            pid = json.loads(connection.recv(REQUEST_BYTES))["pid"]
            connection.settimeout(timeout)
            try:
                returncode = json.loads(connection.recv(REQUEST_BYTES))["returncode"]
            except socket.timeout:
                with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                    os.kill(pid, signal.SIGKILL)
                connection.settimeout(None)
                connection.recv(REQUEST_BYTES)
                raise subprocess.TimeoutExpired(command, timeout, read_text(out), read_text(err)) from None
            return subprocess.CompletedProcess(command, returncode, read_text(out), read_text(err))


def read_text(file) -> str:
    """What subprocess's text mode makes of a stream: the locale's encoding, universal newlines."""
    file.seek(0)
    text = file.read().decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


_server: Optional[CommandServer] = None


def run_fresh(module: str, args: List[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m module *args` from `cwd` in a fresh process, stdout and stderr apart as text."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=command_env(PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=timeout)


def run_module(module: str, args: List[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m module *args` from `cwd`, stdout and stderr apart as text; forked from this test
    process's server, or a fresh process where LIGHTFLEET_TESTS_FRESH is set."""
    global _server
    if os.environ.get(FRESH):
        return run_fresh(module, args, cwd, timeout)
    if _server is None or _server.process.poll() is not None:
        _server = CommandServer()
    env = command_env(PYTHONUNBUFFERED="1")
    if read_at_start(env) != read_at_start(_server.env):
        return run_fresh(module, args, cwd, timeout)
    return _server.run(module, args, cwd, env, timeout)


def read_at_start(env: dict) -> dict:
    """The variables an interpreter, torch or OpenMP read while starting or importing: the forked
    command gets every other variable as a test sets it, these only as the server started with them."""
    return {name: value for name, value in env.items() if name.startswith(START_VARIABLES)}


# --------------------------------------------------------------------------- server side


def serve(socket_path: str) -> None:
    """Fork a child for each request until the test process that started the server is gone."""
    import hydra  # noqa: F401  what the command imports to compose
    import omegaconf  # noqa: F401
    import pytorch_lightning  # noqa: F401  what every check after the light ones imports (torch with it)

    parent = os.getppid()
    children = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(socket_path + ".binding")
        listener.listen(16)
        os.rename(socket_path + ".binding", socket_path)  # the test side waits for the name
        while os.getppid() == parent:
            if select.select([listener], [], [], 0.05)[0]:
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, REQUEST_BYTES, 3)
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in [connection, *children.values()]:
                        other.close()
                    run_child(json.loads(message), fds)
                for fd in fds:
                    os.close(fd)
                connection.send(json.dumps({"pid": pid}).encode())
                children[pid] = connection
            reap(children)


def reap(children: dict) -> None:
    """Tell each finished child's requester its exit status (subprocess's: -N for signal N)."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = children.pop(pid)
        try:
            connection.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:  # the requester is gone (it timed out and was killed)
            pass
        connection.close()


def run_child(request: dict, fds: List[int]) -> None:
    """`python -m module args` in this forked child; never returns."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = [sys.argv[0], *request["args"]]  # runpy sets argv[0] to the module's file
    sys.modules["__main__"] = types.ModuleType("__main__")  # the module runs in a __main__ of its own
    code = 0
    try:
        runpy._run_module_as_main(request["module"])  # what `python -m` calls
    except SystemExit as exit:
        code = exit_status(exit.code)
    except BaseException as error:
        error.__traceback__ = error.__traceback__.tb_next  # from runpy on, as -m's traceback
        sys.excepthook(type(error), error, error.__traceback__)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    threading._shutdown()  # the interpreter joins non-daemon threads before atexit, as here
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # the interpreter ends an uncaught Ctrl-C by SIGINT to itself
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def exit_status(code) -> int:
    """The interpreter's exit status for SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1])
