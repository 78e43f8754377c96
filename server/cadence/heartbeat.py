"""The forward thread's heartbeat: a counter bumped once per decoder layer computed and
once per step ended, read by `Health` on the gRPC event loop. A forward that is merely
long (a 4,000-token prefill) keeps it growing layer by layer; one that is wedged (a
deadlock, a kernel that never returns) lets it stand still, which is how the router's
readiness tells busy from stuck while the event loop answers either way.

A plain int bumped under the GIL: one writer (the forward thread), readers that only
need to see it change."""

from __future__ import annotations


class Heartbeat:
    def __init__(self) -> None:
        self.beats = 0

    def beat(self) -> None:
        self.beats += 1


HEARTBEAT = Heartbeat()
