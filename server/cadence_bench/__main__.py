"""`python -m cadence_bench ...` is `cadence bench ...`."""

from __future__ import annotations

import sys

from cadence.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
