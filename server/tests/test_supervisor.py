"""The supervisor and the launcher's orchestration, with dummy child processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cadence import launcher
from cadence.launcher import LaunchConfig, launch
from cadence.supervisor import ChildExited, Stopped, Supervisor
from loguru import logger

PY = sys.executable


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_child_death_raises_with_its_last_lines() -> None:
    supervisor = Supervisor(tail_lines=3)
    script = (  # one stream: lines from stdout and stderr have no order between them
        "import sys\n"
        "for i in range(5): print('line', i, file=sys.stderr)\n"
        "print('boom', file=sys.stderr)\n"
        "sys.exit(3)"
    )
    supervisor.start("dummy", [PY, "-c", script])
    with pytest.raises(ChildExited) as caught:
        supervisor.watch(interval=0.05)
    supervisor.stop()
    assert caught.value.child.proc.returncode == 3
    report = caught.value.report()
    assert report.startswith("dummy exited with code 3; its last 3 lines:")
    assert report.splitlines()[1:] == ["  line 3", "  line 4", "  boom"]  # a ring of 3


def test_child_output_is_forwarded_line_by_line(capfd: pytest.CaptureFixture[str]) -> None:
    supervisor = Supervisor()
    script = "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)"
    child = supervisor.start("echo", [PY, "-c", script])
    child.proc.wait()
    child.drain(timeout=30)  # a loaded machine may be slow to schedule the pump threads
    out, err = capfd.readouterr()
    assert "[echo] to stdout" in out and "[echo] to stderr" in err
    supervisor.stop()


def test_json_logs_wrap_a_childs_foreign_lines_and_pass_its_json_lines(
    capfd: pytest.CaptureFixture[str],
) -> None:
    supervisor = Supervisor(prefix_lines=False, json_lines=True)
    script = (
        "import sys\n"
        'print(\'{"component": "shard", "message": "own"}\')\n'
        "print('UserWarning: a library speaks', file=sys.stderr)"
    )
    # only the child's lines: the supervisor's own log goes wherever an earlier test left
    # loguru's sink
    logger.disable("cadence.supervisor")
    try:
        child = supervisor.start("replica-1-shard-0", [PY, "-c", script])
        child.proc.wait()
        child.drain(timeout=30)  # a loaded machine may be slow to schedule the pump threads
        out, err = capfd.readouterr()
        supervisor.stop()
    finally:
        logger.enable("cadence.supervisor")
    assert json.loads(out) == {"component": "shard", "message": "own"}  # unchanged
    wrapped = json.loads(err)
    assert list(wrapped) == ["timestamp", "level", "component", "rank", "target", "message"] + [
        "fields"
    ]
    assert (wrapped["level"], wrapped["component"], wrapped["rank"]) == ("WARN", "shard", 0)
    assert wrapped["message"] == "UserWarning: a library speaks"
    assert wrapped["fields"] == {"process": "replica-1-shard-0"}
    assert wrapped["target"] == "stderr"
    # stdout and stderr are pumped by separate threads: the tail holds both, in either order
    assert "UserWarning: a library speaks" in child.tail


def test_stop_terminates_then_kills_stubborn_children() -> None:
    supervisor = Supervisor()
    polite = supervisor.start("polite", [PY, "-c", "import time; time.sleep(60)"])
    stubborn = supervisor.start(
        "stubborn",
        [
            PY,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
    )
    supervisor.wait_until(lambda: "ready" in stubborn.tail, 10, "stubborn ready")
    started = time.monotonic()
    supervisor.stop(timeout=1.0)
    assert time.monotonic() - started < 5
    assert polite.proc.returncode == -signal.SIGTERM
    assert stubborn.proc.returncode == -signal.SIGKILL


def test_stop_child_stops_that_child_alone() -> None:
    supervisor = Supervisor()
    first = supervisor.start("first", [PY, "-c", "import time; time.sleep(60)"])
    second = supervisor.start("second", [PY, "-c", "import time; time.sleep(60)"])
    supervisor.stop_child("second", timeout=10.0)
    assert second.proc.returncode == -signal.SIGTERM
    assert first.proc.poll() is None
    supervisor.stop_child("no-such-child", timeout=10.0)  # nothing to do
    supervisor.stop()
    assert first.proc.returncode == -signal.SIGTERM


def test_wait_until_fails_fast_when_a_child_exits() -> None:
    supervisor = Supervisor()
    supervisor.start("quitter", [PY, "-c", "print('bye')"])
    started = time.monotonic()
    with pytest.raises(ChildExited):
        supervisor.wait_until(lambda: False, timeout=30, what="never")
    assert time.monotonic() - started < 10
    supervisor.stop()


def test_wait_until_times_out_and_stops_on_request() -> None:
    supervisor = Supervisor()
    with pytest.raises(TimeoutError, match="never"):
        supervisor.wait_until(lambda: False, timeout=0.3, what="never", interval=0.05)
    supervisor.request_stop()
    with pytest.raises(Stopped):
        supervisor.wait_until(lambda: False, timeout=30, what="never")


def test_child_dies_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed launcher leaves no orphaned shard."""
    pid_file = tmp_path / "child.pid"
    parent = (
        "import sys, time\n"
        "from cadence.supervisor import Supervisor\n"
        "s = Supervisor()\n"
        f"c = s.start('orphan', [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.proc.pid))\n"
        "time.sleep(60)\n"
    )
    import subprocess

    env = os.environ | {"PYTHONPATH": str(Path(launcher.__file__).parents[1])}
    proc = subprocess.Popen([PY, "-c", parent], env=env)
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(child):  # the orphan is re-parented and reaped by init once it dies
        assert time.monotonic() < deadline, "child outlived its killed parent"
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The fake router: 200 on every GET (the real one would warm the shards up before
# answering /ready); on SIGTERM it "drains" for a second, then leaves a mark and exits.
_FAKE_ROUTER = (
    "import http.server, os, signal, sys, time\n"
    "class Handler(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
    "def drain(*_):\n"
    "    time.sleep(1.0)\n"
    "    open(sys.argv[2], 'w').close()\n"
    "    os._exit(0)\n"
    "signal.signal(signal.SIGTERM, drain)\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), Handler).serve_forever()\n"
)
# The fake shard: creates its socket file, dies after a while; on SIGTERM it notes
# whether the router had drained by then (argv[4] + ".shard": "True" or "False").
_FAKE_SHARD = (
    "import os, signal, sys, time\n"
    "def stop(*_):\n"
    "    open(sys.argv[4] + '.shard', 'w').write(str(os.path.exists(sys.argv[4])))\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "open(sys.argv[1], 'w').close()\n"
    "open(os.path.join(sys.argv[2], str(os.getpid())), 'w').close()\n"
    "print('shard listening', flush=True)\n"
    "time.sleep(float(sys.argv[3]))\n"
    "print('shard crashed', file=sys.stderr); sys.exit(7)\n"
)


@pytest.fixture
def fake_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SimpleNamespace:
    """Shard: a sleeper that creates its socket file. Router: an HTTP server that answers
    /health and /ready, and drains for a second on SIGTERM."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    pids = tmp_path / "pids"
    pids.mkdir()
    stack = SimpleNamespace(
        shard_lifetime=60.0,
        lifetimes={},  # by ShardSlot.name, overriding shard_lifetime
        model=str(tmp_path / "model"),
        pids=pids,
        router_argv=None,
        drained=tmp_path / "router-drained",
    )
    real_router_argv = launcher.router_argv

    def shard_argv(cfg: LaunchConfig, model_dir: str, slot: launcher.ShardSlot) -> list[str]:
        lifetime = str(stack.lifetimes.get(slot.name, stack.shard_lifetime))
        drained = str(stack.drained)
        return [PY, "-c", _FAKE_SHARD, slot.uds_path, str(pids), lifetime, drained]

    def router_argv(cfg: LaunchConfig, model_dir: str, uds: list[str]) -> list[str]:
        stack.router_argv = real_router_argv(cfg, model_dir, uds)
        return [PY, "-c", _FAKE_ROUTER, str(cfg.port), str(stack.drained)]

    monkeypatch.setattr(launcher, "shard_argv", shard_argv)
    monkeypatch.setattr(launcher, "router_argv", router_argv)
    return stack


def test_launch_starts_shards_then_router_serves_and_stops_cleanly_on_sigterm(
    fake_stack: SimpleNamespace, tmp_path: Path
) -> None:
    port = _free_port()
    uds_dir = tmp_path / "uds"
    cfg = LaunchConfig(
        model_id=fake_stack.model,
        port=port,
        kv_cache_memory=2**20,
        uds_dir=str(uds_dir),
        startup_timeout=30,
    )

    def stop_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not launcher._http_ok(f"http://127.0.0.1:{port}/ready"):  # noqa: SLF001
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_ready, daemon=True).start()
    assert launch(cfg) == 0
    # the router warms the shards up with what the launcher was given
    router = fake_stack.router_argv
    assert router[router.index("--kv-cache-bytes") + 1] == str(2**20)
    assert router[router.index("--shutdown-timeout") + 1] == "30"
    # started beside the shards, it waits for their sockets as long as a start step may take
    assert router[router.index("--shard-connect-timeout") + 1] == "30"
    # The router drained and exited before the shard was asked to stop.
    assert Path(f"{fake_stack.drained}.shard").read_text() == "True"
    assert not launcher._http_ok(f"http://127.0.0.1:{port}/health")  # noqa: SLF001
    assert all(_gone(int(p.name)) for p in fake_stack.pids.iterdir())
    assert list(uds_dir.iterdir()) == []  # sockets removed (the folder was given, so it stays)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_launch_exits_nonzero_naming_the_dead_child_and_its_lines(
    fake_stack: SimpleNamespace, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from cadence.logs import setup_logging

    setup_logging()  # to this test's captured stderr
    fake_stack.shard_lifetime = 3.0
    cfg = LaunchConfig(model_id=fake_stack.model, port=_free_port(), startup_timeout=30)
    assert launch(cfg) == 1
    err = capfd.readouterr().err
    assert "shard-0 exited with code 7" in err
    assert "shard crashed" in err.split("shard-0 exited with code 7")[1]
    assert all(_gone(int(p.name)) for p in fake_stack.pids.iterdir())


def test_a_dead_replica_leaves_the_others_serving_and_the_last_one_stops_the_launcher(
    fake_stack: SimpleNamespace, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from cadence.logs import setup_logging

    setup_logging()
    port = _free_port()
    cfg = LaunchConfig(model_id=fake_stack.model, port=port, replicas=2, startup_timeout=30)
    fake_stack.lifetimes = {"replica-1-shard-0": 3.0}
    seen: dict[str, object] = {}

    def stop_once_replica_1_died() -> None:
        deadline = time.monotonic() + 30
        while "replica 1 is down" not in seen.setdefault("log", ""):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        seen["router_up"] = launcher._http_ok(f"http://127.0.0.1:{port}/health")  # noqa: SLF001
        seen["live_shards"] = sum(not _gone(int(p.name)) for p in fake_stack.pids.iterdir())
        os.kill(os.getpid(), signal.SIGTERM)

    def collect_log() -> None:
        while "router_up" not in seen:
            seen["log"] = str(seen.get("log", "")) + capfd.readouterr().err
            time.sleep(0.1)

    threading.Thread(target=stop_once_replica_1_died, daemon=True).start()
    threading.Thread(target=collect_log, daemon=True).start()
    assert launch(cfg) == 0, seen.get("log")
    assert seen["router_up"] and seen["live_shards"] == 1  # replica 0's shard only
    router = fake_stack.router_argv
    assert router[router.index("--replicas") + 1] == "2"
    assert router.count("--shard-uds-path") == 2

    # Every replica dead: the launcher exits 1, like a single stack.
    fake_stack.lifetimes = {"replica-0-shard-0": 2.0, "replica-1-shard-0": 3.0}
    cfg = LaunchConfig(model_id=fake_stack.model, port=_free_port(), replicas=2, startup_timeout=30)
    assert launch(cfg) == 1
    assert all(_gone(int(p.name)) for p in fake_stack.pids.iterdir())
