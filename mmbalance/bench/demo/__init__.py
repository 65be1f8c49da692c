"""The end-to-end demo: ``mmbalance demo`` (``python -m mmbalance.bench.demo``).

Read ``model.py`` (a small three-modality model: varlen vision and audio encoders, an LLM block run
by a group of ranks with ring attention and tensor-parallel linears) and ``train.py`` (a balanced
training step on real data sizes on N ranks, its report, plot and the command).
"""

from .train import main

__all__ = ["main"]
