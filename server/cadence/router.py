"""`python -m cadence.router ARGS`: runs the Rust router compiled into cadence._router."""

from __future__ import annotations

import sys


def main() -> None:
    from cadence._router import serve

    serve(["cadence-router", *sys.argv[1:]])


if __name__ == "__main__":
    main()
