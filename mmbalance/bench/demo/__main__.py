"""``python -m mmbalance.bench.demo``: the room's command, :func:`mmbalance.bench.demo.main`."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
