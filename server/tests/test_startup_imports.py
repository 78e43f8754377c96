"""The command line and the launcher start without torch: every `cadence launch` (and
`cadence --help`) would otherwise spend seconds importing it in a process that only parses
flags, checks the CPU and starts the shards, which import it themselves."""

from __future__ import annotations

import subprocess
import sys


def imported_after(statement: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after running `statement`."""
    listing = "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    code = f"{statement}\nimport sys\n{listing}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_cli_and_the_launchers_cpu_choices_import_no_torch() -> None:
    statement = (
        "import cadence.cli, cadence.launcher\n"
        "from cadence.config import LaunchConfig\n"
        "cfg = cadence.launcher.resolve_cpu_choices(LaunchConfig(model_id='m'))\n"
        "assert cfg.cpu_isa != 'auto' and cfg.kv_cache_dtype"
    )
    modules = imported_after(statement)
    assert "cadence" in modules
    assert "torch" not in modules
