"""``python -m mmbalance.bench.attention.tiles``: the tile sweep's command."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
