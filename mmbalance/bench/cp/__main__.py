"""``python -m mmbalance.bench.cp``: the room's command, :func:`mmbalance.bench.cp.main`."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
