"""Attention: the block ops against SDPA and flash-attn, one long sequence's time and memory, the ring.

``mmbalance bench attention`` (``python -m mmbalance.bench.attention``) runs the three parts: read
``long.py`` (one long causal sequence on CPU, each variant in a fresh process: time and peak memory
against SDPA), ``ring.py`` (ring attention on several ranks against one rank, and how much of its
communication is hidden) and ``blocks.py`` (throughput of the block ops, and the command).
"""

from .blocks import main

__all__ = ["main"]
