"""Starts `cadence launch` in a child process for a benchmark and stops it after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`with LaunchedServer([...launch flags]) as url:` a ready cadence server."""

    def __init__(self, flags: list[str], name: str = "bench", timeout: float = 600.0) -> None:
        self.flags = flags
        self.name = name
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(tempfile.gettempdir(), f"cadence-{name}-{os.getpid()}.log")

    def __enter__(self) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "cadence", "launch", "--port", str(port), *self.flags]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cadence launch {self.flags} exited; see {self.log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"cadence launch {self.flags} not ready; see {self.log_path}")

    def __exit__(self, *_: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
