"""Runs child processes: forwards their output, remembers their last lines, stops them.

Children start in their own process group (so stopping one takes its own children
with it) and get PR_SET_PDEATHSIG, so no child outlives a launcher that is killed.
PR_SET_PDEATHSIG fires when the *thread* that started the child ends: start children from
the main thread.

The death signal is set by a tiny exec shim rather than a `preexec_fn`: a `preexec_fn`
forces a plain fork() that runs Python's at-fork hooks in the child, and some (grpc's, in
a process that talks gRPC) can abort it before it reaches exec. Without one, subprocess
uses vfork() and the child runs no Python before exec.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from loguru import logger

from cadence.logs import wrap_foreign_line


class ChildExited(RuntimeError):
    """A supervised child ended while it should have been running."""

    def __init__(self, child: Child) -> None:
        self.child = child
        code = child.proc.returncode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exited with code {code}"
        )
        super().__init__(f"{child.name} {how}")

    def report(self) -> str:
        lines = "\n".join(f"  {line}" for line in self.child.tail)
        return f"{self}; its last {len(self.child.tail)} lines:\n{lines}"


class Stopped(RuntimeError):
    """Stop was requested (SIGINT/SIGTERM) while waiting."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    tail: deque[str]
    readers: list[threading.Thread] = field(default_factory=list)

    def drain(self, timeout: float = 2.0) -> None:
        """Waits (bounded) until every line the child wrote has been forwarded."""
        for reader in self.readers:
            reader.join(timeout)


# argv: parent pid, then the command. PR_SET_PDEATHSIG survives the exec.
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"  # the parent died before prctl
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class Supervisor:
    """Starts children and watches them; `stop()` ends them all."""

    def __init__(
        self, tail_lines: int = 50, prefix_lines: bool = True, json_lines: bool = False
    ) -> None:
        self.children: list[Child] = []
        self.retired: list[Child] = []  # stopped on purpose, no longer watched
        self.stopping = threading.Event()
        self._tail_lines = tail_lines
        self._prefix_lines = prefix_lines
        # JSON logs: a child's line that is not a JSON object is wrapped into one.
        self._json_lines = json_lines
        self._write_lock = threading.Lock()

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        logger.info("starting {}: {}", name, " ".join(argv))
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        child = Child(name, proc, deque(maxlen=self._tail_lines))
        for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            reader = threading.Thread(
                target=self._forward, args=(child, stream, sink), name=f"{name}-log", daemon=True
            )
            reader.start()
            child.readers.append(reader)
        self.children.append(child)
        return child

    def _forward(self, child: Child, stream: IO[bytes], sink: IO[str]) -> None:
        prefix = f"[{child.name}] " if self._prefix_lines else ""
        stream_name = "stderr" if sink is sys.stderr else "stdout"
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            child.tail.append(line)
            if self._json_lines:
                line = wrap_foreign_line(line, child.name, stream_name)
            with self._write_lock:
                sink.write(f"{prefix}{line}\n")
                sink.flush()
        stream.close()

    def exited(self) -> Child | None:
        """The first child that has ended, its output drained; None while all run."""
        for child in self.children:
            if child.proc.poll() is not None:
                child.drain()
                return child
        return None

    def check(self) -> None:
        """Raises Stopped if a stop was requested, ChildExited if a child ended."""
        if self.stopping.is_set():
            raise Stopped()
        if child := self.exited():
            raise ChildExited(child)

    def wait_until(
        self, ready: Callable[[], bool], timeout: float, what: str, interval: float = 0.2
    ) -> None:
        """Polls `ready` until true; fails fast if a child ends or a stop is requested."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            if ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
            self.stopping.wait(interval)

    def watch(self, interval: float = 0.2) -> None:
        """Blocks until a stop is requested (returns) or a child ends (raises ChildExited)."""
        while not self.stopping.wait(interval):
            if child := self.exited():
                raise ChildExited(child)

    def retire(self, names: list[str], timeout: float) -> None:
        """Stops the children `names` (those still running) and stops watching them: a
        part of the stack that may die alone. They are still reaped by `stop`."""
        retiring = [c for c in self.children if c.name in names]
        _terminate(retiring, timeout)
        for child in retiring:
            child.drain()
            self.children.remove(child)
            self.retired.append(child)

    def request_stop(self, *_: object) -> None:
        """Signal-handler friendly: only sets a flag."""
        self.stopping.set()

    def forward(self, name: str, sig: signal.Signals) -> None:
        """Sends `sig` to the running child `name` (not its process group)."""
        for child in self.children:
            if child.name == name and child.proc.poll() is None:
                child.proc.send_signal(sig)

    def stop_child(self, name: str, timeout: float) -> None:
        """Stops the running child `name` alone (SIGTERM, then SIGKILL after `timeout`),
        before the others: a router drains its requests while the shards still serve them.
        Nothing happens if no such child runs."""
        _terminate([c for c in self.children if c.name == name], timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to every running child (last started first), then SIGKILL after `timeout`."""
        _terminate(list(reversed(self.children)), timeout)
        for child in self.children:
            _signal_group(child.proc, signal.SIGKILL)  # leftovers of its process group
            child.proc.wait()
            child.drain()


def _terminate(children: list[Child], timeout: float) -> None:
    """SIGTERM to those of `children` that run, then SIGKILL to those left after `timeout`."""
    running = [c for c in children if c.proc.poll() is None]
    for child in running:
        logger.info("stopping {} (pid {})", child.name, child.proc.pid)
        _signal_group(child.proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in running:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("{} did not stop within {:.0f} s; killing it", child.name, timeout)
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
