"""``python -m mmbalance.bench.planners``: the room's command, :func:`mmbalance.bench.planners.main`."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
