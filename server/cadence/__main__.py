"""`python -m cadence`: the same command line as the `cadence` script."""

import sys

from cadence.cli import main

sys.exit(main())
