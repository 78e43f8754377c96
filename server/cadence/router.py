"""`python -m cadence.router ARGS`: runs the Rust router compiled into cadence._router.
At start it connects to the shards, warms them up and sizes its KV block accounting on
what they allocated (`--help` lists the flags)."""

from __future__ import annotations

import signal
import sys


def flag_defaults() -> dict[str, str]:
    """The router's own flag defaults, as its command line spells them ("--port" ->
    "8080"); empty when the router is not built."""
    try:
        from cadence._router import flag_defaults as read
    except ImportError:
        return {}
    return read()


def main() -> int:
    from cadence._router import serve

    # SIGHUP reloads --api-key-file (the router listens for it once serving); until then,
    # and without a key file, it must not end the process as it would by default.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        serve(["cadence-router", *sys.argv[1:]])
    except RuntimeError as err:  # why it could not start or stopped: no traceback
        print(f"cadence-router: {err}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Python saw the SIGINT too, once the router had drained
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
