"""The forward thread's heartbeat: a counter bumped once per decoder layer computed and
once per step ended, read by `Health` on the gRPC event loop. A forward that is merely
long (a 4,000-token prefill) keeps it growing layer by layer; one that is wedged (a
deadlock, a kernel that never returns) lets it stand still, which is how the router's
readiness tells busy from stuck while the event loop answers either way.

A plain int bumped under the GIL: one writer (the forward thread), readers that only
need to see it change."""

from __future__ import annotations

import os
import threading

from loguru import logger


class Heartbeat:
    def __init__(self) -> None:
        self.beats = 0

    def beat(self) -> None:
        self.beats += 1


HEARTBEAT = Heartbeat()

# Fault injection for the readiness tests: the forward thread blocks forever at the start
# of this step (counted from 1 after warm-up), with the event loop still answering.
_WEDGE_AT_STEP = int(os.environ.get("CADENCE_FAULT_WEDGE_AT_STEP", "0") or 0)


def wedge_if_asked(step_number: int) -> None:
    """Blocks forever when `CADENCE_FAULT_WEDGE_AT_STEP` names this step."""
    if _WEDGE_AT_STEP and step_number == _WEDGE_AT_STEP:
        logger.warning(f"CADENCE_FAULT_WEDGE_AT_STEP={_WEDGE_AT_STEP}: the forward blocks now")
        threading.Event().wait()
