"""The wheel the Dockerfile's builder stage makes serves: built with the Dockerfile's own
protoc and maturin commands, installed apart from the checkout, started with the image's
ENTRYPOINT and CMD, it answers /ready and completes a prompt, and the processes run the
wheel's cadence, not the checkout's.

Part of `make test` although the release build of the router takes minutes on 2 cores
when the cargo target folder (CARGO_TARGET_DIR) does not hold this very build already: no
image can be built on the development and CI machines (no container engine), so this is
the one check that the image's steps make a server that works."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deploy_files import REPO, image_argv, run_commands
from margin import QUANTIZED_BOUND, judge, served_greedy

from conftest import LaunchedServer, free_port, stop

BUILD_TIMEOUT_S = 3600
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def venv_env() -> dict[str, str]:
    """This environment's scripts (python, maturin) first, as in the builder stage."""
    return os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def dockerfile_command(containing: str) -> list[str]:
    (command,) = run_commands(containing)
    return command


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builder stage's commands, run in this checkout; only --out differs."""
    out = tmp_path_factory.mktemp("wheels")
    protoc = dockerfile_command("grpc_tools.protoc")
    maturin = dockerfile_command("maturin build")
    maturin[maturin.index("--out") + 1] = str(out)
    for command in (protoc, maturin):
        done = subprocess.run(
            command,
            cwd=REPO,
            env=venv_env(),
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr[-4000:]}"
    (built,) = out.glob("cadence-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel alone in a folder (its heavy dependencies come from this environment)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=600,
    )
    return target


def wheel_env(installed: Path) -> dict[str, str]:
    # Away from the checkout, so `python -m cadence` cannot find its server/ folder either.
    return venv_env() | {"PYTHONPATH": str(installed)}


def test_the_wheel_carries_the_router_and_the_generated_grpc_code(installed: Path) -> None:
    package = installed / "cadence"
    assert list(package.glob("_router*.so"))
    assert {p.name for p in (package / "pb").glob("*.py")} >= {"shard_pb2.py", "shard_pb2_grpc.py"}
    assert (installed / "bin" / "cadence").is_file()


def test_the_wheels_cadence_bench_runs(installed: Path, tmp_path: Path) -> None:
    """`cadence bench` lives in a package beside `cadence` (with its corpus): the wheel
    carries it, and the wheel's own script finds it."""
    assert (installed / "cadence_bench" / "corpus.txt").is_file()
    assert not (installed / "cadence" / "bench").exists()
    done = subprocess.run(
        [str(installed / "bin" / "cadence"), "bench", "--help"],
        env=wheel_env(installed),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: cadence bench"), done.stdout
    assert imported_from(installed, tmp_path, "cadence_bench").is_relative_to(installed)


def imported_from(installed: Path, cwd: Path, imports: str) -> Path:
    """The file of the first module in `imports` as the wheel's environment imports it."""
    first = imports.split(",")[0].strip()
    done = subprocess.run(
        [sys.executable, "-c", f"import {imports}; print({first}.__file__)"],
        env=wheel_env(installed),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return Path(done.stdout.strip())


def test_the_installed_wheel_is_what_python_imports(installed: Path, tmp_path: Path) -> None:
    imported = imported_from(installed, tmp_path, "cadence, cadence._router")
    assert imported.is_relative_to(installed)


@pytest.fixture(scope="module")
def server(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    """The image's command line with the wheel's `cadence` script, on a free port."""
    tmp = tmp_path_factory.mktemp("wheel-server")
    argv = image_argv()
    assert argv[0] == "cadence"
    port = free_port()
    # A flag given twice takes its last value, as when `docker run` appends arguments.
    argv = [str(installed / "bin" / "cadence"), *argv[1:], "--port", str(port)]
    argv += ["--kv-cache-memory", "256MiB"]
    log_path = tmp / "launch.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=wheel_env(installed),
            cwd=tmp,
        )
    launched = LaunchedServer(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + 300
    while not ready(launched):
        assert process.poll() is None, f"exited {process.returncode}:\n{launched.log()}"
        assert time.monotonic() < deadline, f"not ready in 300 s:\n{launched.log()}"
        time.sleep(0.5)
    yield launched
    assert stop(launched) == 0, launched.log()


def ready(server: LaunchedServer) -> bool:
    try:
        return httpx.get(f"{server.url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def children(parent: int) -> dict[int, list[str]]:
    """pid -> argv of `parent`'s child processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # gone meanwhile
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found[int(entry.name)] = argv
    return found


def test_the_router_process_runs_the_wheels_extension(
    server: LaunchedServer, installed: Path
) -> None:
    (router,) = [
        pid for pid, argv in children(server.process.pid).items() if "cadence.router" in argv
    ]
    mapped = {line.split()[-1] for line in Path(f"/proc/{router}/maps").read_text().splitlines()}
    extensions = [path for path in mapped if Path(path).name.startswith("_router")]
    assert extensions, sorted(mapped)
    assert all(Path(path).is_relative_to(installed) for path in extensions), extensions


def test_the_wheel_completes_a_prompt(server: LaunchedServer, float_reference) -> None:
    """The image serves the embedded GGUF as it is: its greedy answer is transformers' on
    the file's dequantized weights by the margin rule (`margin.py`)."""
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": CHAT_PROMPT, "max_tokens": 12, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["text"]
    _, model = float_reference
    with httpx.Client(base_url=server.url, timeout=120) as client:
        judgement = judge(model, *served_greedy(client, CHAT_PROMPT, 12))
    assert judgement.holds(QUANTIZED_BOUND), judgement
