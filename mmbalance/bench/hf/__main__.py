"""``python -m mmbalance.bench.hf``: the room's command, :func:`mmbalance.bench.hf.main`."""

from . import main

if __name__ == "__main__":
    main()
