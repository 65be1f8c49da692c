"""``python -m mmbalance.bench.attention``: the room's command, :func:`mmbalance.bench.attention.main`."""

from . import main

if __name__ == "__main__":
    main()
