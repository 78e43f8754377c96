"""Fault injection for the readiness tests, installed only when asked: with
`CADENCE_FAULT_WEDGE_AT_STEP=N` in the shard's environment the forward thread blocks
forever at the forward of the N-th step that computes anything (counted from 1, warm-up's
profiling steps included), while the event loop goes on answering. Without it nothing is
wrapped and the step path carries no test hook."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from loguru import logger

if TYPE_CHECKING:
    from cadence.shard.engine import Engine
    from cadence.shard.forward_batch import ForwardBatch
    from cadence.shard.state import BatchState

WEDGE_AT_STEP = "CADENCE_FAULT_WEDGE_AT_STEP"


def install(engine: Engine, environ: Mapping[str, str]) -> None:
    """Wraps the engine's forward in the faults `environ` asks for (none: untouched)."""
    at = int(environ.get(WEDGE_AT_STEP, "0") or 0)
    if at:
        wedge_at_step(engine, at)


def wedge_at_step(engine: Engine, at: int) -> None:
    """The `at`-th forward of `engine`'s steps blocks forever."""
    forward = engine.steps.forward
    count = 0

    def wedged(batch: ForwardBatch, state: BatchState) -> torch.Tensor:
        nonlocal count
        count += 1
        if count == at:
            logger.warning(f"{WEDGE_AT_STEP}={at}: the forward blocks now")
            threading.Event().wait()
        return forward(batch, state)

    engine.steps.forward = wedged  # type: ignore[method-assign]
