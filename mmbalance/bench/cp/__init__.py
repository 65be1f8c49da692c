"""Context parallelism per step, modelled and real: ``mmbalance bench cp`` (``python -m mmbalance.bench.cp``).

Read ``data.py`` (the datasets and the steps drawn from them) and ``schemes.py`` (the schemes
compared, as schedules timed by one cost model), then the lines measured on them: ``vlm.py``
(vision-language data, ``--vlm``), ``window.py`` (the sliding-window model line) and ``real.py``
(real steps of a tiny Llama on gloo ranks through torchrun, ``--real``); on top ``sweep.py`` (the
modelled sweep over datasets, ranks and budgets, its tables and plot, and the command).
"""

from .sweep import main

__all__ = ["main"]
