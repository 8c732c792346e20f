"""A fork server for the suite's Python processes: torch and loom imported once, not per rank.

Every rank a test starts used to be a fresh interpreter that spent ~4.5 s of CPU importing
torch and loom before its first line of work (measured on an AMD EPYC: `python -c "import
loom.trainer.entry"`, 3.9 s user + 0.8 s sys); a 4-rank job on two cores waited ~10 s for
that alone, and the suite starts hundreds of ranks. The zygote imports those modules once,
runs nothing else (no tensor op, no thread, no process group: a fork is only safe from a
process that has done none of these), and forks one child per request. The child becomes
what `python ARGV` would have been: the requested environment, working directory, stdout
and stderr files, `sys.argv` and `sys.path`, then the script, module or `-c` code as
`__main__`, exiting with the code Python would have.

A zygote serves only requests whose environment equals the one it imported its modules
under, in every variable a preloaded module may read at import (anything outside
`PER_PROCESS`): each such environment gets its own zygote, started the second time it is
asked for (a one-off environment, such as a test's private cache folder, starts a fresh
interpreter, as cheap as a zygote); past `MOST_ZYGOTES` the caller starts fresh too. A
PYTHONPATH that provides a module already imported here from somewhere else (another
checkout's `src`, which benchmarks compare with) also starts fresh: a child would find that
module imported from this checkout. So the behaviour under test never depends on which way
a process was started.

Protocol, one Unix socket connection per child: the test sends one JSON line (argv, env,
cwd, stdout/stderr paths), the zygote answers `{"pid": N}` and, when the child has ended,
`{"returncode": R}` (negative for a signal, as `subprocess.Popen` has it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ("loom.cli", "loom.trainer.entry", "loom.trainer.parity", "loom.commands.verify",
           "loom.commands.eval", "loom.commands.generate", "loom.plan.command",
           "matplotlib.figure")
"""What a rank imports before its first line of work (torch, dynamo and inductor included)
and the plotting a run ends with; nothing here imports transformers, whose logger level is
set from the environment at import time (`loom.runtime.logs.quiet_upstream_notices`)."""

PER_PROCESS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH", "TMPDIR",
               "TORCH_FR_BUFFER_SIZE", "PYTEST_CURRENT_TEST")
PER_PROCESS_PREFIXES = ("LOOM_", "TRANSFORMERS_", "HF_", "_TORCHINDUCTOR_PYOBJECT_", "KMP_",
                        "SLOW_", "FAKE_WANDB_")
"""Variables read when a process does its work, never when a preloaded module is imported:
loom reads its environment when a command starts; transformers and the Hub client are not
preloaded; inductor's pointer variable is set by a compile in the test process itself;
Intel's OpenMP (KMP_) is not what torch's CPU build loads; the tests' own workers and fakes
read theirs (SLOW_, FAKE_WANDB_) when they run."""


def per_process(name: str) -> bool:
    return name in PER_PROCESS or name.startswith(PER_PROCESS_PREFIXES)


def import_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables a preloaded module may read at import: those a zygote must share with
    every child it serves."""
    return {k: v for k, v in env.items() if not per_process(k)}


# --- the zygote's side ------------------------------------------------------------------

def _child_path(argv: list[str], cwd: str, env: dict[str, str], base_path: list[str]
                ) -> list[str]:
    """`sys.path` as a fresh `python ARGV` would build it: the script's folder (the working
    directory for -m, "" for -c), PYTHONPATH, then the interpreter's own entries."""
    first = {"-m": cwd, "-c": ""}.get(argv[0], os.path.dirname(os.path.abspath(argv[0])))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *base_path]


def _run_child(request: dict, base_path: list[str], default_threads: int) -> int:
    """Become `python ARGV` in this forked process; the exit code Python would give."""
    argv: list[str] = request["argv"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                            (2, request["err"], os.O_WRONLY)):
        target = os.open(name, flags | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
        os.dup2(target, fd)
        os.close(target)
    _reopen_std_streams()
    tempfile.tempdir = None  # computed again from this child's TMPDIR
    sys.path[:] = _child_path(argv, request["cwd"], request["env"], base_path)
    # what a fresh interpreter takes from OMP_NUM_THREADS, else torch's default (the zygote's)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or default_threads))
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` calls
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as error:  # printed as Python would, without this frame
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


def _reopen_std_streams() -> None:
    """New `sys.stdin/stdout/stderr` over the redirected descriptors, buffered as Python
    buffers them at start-up (stdout by line only on a terminal, stderr by line; neither
    under PYTHONUNBUFFERED, which the zygote was started with if the child is)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def text(fd: int, mode: str, **kwargs) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", write_through=unbuffered, **kwargs)

    sys.stdin = sys.__stdin__ = text(0, "r")
    sys.stdout = sys.__stdout__ = text(1, "w", line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = text(2, "w", errors="backslashreplace", line_buffering=True)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def serve(path: str) -> None:
    """The zygote's loop: accept requests, fork children, report how each one ended."""
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the preloaded modules are never garbage: the children's collections skip them
    default_threads = torch.get_num_threads()  # torch's own choice, without OMP_NUM_THREADS
    own = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    base_path = [p for p in sys.path[1:] if p not in own]  # the interpreter's own entries
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears only when the zygote is ready
    waiting: dict[int, socket.socket] = {}
    session = os.getppid()
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                os._exit(_run_child(request, base_path, default_threads))
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):  # the test may have given up on it
                    conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
                conn.close()
        if os.getppid() != session:  # the test session is gone (killed: no atexit ran)
            return


# --- the test's side --------------------------------------------------------------------

class Zygote:
    """One zygote, serving the requests of one import environment (`import_environment`),
    stopped when the test session exits."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="loom-zygote-"))
        self.path = str(self.folder / "sock")
        # this checkout's src first: the zygote pre-imports loom, and an installed copy
        # elsewhere (another worktree's editable install) must not be the one it serves;
        # a child's own path is set when it starts
        env = {**env, "PYTHONPATH": os.pathsep.join((str(REPO / "src"), str(REPO)))}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path],
                                     cwd=REPO, env=env, stdin=subprocess.DEVNULL)
        atexit.register(self.stop)

    def ready(self, limit: float = 120.0) -> bool:
        deadline = time.monotonic() + limit
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


MOST_ZYGOTES = 4
"""Each holds torch and loom (~0.5 GiB) for the session: the suite's environments are few
(the session's own, the minimal one of the import tests), the rest one-offs."""
_zygotes: dict[frozenset, Zygote | None] = {}
_asked: set[frozenset] = set()
_disabled = os.environ.get("LOOM_TEST_ZYGOTE", "1") == "0"


def zygote(env: dict[str, str]) -> Zygote | None:
    """The zygote serving `env`, started the second time its import environment is asked
    for; None before that, past MOST_ZYGOTES, where it failed to start, or when
    LOOM_TEST_ZYGOTE=0."""
    imports = import_environment(env)
    key = frozenset(imports.items())
    if _disabled or shadows_imported(env.get("PYTHONPATH", "")):
        return None
    if key not in _asked:
        _asked.add(key)
        return None
    if key not in _zygotes and len(_zygotes) < MOST_ZYGOTES:
        server = Zygote(imports)
        _zygotes[key] = server if server.ready() else None
        if _zygotes[key] is None:
            server.stop()
    return _zygotes.get(key)


def shadows_imported(pythonpath: str) -> bool:
    """Whether an entry of `pythonpath`, other than this checkout's own folders, holds a
    top-level package a zygote imports (those of `PRELOAD`, torch, tests) or this process
    has: a fresh interpreter would import that one instead."""
    own = {REPO.resolve(), (REPO / "src").resolve()}
    names = {name.partition(".")[0] for name in (*sys.modules, *PRELOAD, "torch", "tests")}
    for entry in filter(None, pythonpath.split(os.pathsep)):
        folder = Path(entry).resolve()
        if folder in own or not folder.is_dir():
            continue
        present = {p.name.partition(".")[0] for p in folder.iterdir()}
        if names & present:
            return True
    return False


class LoggedOutput:
    """A process whose stdout and stderr went to `logs/out` and `logs/err`, read once it has
    ended: a chatty process cannot fill a pipe and block while the test waits for another."""

    logs: Path
    output: tuple[str, str] | None = None

    def communicate(self, input: str | None = None, timeout: float | None = None
                    ) -> tuple[str, str]:
        """Wait (TimeoutExpired past `timeout`, as Popen's), then (stdout, stderr)."""
        self.wait(timeout)
        if self.output is None:
            self.output = ((self.logs / "out").read_text(errors="replace"),
                           (self.logs / "err").read_text(errors="replace"))
            shutil.rmtree(self.logs)
        return self.output


class ZygoteProcess(LoggedOutput):
    """A child of the zygote, with the parts of `subprocess.Popen` the harness uses."""

    def __init__(self, conn: socket.socket, logs: Path):
        self.conn, self.logs = conn, logs
        self.reader = conn.makefile()
        self.pid = json.loads(self.reader.readline())["pid"]
        self.returncode: int | None = None

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], cwd: Path | str | None
              ) -> ZygoteProcess | None:
        """`argv` as `python argv[1:]` through the zygote, its stdout and stderr written to
        files read by `communicate`; None when it cannot be (not a Python command, an
        environment the zygote cannot serve, no zygote)."""
        if argv[0] != sys.executable or len(argv) < 2:
            return None
        server = zygote(env)
        if server is None:
            return None
        logs = Path(tempfile.mkdtemp(prefix="loom-proc-"))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(server.path)
        request = {"argv": argv[1:], "env": env, "cwd": str(cwd or REPO),
                   "out": str(logs / "out"), "err": str(logs / "err")}
        conn.sendall(json.dumps(request).encode() + b"\n")
        return cls(conn, logs)

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self.conn], [], [], 0)
            if ready:
                self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self.conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            self._read()
        return self.returncode

    def _read(self) -> None:
        line = self.reader.readline()
        self.returncode = json.loads(line)["returncode"] if line else -signal.SIGKILL
        self.conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


if __name__ == "__main__":
    serve(sys.argv[1])
