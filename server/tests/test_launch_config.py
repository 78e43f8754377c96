"""What the launcher passes the router for --async-scheduling."""

from __future__ import annotations

import pytest
from cadence.launcher import LaunchConfig, _scheduler_argv


@pytest.mark.parametrize(
    ("device", "choice", "overlapped"),
    [
        ("cpu", "auto", False),  # the forward uses every core: nothing to overlap with
        ("cuda", "auto", True),
        ("cuda:1", "auto", True),
        ("cpu", "on", True),
        ("cuda", "off", False),
    ],
)
def test_async_scheduling_is_on_with_a_gpu_unless_asked(device, choice, overlapped):
    argv = _scheduler_argv(LaunchConfig(model_id="m", device=device, async_scheduling=choice))
    assert ("--no-async-scheduling" not in argv) == overlapped
