"""Warm hosts: thinwire's own commands start on a testbed host without importing torch again.

A testbed host is a network namespace; :meth:`thinwire.testbed.cluster.Cluster.run` starts
its command there with ``ip netns exec``. A fresh Python that runs ``thinwire train``
imports torch and, with the first optimizer, torch's compiler: about 5 s of CPU per host
on this kind of machine, before the first step, on every run. A validation or a demo runs
5-10 jobs on one cluster, so on 4 hosts sharing 2 cores that was 10 s of waiting per job.

So, for commands of the form ``[sys.executable, "-m", "thinwire", ...]``, the cluster
starts one small server per host, inside the host's namespace, at the first such run:
it imports torch and thinwire's command line once (the compiler too, before the first
command that builds an optimizer), then waits on its stdin. For each run it forks a child that becomes the host's process exactly as
``ip netns exec`` would have made it: its own session (the cluster stops a host by its
process group), the run's environment and working directory, stdout and stderr into the
host's log, stdin from ``/dev/null``, the run's ``OMP_NUM_THREADS`` applied (torch read
the variable when the server imported it). The child then runs the command line and
exits with its status, which the server reports back (:class:`WarmProcess` stands in for
the ``subprocess.Popen`` object). Everything else (any other program, a script,
torchrun) starts with ``ip netns exec`` as before.

The server forks from a single thread of its own and never computes, so a child
inherits no half-made runtime (as with :mod:`thinwire.comm.start_method`). It exits when
its stdin closes: when the cluster is closed, or when the process that owns it dies.
``THINWIRE_TESTBED_WARM=0`` turns warm hosts off (every command starts fresh), e.g. to
rule them out when debugging a host.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["ENV", "WarmHosts", "WarmProcess", "is_thinwire_command"]

ENV = "THINWIRE_TESTBED_WARM"
"""``0`` starts every testbed command with ``ip netns exec`` (no warm hosts)."""

_PRELOAD = ("torch", "torch.distributed", "thinwire.cli.main")
"""What the server imports when it starts: torch and the command line that ``python -m
thinwire`` runs."""

_OPTIMIZER_COMMANDS = (("train",), ("bench", "optimizer"))
"""Commands that build a ``torch.optim.Optimizer``, which imports torch's compiler (2.4 s
of CPU): the server imports it before it forks the first of them, once, so a probe or a
benchmark of collectives alone never pays for it."""


def is_thinwire_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs thinwire's command line in this Python (a warm host can)."""
    return len(argv) >= 3 and argv[0] == sys.executable and list(argv[1:3]) == ["-m", "thinwire"]


class WarmProcess:
    """A host's process forked by its warm server; what :class:`subprocess.Popen` offers
    the cluster: ``pid`` (its session and process group too), ``poll``, ``wait``,
    ``returncode``."""

    def __init__(self, server: _Server, pid: int) -> None:
        self._server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        code = self._server.exits.get(self.pid)
        if code is None and self._server.proc.poll() is not None and not _alive(self.pid):
            return -1  # its server was killed, and with it the exit status; it is gone
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while (code := self.returncode) is None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(f"host process {self.pid}", timeout or 0.0)
                self._server.changed.wait(0.1)
        return code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Server:
    """The client side of one host's server: requests in, pids and exit codes out."""

    def __init__(self, namespace: str, env: Mapping[str, str]) -> None:
        self.python_path = env.get("PYTHONPATH")
        # Why it failed, should it fail to start; closed with the server (close()).
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-m", __name__],
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            start_new_session=True,  # a Ctrl-C meant for the caller is not meant for it
        )
        self.exits: dict[int, int] = {}
        self.changed = threading.Condition()
        self._started: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True, name="thinwire-warm-host")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                if "started" in msg:
                    self._started.append(int(msg["started"]))
                else:
                    self.exits[int(msg["pid"])] = int(msg["code"])
                self.changed.notify_all()
        with self.changed:  # the server is gone: no exit code will come any more
            self._started.append(-1)
            self.changed.notify_all()

    def start(self, argv: list[str], env: Mapping[str, str], log: Path) -> WarmProcess:
        request = {"argv": argv, "env": dict(env), "cwd": os.getcwd(), "log": str(log)}
        assert self.proc.stdin is not None
        with self.changed:
            seen = len(self._started)
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            self.changed.wait_for(lambda: len(self._started) > seen)
            pid = self._started[seen]
        if pid < 0:
            self.errors.seek(0)
            said = self.errors.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(
                f"a testbed host's warm server exited (status {self.proc.wait()}): "
                f"{said[-1] if said else 'no message'}; {ENV}=0 starts every command fresh"
            )
        return WarmProcess(self, pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.errors.close()


class WarmHosts:
    """One warm server per host namespace, started at the first run that can use them."""

    def __init__(self, namespaces: Sequence[str]) -> None:
        self.namespaces = list(namespaces)
        self._servers: list[_Server] | None = None

    @staticmethod
    def enabled() -> bool:
        """Off with ``THINWIRE_TESTBED_WARM=0``."""
        return os.environ.get(ENV, "1").strip() != "0"

    def can_run(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``argv`` (with ``env``) can start on the warm servers: thinwire's own
        command line, on the module path the servers were started with."""
        if not (self.enabled() and is_thinwire_command(argv)):
            return False
        return self._servers is None or self._servers[0].python_path == env.get("PYTHONPATH")

    def start(self, host: int, argv: list[str], env: Mapping[str, str], log: Path) -> WarmProcess:
        """Fork host ``host``'s process for ``argv`` (its ``env`` and ``log``)."""
        if self._servers is None:
            # All at once: each server's imports then overlap with the others'.
            self._servers = [_Server(ns, env) for ns in self.namespaces]
        return self._servers[host].start(argv, env, log)

    def close(self) -> None:
        """Stop the servers (a host process still running is left to the cluster)."""
        for server in self._servers or []:
            server.close()
        self._servers = None


# --- the server, inside a host's namespace ---------------------------------------------------
def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the host's process and run the command; never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        # What "python -m thinwire ..." runs; it ends in sys.exit with the status.
        sys.argv = [request["argv"][0], *request["argv"][3:]]
        runpy.run_module("thinwire", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """Fork a child per request line until ``requests`` closes; report pids and exits."""

    def say(msg: dict[str, int]) -> None:
        replies.write((json.dumps(msg) + "\n").encode())
        replies.flush()

    children: set[int] = set()
    fd = requests.fileno()
    buffered = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.05)
        while children:  # reap
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return  # the cluster closed us, or its process died
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            args = request["argv"][3:]
            if any(tuple(args[: len(c)]) == c for c in _OPTIMIZER_COMMANDS):
                importlib.import_module("torch._dynamo")
            pid = os.fork()
            if pid == 0:
                replies.close()  # the cluster's reader must see the server's end alone
                _child(request)
            children.add(pid)
            say({"started": pid})


def main() -> None:
    """``python -m thinwire.testbed.warm_host``, inside a host's namespace."""
    for name in _PRELOAD:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "wb")
    # The children's stdout is their log; this process's own prints go nowhere.
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
