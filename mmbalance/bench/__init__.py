"""Benchmarks, the demo and the simulator (``mmbalance bench <name>``, ``mmbalance demo``,
``mmbalance simulate``), in rooms by what they measure: ``planners/``, ``cp/``, ``attention/``,
``moves/``, ``kernel_audit/``, ``hf/`` and ``demo/`` (``python -m mmbalance.bench.<room>`` runs a
room's command), beside what every room uses: ``harness.py``, ``profile.py`` and ``regress.py``."""
