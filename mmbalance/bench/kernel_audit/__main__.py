"""``python -m mmbalance.bench.kernel_audit``: the room's command, :func:`mmbalance.bench.kernel_audit.main`."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
