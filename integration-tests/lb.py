"""haproxy (the real one, Debian's package) in front of cadence replicas: its config made
from haproxy.cfg.in, its process in the foreground, and its view of the replicas read from
its stats socket."""

from __future__ import annotations

import csv
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template

from conftest import free_port

TEMPLATE = Path(__file__).with_name("haproxy.cfg.in")
BACKEND = "replicas"  # the backend's name in the template
MISSING = (
    "haproxy is not installed, and the load-balancer tests run the real one: "
    "`make install` as root installs it on Debian/Ubuntu "
    "(or: apt-get install --no-install-recommends haproxy; elsewhere your distribution's "
    "haproxy >= 2.2)"
)


class HaproxyMissing(RuntimeError):
    pass


def haproxy_binary() -> str:
    """haproxy on the PATH, or where Debian puts it (/usr/sbin is not on a user's PATH)."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise HaproxyMissing(MISSING)
    return found


def render_config(port: int, stats_socket: Path, replicas: dict[str, str]) -> str:
    """The template with one `server` line per replica (name → host:port)."""
    servers = "".join(f"    server {name} {address}\n" for name, address in replicas.items())
    return Template(TEMPLATE.read_text()).substitute(
        port=port, stats_socket=stats_socket, servers=servers
    )


@dataclass
class Haproxy:
    url: str
    process: subprocess.Popen
    stats_socket: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def servers(self) -> dict[str, dict[str, str]]:
        """Each replica's row of `show stat` (`status`, `stot`: requests sent to it,
        `hrsp_5xx`, ...), by server name."""
        with socket.socket(socket.AF_UNIX) as stats:
            stats.settimeout(10)
            stats.connect(str(self.stats_socket))
            stats.sendall(b"show stat\n")
            chunks = []
            while chunk := stats.recv(65536):
                chunks.append(chunk)
        lines = b"".join(chunks).decode().removeprefix("# ").splitlines()
        rows = csv.DictReader(line for line in lines if line)
        return {
            row["svname"]: row
            for row in rows
            if row["pxname"] == BACKEND and row["svname"] != "BACKEND"
        }

    def status(self, server: str) -> str:
        """`UP`, `DOWN`, or a transition on its way (`UP 1/2`: one failed check of two)."""
        return self.servers()[server]["status"]


def start_haproxy(tmp_dir: Path, replicas: dict[str, str], timeout: float = 60.0) -> Haproxy:
    """haproxy in the foreground on a free port, once it reports every replica UP."""
    binary = haproxy_binary()
    port = free_port()
    config = tmp_dir / "haproxy.cfg"
    stats_socket = tmp_dir / "haproxy.sock"
    config.write_text(render_config(port, stats_socket, replicas))
    log_path = tmp_dir / "haproxy.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [binary, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
    haproxy = Haproxy(f"http://127.0.0.1:{port}", process, stats_socket, log_path)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"haproxy exited with {process.returncode}:\n{haproxy.log()}")
        try:
            servers = haproxy.servers()
            if all(servers[name]["check_status"] == "L7OK" for name in replicas):
                return haproxy
        except (OSError, KeyError):
            pass  # the socket is not there yet, or the first checks have not run
        if time.monotonic() > deadline:
            stop_haproxy(haproxy)
            raise TimeoutError(f"haproxy: replicas not UP after {timeout} s:\n{haproxy.log()}")
        time.sleep(0.2)


def stop_haproxy(haproxy: Haproxy) -> None:
    if haproxy.process.poll() is None:
        haproxy.process.terminate()
        try:
            haproxy.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            haproxy.process.kill()
            haproxy.process.wait()
